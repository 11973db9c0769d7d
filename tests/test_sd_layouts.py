"""The SD layout matrix: tiny Stable Diffusion (UNet, with and without the
text encoder trained; caption dropout, EMA) trains 3 steps under each data-parallel layout exactly
like one process: losses and global grad norms within 1e-5 relative per step,
parameters and the EMA within 1e-5 after the last step (fp32, gloo).

One spawn runs every two-rank layout in a row; the single-process reference
is computed in the parent.
"""

from __future__ import annotations

import pytest
import sd_harness as H

from giantmodel.testing import run_ranks

TWO_RANKS = [
    ["parallel.dp=2", "parallel.zero=0"],
    ["parallel.dp=2", "parallel.zero=1"],
    ["parallel.dp=2", "parallel.zero=2"],
    ["parallel.dp=2", "parallel.zero=3"],
    ["parallel.dp=2", "parallel.zero=3", "recompute=full"],
    ["parallel.dp=2", "parallel.zero=1", "recompute=full"],
    ["parallel.dp=2", "parallel.zero=3", "sd.train_text_encoder=true"],
    ["parallel.dp=2", "parallel.zero=2", "sd.train_text_encoder=true"],
]

# Mixed precision: compared with one process in the same precision, which
# rounds differently, so only a loose match is meaningful.
MIXED = [
    ["parallel.dp=2", "parallel.zero=3", "precision=bf16"],
    ["parallel.dp=2", "parallel.zero=1", "precision=fp16"],
]


def _check(cases, results, cache, **tol):
    refs: dict = {}
    failures = []
    for overrides, result in zip(cases, results, strict=True):
        key = tuple(o for o in overrides if not o.startswith("parallel."))
        if key not in refs:
            refs[key] = H.reference(list(overrides), cache)
        try:
            H.assert_matches(result, refs[key], str(overrides), **tol)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sd_two_rank_layouts_match_single_process(tmp_path):
    cache = str(tmp_path)
    results = run_ranks(H.run_cases, 2, TWO_RANKS + MIXED, cache, timeout=500)[0]
    _check(TWO_RANKS, results[:len(TWO_RANKS)], cache)
    # Adam's early steps move a weight by about lr whatever the gradient's size, so
    # rounding that flips a tiny gradient's sign moves it by up to 2 lr a step:
    # 3 steps x 2 x 0.002 = 1.2e-2 bounds the parameter difference
    _check(MIXED, results[len(TWO_RANKS):], cache, rtol=2e-2, param_tol=1.5e-2)


# HSDP: 2 replicas x 2 shards; and ZeRO-2 sharded over groups of 2 of the 4 ranks
FOUR_RANKS = [
    ["parallel.dp=4", "parallel.zero=3", "parallel.shard_group_size=2"],
    ["parallel.dp=4", "parallel.zero=2", "parallel.shard_group_size=2"],
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sd_four_rank_hsdp_matches_single_process(tmp_path):
    cache = str(tmp_path)
    results = run_ranks(H.run_cases, 4, FOUR_RANKS, cache, timeout=500)[0]
    _check(FOUR_RANKS, results, cache)
