"""bf16 layouts against the fp32 single process (issue: activation memory).

Under bf16 the residual stream, the norms' outputs and every saved
activation are bf16 (giantmodel.models.common.fused), with fp32 master
weights, fp32 norm statistics and an fp32 loss. A bf16 run therefore
differs from fp32 by rounding, not by a different computation: each bf16
value carries a relative error up to the unit roundoff u = 2^-9 (8
significant bits). The per-step loss is a mean over tokens of a
log-softmax of logits that went through two blocks of a handful of rounded
ops each; the rounding errors of different tokens average out (measured:
4.5e-5 relative at worst over five steps), so the loss stays well within
one u of fp32, the bound used (1.95e-3 relative). A real error (a missing
reduction, a stale weight cast, a dropped gradient) moves the loss by far
more after the first update. The same holds on every layout: dp2 (ZeRO-1
and ZeRO-3), tp2 + sp and pp2."""

from __future__ import annotations

import layout_harness as H

from giantmodel.testing import run_ranks

U = 2.0 ** -9
LOSS_RTOL = U
CASES = [
    ("llama", ["parallel.dp=2", "parallel.zero=1", "precision=bf16"]),
    ("llama", ["parallel.dp=2", "parallel.zero=3", "precision=bf16"]),
    ("llama", ["parallel.tp=2", "parallel.sp=true", "precision=bf16"]),
    ("llama", ["parallel.pp=2", "precision=bf16"]),
]


def test_bf16_layouts_follow_fp32_within_bf16_rounding():
    ref = H.reference("llama", [])
    results = run_ranks(H.run_cases, 2, CASES, timeout=240)[0]
    worst = 0.0
    for (_arch, overrides), result in zip(CASES, results, strict=True):
        for step, (a, b) in enumerate(zip(result["losses"], ref["losses"], strict=True)):
            rel = abs(a - b) / abs(b)
            worst = max(worst, rel)
            assert rel <= LOSS_RTOL, (overrides, step, a, b, rel)
        # the run trained: its loss moved as the fp32 run's did
        moved, ref_moved = (r["losses"][0] - r["losses"][-1] for r in (result, ref))
        assert moved > 0.5 * ref_moved, (overrides, moved, ref_moved)
    print("worst relative loss difference from fp32:", worst)
