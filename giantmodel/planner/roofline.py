"""The roofline primitives of the time model: how long a GEMM and a pass
over memory take on a device. Their own module so that the attention model
(:mod:`giantmodel.planner.attention`) and the block model
(:mod:`giantmodel.planner.perf`, which imports the attention model) share
them without a cycle."""

from __future__ import annotations

import bisect
import math

from giantmodel.planner.terms import DTYPE_BYTES


def matmul_rate(hw, precision: str, m: float, k: float, n: float) -> float:
    """Achievable FLOP/s of an (m x k) @ (k x n) GEMM.

    With a measured curve (``giantmodel bench hw``) the rate is interpolated
    at the GEMM's cube-root size. Otherwise: the large-GEMM efficiency, scaled
    by how well the output's 128 x 128 tiles fill the device (half-filled at
    ``matmul_tile_knee`` tiles, about one wave) and by the depth of the k loop
    (half-rate at ``matmul_k_knee``)."""
    curve = (hw.matmul_curve or {}).get(precision)
    if curve:
        size = (m * k * n) ** (1.0 / 3.0)
        sizes = [p[0] for p in curve]
        i = bisect.bisect_left(sizes, size)
        if i == 0:
            return curve[0][1] * size / sizes[0]   # below the smallest measured: scale down
        if i == len(curve):
            return curve[-1][1]
        (s0, r0), (s1, r1) = curve[i - 1], curve[i]
        w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return r0 + w * (r1 - r0)
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    eff = (hw.matmul_efficiency * tiles / (tiles + hw.matmul_tile_knee)
           * k / (k + hw.matmul_k_knee))
    return hw.flops(precision) * eff


def gemm_time(hw, precision: str, m: float, k: float, n: float) -> float:
    c = DTYPE_BYTES[precision]
    t_math = 2.0 * m * k * n / matmul_rate(hw, precision, m, k, n)
    t_mem = c * (m * k + k * n + m * n) / (hw.memory_bw * hw.memory_efficiency)
    return max(t_math, t_mem)


def mem_time(hw, nbytes: float) -> float:
    return nbytes / (hw.memory_bw * hw.memory_efficiency)
