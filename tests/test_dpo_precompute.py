"""``dpo.precompute_ref``: one reference pass before the first loss gives the
same losses as the reference forward every step, no reference forward runs
during training, and the table in run.dir is reused by a resumed run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from giantmodel.objectives.dpo_ref import TABLE_FILE, RefTable
from tests.test_dpo import STEPS, pairs_file, run_dpo  # noqa: F401  (pairs_file: a fixture)


@pytest.mark.parametrize("extra", [["dpo.use_lora=true"], ["data.pack=true"]],
                         ids=["lora", "full-packed"])
def test_precomputed_reference_matches_and_is_reused(pairs_file, tmp_path, extra):  # noqa: F811
    data = [f"data.paths=[{pairs_file}]", f"run.dir={tmp_path / 'run'}"] + extra
    live = run_dpo(data)
    assert live["objective"].ref_forwards == STEPS * 2  # two micro-batches a step
    first = run_dpo(data + ["dpo.precompute_ref=true"])
    obj = first["objective"]
    np.testing.assert_allclose(first["losses"], live["losses"], rtol=0, atol=1e-6)
    for a, b in zip(first["metrics"], live["metrics"], strict=True):
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=1e-6), k
    # every pair row scored once, in micro-batches of 2 pair rows, then none
    pair_rows = len(obj.ref_table.keys)
    assert obj.ref_forwards == -(-pair_rows // 2)
    path = tmp_path / "run" / TABLE_FILE
    saved = RefTable.load(path)
    assert saved is not None and saved.keys == obj.ref_table.keys
    assert torch.equal(saved.logps, obj.ref_table.logps)
    assert (saved.logps[:, :, 0] < 0).all()  # every row's first pair was scored
    if "data.pack=true" in extra:  # packed rows hold 1 or 2 pairs: a row's 2nd column may be 0
        assert saved.logps.shape[2] == 2 and (saved.logps[:, 0, 1] != 0).any()
        assert (saved.logps[:, 0, 1] == 0).any()
    resumed = run_dpo(data + ["dpo.precompute_ref=true"])
    assert resumed["objective"].ref_forwards == 0  # the table was read, not rebuilt
    np.testing.assert_allclose(resumed["losses"], first["losses"], rtol=0, atol=1e-7)


def _precompute_cases(rank: int, world: int, cases: list) -> list:
    out = []
    for overrides in cases:
        run = run_dpo(overrides)
        out.append({"losses": run["losses"], "forwards": run["objective"].ref_forwards,
                    "pair_rows": len(run["objective"].ref_table.keys)})
    return out


def test_precompute_on_dp2_zero3_and_tp2(pairs_file, tmp_path):  # noqa: F811
    from giantmodel.testing import run_ranks

    data = [f"data.paths=[{pairs_file}]", "dpo.precompute_ref=true"]
    cases = [data + ["dpo.use_lora=true", "parallel.dp=2", "parallel.zero=3",
                     f"run.dir={tmp_path / 'dp'}"],
             data + ["data.pack=true", "parallel.tp=2", f"run.dir={tmp_path / 'tp'}"]]
    results = run_ranks(_precompute_cases, 2, cases, timeout=300)[0]
    for overrides, got in zip(cases, results, strict=True):
        live = run_dpo([o for o in overrides if not o.startswith(("parallel.", "dpo.pre"))])
        np.testing.assert_allclose(got["losses"], live["losses"], rtol=1e-5,
                                   err_msg=" ".join(overrides))
        dp = 2 if "parallel.dp=2" in overrides else 1
        # each dp rank scores its share, two pair rows per forward
        assert got["forwards"] == math.ceil(math.ceil(got["pair_rows"] / dp) / 2)
        assert (tmp_path / overrides[-1].split("/")[-1] / TABLE_FILE).exists()
