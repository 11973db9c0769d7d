"""FLOP accounting for tokens/s -> TFLOP/s -> MFU.

Model FLOPs follow Chowdhery et al. 2022 (PaLM), Appendix B: per trained token
``6 * N + 12 * L * H * Q * T``, where N is the non-embedding parameter count,
L layers, H heads, Q head dim and T the sequence length (the second term is
attention's QK^T and AV matmuls, forward and backward). Recomputation is not
counted: MFU measures useful model work, not hardware work.
"""

from __future__ import annotations

import os
from functools import cache

import torch

# Dense peak TFLOP/s (no sparsity) by GPU name fragment and dtype.
_GPU_PEAKS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "V100": {"bf16": 125.0, "fp16": 125.0, "fp32": 15.7},
}


def flops_per_token(model_cfg, seq_len: int) -> float:
    n = model_cfg.num_params(include_embeddings=False)
    # The output head is a matmul over the vocabulary: count it (PaLM counts
    # all non-input-embedding weights).
    n += model_cfg.vocab_size * model_cfg.hidden_size
    L, H, Q = model_cfg.num_layers, model_cfg.num_heads, model_cfg.dim_per_head
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


@cache
def cpu_peak_flops() -> float:
    """Theoretical fp32 FLOP/s of this host: cores x clock x FLOPs per cycle.

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
    return (os.cpu_count() or 1) * (mhz or 2000.0) * 1e6 * per_cycle


def peak_flops(device: torch.device, precision: str) -> float:
    """Peak FLOP/s of one device, for MFU. ``GIANTMODEL_PEAK_TFLOPS`` overrides.

    On CPUs the host's theoretical fp32 peak (:func:`cpu_peak_flops`) is split
    evenly among the ranks on the host."""
    override = os.environ.get("GIANTMODEL_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in _GPU_PEAKS.items():
            if key in name:
                return peaks[precision] * 1e12
        return 0.0
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return cpu_peak_flops() / max(1, local_ranks)
