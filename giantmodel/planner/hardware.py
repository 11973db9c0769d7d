"""Hardware profiles: what one accelerator and its links can do.

Figures are vendor datasheet peaks (dense, no sparsity) for the SXM/OAM parts
unless the name says otherwise. Link bandwidths are per GPU and per direction,
which is what a ring or tree collective can drive. The ``*_efficiency``
fields (and ``matmul_tile_knee``) say which share of a peak real kernels
reach; they are the only tuned numbers in the planner, fitted on one
published source only (``benchmarks/planner_published.py --fit``) and tested
on the others (``benchmarks/results/planner-published-2026-11-24.md``).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from giantmodel.config.errors import ConfigError

GB = 1e9
GIB = 1024 ** 3
TFLOPS = 1e12


@dataclass
class HardwareProfile:
    """One accelerator type and the links around it."""

    name: str
    """Profile name, as given to ``--gpu``."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per precision: keys fp32, bf16, fp16 (fp32 means plain fp32, not TF32)."""
    memory_bytes: float
    """Device memory capacity in bytes."""
    memory_bw: float
    """Device memory bandwidth in bytes/s."""
    intra_link: str
    """Intra-node link between GPUs: nvlink2/3/4, pcie3/4/5, or shm (host memory)."""
    intra_bw: float
    """Intra-node bandwidth per GPU per direction, bytes/s."""
    inter_bw: float
    """Inter-node network bandwidth per GPU per direction, bytes/s."""
    host_bw: float = 25 * GB
    """GPU <-> host copy bandwidth per GPU (activation/optimizer offload), bytes/s."""
    gpus_per_node: int = 8
    """Default GPUs per node for this machine type."""
    matmul_efficiency: float = 0.82
    """Share of peak FLOP/s that large GEMMs reach (cuBLAS, well-shaped, bf16)."""
    matmul_tile_knee: float = 32.0
    """Output tiles (128 x 128) at which a GEMM reaches half of ``matmul_efficiency``'s rate:
    about one wave of thread blocks over the device's multiprocessors."""
    matmul_k_knee: float = 128.0
    """Inner dimension k at which a GEMM's main loop reaches half rate (load/store overhead)."""
    matmul_curve: dict[str, list[list[float]]] | None = None
    """Measured GEMM rate per precision: [[cube-root size, FLOP/s], ...] by size; when present it
    replaces the efficiency model (written by ``giantmodel bench hw``)."""
    grouped_gemm_efficiency: float = 0.70
    """Share of peak FLOP/s that the routed experts' grouped GEMM (``torch._grouped_mm``) reaches
    on large per-expert problems, below ``matmul_efficiency``: one kernel walks many problems
    whose shapes it learns on the device (no per-shape tuning), each expert's rows are padded to
    the kernel's alignment, and the permuted rows are gathered; per-expert row counts that do not
    fill 128-row tiles cost more on top (:func:`giantmodel.planner.moe.grouped_gemm_time`). 0.70
    is about 85% of the dense 0.82, the share grouped GEMMs reach of cuBLAS dense GEMMs of the
    same total size on Hopper in bf16."""
    attention_efficiency: float = 0.45
    """Share of peak FLOP/s that fused (flash) attention reaches, forward; backward is a bit lower."""
    memory_efficiency: float = 0.40
    """Share of memory bandwidth that elementwise kernels reach."""
    stream_efficiency: float = 0.80
    """Share of memory bandwidth that one long contiguous pass reaches (adding a micro-batch's
    gradients into their fp32 accumulators): STREAM-style add and triad kernels run at about
    80-90% of the datasheet bandwidth on A100 and H100. Measured by ``bench hw`` (its add test)."""
    adamw_rate: float | None = None
    """Parameters per second the optimizer updates; None: memory-bound, 32 bytes per parameter
    at ``memory_efficiency`` of the bandwidth (fused AdamW on a GPU). Measured by ``bench hw``."""
    dtensor_op_s: float = 0.0
    """Host seconds each aten op costs more when its arguments are DTensors (tensor and sequence
    parallelism): sharding propagation and re-wrapping in Python. Measured by ``bench hw``; 0 in
    the built-in GPU profiles, whose host dispatches ahead of the kernels (a layer's host time
    is hidden while it is shorter than the layer's kernels)."""
    fresh_memory_bw: float | None = None
    """Bytes/s at which a CPU host maps and first touches fresh memory (page faults). A buffer
    above glibc's largest mmap threshold is returned to the kernel when freed and faulted in
    again when next allocated, which the planner charges at this rate. Measured by ``bench hw``
    on CPU; None on GPUs, whose allocator caches blocks."""
    loss_elem_s: float | None = None
    """Seconds the loss costs per logit, forward and backward (log-softmax, its gradient, their
    fresh output buffers): on a CPU several times what the bytes moved suggest. Measured by
    ``bench hw`` on CPU at the planned model's micro-batch and vocabulary; None: memory-bound
    (GPUs)."""
    link_efficiency: float = 0.80
    """Share of link bandwidth that a large collective reaches (bus bandwidth / link bandwidth)."""
    latency_s: float = 10e-6
    """Per-hop latency of a collective step, seconds."""
    collective_sm_share: float = 0.0
    """Share of the device's multiprocessors that a running collective holds (NCCL runs one
    thread block per channel on a multiprocessor of its own): compute overlapped with it runs
    this much slower. 0 where nothing overlaps (a CPU host: the ranks' cores run both)."""
    reserved_bytes: float = 2.5 * GIB
    """Memory the framework cannot allocate: CUDA context, NCCL buffers, workspace."""
    host_memory_bytes: float = 1024 * GIB
    """Host memory per node, bytes (pinned buffers of activation offload)."""

    def flops(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise ConfigError(f"hardware profile {self.name!r} has no {precision} peak; it lists "
                              f"{', '.join(self.peak_flops)}", "precision")
        return self.peak_flops[precision]


NCCL_CHANNELS = 24
"""Thread blocks an NCCL collective runs at once on NVLink + InfiniBand nodes: one per
channel. NCCL's init log reports 24 to 32 "coll channels" on A100 and H100 nodes, and an
Nsight trace of an all-gather beside a GEMM on an H100 shows 24 blocks; the lower figure."""


def _gpu(name, fp32, bf16, mem_gb, bw_tbs, link, intra_gbs, inter_gbs, sms,
         **kw) -> HardwareProfile:
    return HardwareProfile(
        collective_sm_share=NCCL_CHANNELS / sms,
        name=name, peak_flops={"fp32": fp32 * TFLOPS, "bf16": bf16 * TFLOPS,
                               "fp16": kw.pop("fp16", bf16) * TFLOPS},
        memory_bytes=mem_gb * GB, memory_bw=bw_tbs * 1e12, intra_link=link,
        intra_bw=intra_gbs * GB, inter_bw=inter_gbs * GB, **kw)


# Sources: NVIDIA H100 / H200 / A100 / V100 datasheets. NVLink bandwidths are
# the bidirectional totals halved (900 -> 450 GB/s for NVLink4). Inter-node:
# one 400 Gb/s NDR port per GPU on H100/H200 systems (DGX H100), one 200 Gb/s
# HDR port per GPU on A100 systems (DGX A100), 100 Gb/s EDR on V100.
# Multiprocessors (the argument after the links): H100 SXM / H200 132, H100 PCIe
# 114, A100 108, V100 80.
BUILTIN: dict[str, HardwareProfile] = {p.name: p for p in (
    _gpu("h100-sxm", 67, 989, 80, 3.35, "nvlink4", 450, 50, 132, host_bw=55 * GB),
    _gpu("h100-pcie", 51, 756, 80, 2.0, "pcie5", 55, 25, 114, host_bw=55 * GB),
    _gpu("h200", 67, 989, 141, 4.8, "nvlink4", 450, 50, 132, host_bw=55 * GB),
    _gpu("a100-80g", 19.5, 312, 80, 2.039, "nvlink3", 300, 25, 108),
    _gpu("a100-40g", 19.5, 312, 40, 1.555, "nvlink3", 300, 25, 108),
    # A800: the A100 with NVLink cut to 400 GB/s (bidirectional).
    _gpu("a800", 19.5, 312, 80, 2.039, "nvlink3", 200, 25, 108),
    # V100 has no bf16 tensor cores: bf16 runs at the fp32 rate.
    _gpu("v100-32g", 15.7, 15.7, 32, 0.9, "nvlink2", 150, 12.5, 80, fp16=125, host_bw=12 * GB),
    _gpu("v100-16g", 15.7, 15.7, 16, 0.9, "nvlink2", 150, 12.5, 80, fp16=125, host_bw=12 * GB),
)}

MEASURED_PROFILE_FILE = Path(os.environ.get(
    "GIANTMODEL_HW_PROFILE", Path.home() / ".cache" / "giantmodel" / "hw-measured.yaml"))
"""Where ``giantmodel bench hw`` writes by default and ``--gpu measured`` reads."""


def cpu_profile() -> HardwareProfile:
    """This host as a 'device', with conservative defaults for a small server
    (``giantmodel bench hw`` then ``--gpu measured`` uses measured figures)."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 16 * GIB
    flops = 20e9 * (os.cpu_count() or 1)
    return HardwareProfile(
        name="cpu", peak_flops={"fp32": flops, "bf16": flops / 2, "fp16": flops / 4},
        memory_bytes=float(mem), memory_bw=20 * GB, intra_link="shm", intra_bw=3 * GB,
        inter_bw=1.25 * GB, host_bw=20 * GB, gpus_per_node=1, matmul_efficiency=0.6,
        matmul_tile_knee=1.0, matmul_k_knee=16.0,
        attention_efficiency=0.3, memory_efficiency=0.7, stream_efficiency=0.7,
        link_efficiency=0.5,
        latency_s=50e-6, reserved_bytes=0.5 * GIB, host_memory_bytes=float(mem))


def profile_from_dict(name: str, raw: dict, source: str) -> HardwareProfile:
    """A profile from a YAML mapping; unknown keys are errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"profile {name!r} in {source} must be a mapping")
    valid = {f.name for f in dataclasses.fields(HardwareProfile)}
    for key in raw:
        if key not in valid:
            close = difflib.get_close_matches(str(key), sorted(valid), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown key {key!r} in hardware profile {name!r} ({source}){hint}")
    kwargs = dict(raw)
    kwargs["name"] = name
    missing = [f.name for f in dataclasses.fields(HardwareProfile)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               and f.name not in kwargs]
    if missing:
        raise ConfigError(f"hardware profile {name!r} ({source}) lacks {', '.join(missing)}")
    kwargs["peak_flops"] = {str(k): float(v) for k, v in kwargs["peak_flops"].items()}
    if kwargs.get("matmul_curve") is not None:
        kwargs["matmul_curve"] = _curve(kwargs["matmul_curve"], name, source)
    for key, value in kwargs.items():
        if key in ("name", "peak_flops", "intra_link", "matmul_curve"):
            continue
        if key in ("adamw_rate", "fresh_memory_bw", "loss_elem_s") and value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} in hardware profile {name!r} must be a number, got {value!r}")
    return HardwareProfile(**kwargs)


def _curve(raw, name: str, source: str) -> dict[str, list[list[float]]]:
    """matmul_curve: {precision: [[size, FLOP/s], ...]} with sizes increasing."""
    bad = ConfigError(f"matmul_curve in hardware profile {name!r} ({source}) must map a precision "
                      "to a list of [size, FLOP/s] pairs with increasing sizes")
    if not isinstance(raw, dict):
        raise bad
    out = {}
    for prec, pts in raw.items():
        try:
            pairs = [[float(a), float(b)] for a, b in pts]
        except (TypeError, ValueError):
            raise bad from None
        if not pairs or any(p[1] <= 0 for p in pairs) or \
                any(a[0] >= b[0] for a, b in itertools.pairwise(pairs)):
            raise bad
        out[str(prec)] = pairs
    return out


def load_profile_file(path: str | Path) -> dict[str, HardwareProfile]:
    """Profiles from a YAML file mapping names to profile fields (numbers in SI units)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"hardware profile file {path} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must map profile names to fields")
    return {str(k): profile_from_dict(str(k), v, str(path)) for k, v in raw.items()}


def profile_names(extra: dict[str, HardwareProfile] | None = None) -> list[str]:
    return sorted(set(BUILTIN) | {"cpu", "measured"} | set(extra or {}))


def single_profile(path: str | Path) -> HardwareProfile:
    """The one profile in ``path`` (what ``giantmodel bench hw`` writes)."""
    profiles = load_profile_file(path)
    if len(profiles) != 1:
        raise ConfigError(f"{path} holds {len(profiles)} profiles ({', '.join(profiles)}); "
                          "--profile needs a file with exactly one (or use --hw-file FILE "
                          "--gpu NAME)", "--profile")
    return next(iter(profiles.values()))


def get_profile(name: str, profile_file: str | Path | None = None) -> HardwareProfile:
    """Built-in or user profile by name; ``measured`` is the profile
    ``giantmodel bench hw`` wrote; an unknown name lists the valid ones."""
    if name == "measured" and not profile_file:
        if not MEASURED_PROFILE_FILE.exists():
            raise ConfigError(f"--gpu measured reads {MEASURED_PROFILE_FILE}, which does not "
                              "exist; run `giantmodel bench hw` first (or pass --profile FILE)",
                              "--gpu")
        return single_profile(MEASURED_PROFILE_FILE)
    extra = load_profile_file(profile_file) if profile_file else {}
    if name in extra:
        return extra[name]
    if name in BUILTIN:
        return dataclasses.replace(BUILTIN[name], peak_flops=dict(BUILTIN[name].peak_flops))
    if name == "cpu":
        return cpu_profile()
    names = profile_names(extra)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"unknown GPU {name!r}{hint}; valid names: {', '.join(names)}"
                      + ("" if profile_file else "; add your own with --hw-file FILE.yaml"), "--gpu")


def profile_to_dict(p: HardwareProfile) -> dict:
    d = dataclasses.asdict(p)
    d.pop("name")
    return d
