"""The preference objective cuts each micro-batch's trailing padding columns
before its forwards (pair rows are padded to train.seq_len; TRL pads a batch
to its longest sequence): the steps are those of the whole rows, on one
process and under tensor + sequence parallelism (the width a multiple of
tp there)."""

from __future__ import annotations

import numpy as np
import pytest

from giantmodel.core.loss import IGNORE_INDEX
from giantmodel.objectives.dpo import DPO
from giantmodel.testing import run_ranks
from tests.test_dpo import _cases, pairs_file, run_dpo  # noqa: F401  (pairs_file: a fixture)


def _same_run(got: dict, want: dict, label: str) -> None:
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5, err_msg=label)
    for a, b in zip(got["metrics"], want["metrics"], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if k == "rewards/accuracies" and abs(b["rewards/margins"]) < 1e-6:
                continue  # ties (policy == reference): a count of rounding signs
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (label, k)
    for name, w in want["params"].items():
        np.testing.assert_allclose(got["params"][name], w, rtol=1e-5, atol=1e-5,
                                   err_msg=f"{label}: {name}")


@pytest.mark.parametrize("extra", [[], ["data.pack=true", "dpo.loss_type=ipo"],
                                   ["dpo.use_lora=true", "dpo.precompute_ref=true"]],
                         ids=["full", "full-packed-ipo", "lora-precompute"])
def test_trimmed_steps_equal_whole_rows(pairs_file, monkeypatch, extra):  # noqa: F811
    data = [f"data.paths=[{pairs_file}]"] + extra
    widths: list[int] = []
    trim = DPO._trimmed

    def recording(self, batch, device):
        cut = trim(self, batch, device)
        w = cut["labels"].shape[1]
        widths.append(w)
        # nothing scored or attended is cut off, and on the CPU nothing more
        assert (batch["labels"][:, w:] == IGNORE_INDEX).all()
        assert (batch["document_ids"][:, w:] < 0).all()
        assert (batch["document_ids"][:, w - 1] >= 0).any()
        return cut

    monkeypatch.setattr(DPO, "_trimmed", recording)
    trimmed = run_dpo(data)
    assert min(widths) < 64, widths  # seq_len 64 (packed rows may fill it)
    monkeypatch.setattr(DPO, "_trimmed", lambda self, batch, device: batch)
    _same_run(trimmed, run_dpo(data), " ".join(extra))


def test_trimmed_under_tp2_sp_equal_one_process(pairs_file):  # noqa: F811
    data = [f"data.paths=[{pairs_file}]"]
    cases = [data + ["parallel.tp=2", "parallel.sp=true"],
             data + ["dpo.use_lora=true", "data.pack=true", "parallel.tp=2", "parallel.sp=true"]]
    results = run_ranks(_cases, 2, cases, timeout=300)[0]
    for overrides, got in zip(cases, results, strict=True):
        got.pop("ref_share")
        want = run_dpo([o for o in overrides if not o.startswith("parallel.")])
        _same_run(got, want, " ".join(overrides[1:]))
