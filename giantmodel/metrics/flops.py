"""FLOP accounting for tokens/s -> TFLOP/s -> MFU.

Model FLOPs follow Chowdhery et al. 2022 (PaLM), Appendix B: per trained token
``6 * N + 12 * L * H * Q * T``, where N is the non-embedding parameter count,
L layers, H heads, Q head dim and T the sequence length (the second term is
attention's QK^T and AV matmuls, forward and backward). Recomputation is not
counted: MFU measures useful model work, not hardware work.
"""

from __future__ import annotations

import os
import time
from functools import lru_cache

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


@lru_cache(maxsize=None)
def _measured_cpu_peak(dtype: torch.dtype) -> float:
    """Achievable matmul FLOP/s of this CPU (all torch threads), measured once."""
    n = 1024
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.25:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def peak_flops(device: torch.device, precision: str) -> float:
    """Peak FLOP/s of one device, for MFU. ``GIANTMODEL_PEAK_TFLOPS`` overrides.

    On CPUs there is no datasheet figure to trust, so the peak is the measured
    rate of a large fp32 matmul: MFU there reads as "share of achievable"."""
    override = os.environ.get("GIANTMODEL_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in _GPU_PEAKS.items():
            if key in name:
                return peaks[precision] * 1e12
        return 0.0
    return _measured_cpu_peak(torch.float32)
