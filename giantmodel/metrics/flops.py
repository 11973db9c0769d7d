"""FLOP accounting for tokens/s -> TFLOP/s -> MFU.

Model FLOPs follow Chowdhery et al. 2022 (PaLM), Appendix B: per trained token
``6 * N + 12 * L * H * Q * T``, where N is the non-embedding parameter count,
L layers, H heads, Q head dim and T the sequence length (the second term is
attention's QK^T and AV matmuls, forward and backward). Recomputation is not
counted: MFU measures useful model work, not hardware work.
"""

from __future__ import annotations

import logging
import os
import socket
from functools import cache

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Dense peak TFLOP/s (no sparsity) by GPU name fragment and dtype, most
# specific fragment first: torch names the SXM H100 "NVIDIA H100 80GB HBM3",
# the others "NVIDIA H100 PCIe" / "NVIDIA H100 NVL", whose peaks are lower.
# A part without a dtype's tensor cores (V100: no bf16) has no entry for it.
# Sources: NVIDIA data sheets (H100, H200, A100, V100).
_GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H200 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H800", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("V100-PCIE", {"fp16": 112.0, "fp32": 14.0}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
)


def flops_per_token(model_cfg, seq_len: int) -> float:
    """Model FLOPs per trained token. For MoE models N counts the active
    parameters, the top_k routed experts a token goes to (plus router and
    shared experts), as Megatron-Core's MFU does; multi-head latent attention
    contracts QK^T over the query/key width and AV over the value width."""
    n = model_cfg.num_params(include_embeddings=False)
    moe = model_cfg.moe
    if moe is not None:   # drop the routed experts a token is not sent to
        sparse = len(moe.sparse_layers(model_cfg.num_layers))
        n -= sparse * (model_cfg.moe_ffn_params() - model_cfg.moe_ffn_params(active=True))
    # The output head is a matmul over the vocabulary: count it (PaLM counts
    # all non-input-embedding weights).
    n += model_cfg.vocab_size * model_cfg.hidden_size
    L, H, Q = model_cfg.num_layers, model_cfg.num_heads, model_cfg.dim_per_head
    if model_cfg.mla is not None:
        Q = (model_cfg.mla.qk_head_dim + model_cfg.mla.v_head_dim) / 2
    return 6.0 * n + 12.0 * L * H * Q * seq_len


def _cpuinfo() -> tuple[set[str], str, float]:
    flags: set[str] = set()
    vendor, mhz = "", 0.0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(value.split())
                elif key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "cpu MHz" and not mhz:
                    mhz = float(value)
    except OSError:
        pass
    try:  # the rated maximum beats the momentary clock when the kernel exposes it
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            mhz = int(f.read()) / 1000.0
    except (OSError, ValueError):
        pass
    return flags, vendor, mhz


def usable_cores(sysfs: str = "/sys/devices/system/cpu",
                 cpus: frozenset[int] | None = None) -> int:
    """Physical cores among ``cpus`` (default: this process's affinity mask:
    taskset, cgroups, Slurm), counting SMT siblings of one core once, since
    they share its vector units."""
    if cpus is None:
        try:
            cpus = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return os.cpu_count() or 1
    cores = set()
    for cpu in sorted(cpus):
        topo = f"{sysfs}/cpu{cpu}/topology"
        try:
            with open(f"{topo}/core_id") as f:
                core = f.read().strip()
            with open(f"{topo}/physical_package_id") as f:
                package = f.read().strip()
        except OSError:
            return len(cpus)  # no topology exposed: count logical CPUs
        cores.add((package, core))
    return max(1, len(cores))


@cache
def cpu_peak_flops(cpus: frozenset[int] | None = None) -> float:
    """Theoretical fp32 FLOP/s of ``cpus`` (default: the cores this process
    may use): physical cores x clock x FLOPs per cycle.

    FLOPs per cycle from the vector ISA: two 512-bit FMA pipes on Intel
    AVX-512 parts (64), two 256-bit FMA pipes on AVX2+FMA parts and on AMD
    Zen 4, which runs AVX-512 on 256-bit units (32), SSE otherwise (16)."""
    flags, vendor, mhz = _cpuinfo()
    if "avx512f" in flags and vendor == "GenuineIntel":
        per_cycle = 64
    elif "avx2" in flags and "fma" in flags:
        per_cycle = 32
    else:
        per_cycle = 16
    return usable_cores(cpus=cpus) * (mhz or 2000.0) * 1e6 * per_cycle


def gpu_peak_tflops(name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of the GPU called ``name`` in ``precision``; None
    when the part is not on record or lacks that precision's tensor cores."""
    for fragment, peaks in _GPU_PEAKS:
        if fragment in name:
            return peaks.get(precision)
    return None


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def peak_flops(device: torch.device, precision: str) -> float:
    """Peak FLOP/s of one device, for MFU; 0.0 (MFU not reported, with one
    warning) for a GPU not on record. ``GIANTMODEL_PEAK_TFLOPS`` overrides.

    On CPUs the theoretical fp32 peak of the cores this process may use
    (:func:`cpu_peak_flops`) is split evenly among the ranks on the host."""
    override = os.environ.get("GIANTMODEL_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name, precision)
        if peak is None:
            _warn_once(f"{name}/{precision}",
                       f"no {precision} peak FLOP/s on record for GPU {name!r}: MFU is reported "
                       "as 0; set GIANTMODEL_PEAK_TFLOPS to its dense peak to report it")
            return 0.0
        return peak * 1e12
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return cpu_peak_flops() / max(1, local_ranks)


def job_peak_flops(device: torch.device, precision: str) -> float:
    """Peak FLOP/s of the whole job, the denominator of its MFU (collective
    when a process group exists: every rank must call it).

    GPU ranks each own a device, so the job's peak is the world's devices.
    CPU ranks on one host share its cores, and each may be pinned to its own
    share of them (``train.bind_cores``, ``srun --cpu-bind``) or not at all:
    no rank alone knows what the host gives the job. So each rank reports its
    host and the CPUs of its mask, and the job's peak is, per host, the peak of
    the union of its ranks' CPUs. (Dividing one rank's mask by the ranks per
    host counted a pinned rank's share twice: MFU 138-165% at dp2.)"""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if device.type != "cpu" or os.environ.get("GIANTMODEL_PEAK_TFLOPS"):
        return peak_flops(device, precision) * world
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = list(range(os.cpu_count() or 1))
    entries = [(socket.gethostname(), mine)]
    if world > 1:
        entries = [None] * world
        dist.all_gather_object(entries, (socket.gethostname(), mine))
    hosts: dict[str, set[int]] = {}
    for host, cpus in entries:
        hosts.setdefault(host, set()).update(cpus)
    return sum(cpu_peak_flops(frozenset(cpus)) for cpus in hosts.values())
