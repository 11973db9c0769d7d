"""Fine-tuning under parallel layouts: LoRA at dp2 / ZeRO-1 / ZeRO-3 / tp2 /
tp2+sp / pp2 trains 5 steps exactly like one process, and so does full
fine-tuning on packed batches (block-diagonal attention, restarting
positions) starting from a Hugging Face directory (``checkpoint.init_from``)
at the same layouts. Tiny LLaMA, fp32, gloo; one spawn of 2 ranks runs every
case; the single-process references are computed in the parent.
"""

from __future__ import annotations

import layout_harness as H
import numpy as np
import pytest
import torch

from giantmodel.models import build_model, init_weights
from giantmodel.models.hf import to_hf
from giantmodel.models.lora import is_lora_param
from giantmodel.testing import run_ranks

LORA = ["objective=lora", "lora.rank=4", "lora.alpha=8.0", "lora.targets=[all_linear]",
        "optim.lr=0.01"]
PACK = ["data.source=sft", "data.pack=true"]
LAYOUTS = [
    ["parallel.dp=2", "parallel.zero=1"],
    ["parallel.dp=2", "parallel.zero=3"],
    ["parallel.tp=2"],
    ["parallel.tp=2", "parallel.sp=true"],
    ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> str:
    """A HF directory with weights that differ from the run's own random init."""
    cfg = H.make_config("llama", [])
    model = build_model(cfg.model, device="cpu")
    init_weights(model, cfg.model, seed=cfg.train.seed + 1)
    out = tmp_path_factory.mktemp("hf") / "tiny"
    to_hf(model, cfg.model, out)
    return str(out)


def _cases(init: str) -> list[tuple[str, list[str]]]:
    start = [f"checkpoint.init_from={init}"]
    lora = [("llama", LORA + layout) for layout in LAYOUTS]
    full_sft = [("llama", PACK + start + layout) for layout in LAYOUTS]
    lora_sft = [("llama", LORA + PACK + start + layout)
                for layout in (["parallel.tp=2"], ["parallel.pp=2"], ["parallel.dp=2", "parallel.zero=3"])]
    return lora + full_sft + lora_sft


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_lora_and_packed_fine_tuning_layouts_match_single_process(pretrained):
    cases = _cases(pretrained)
    results = run_ranks(H.run_cases, 2, cases, timeout=300)[0]
    refs: dict = {}
    failures = []
    for (arch, overrides), result in zip(cases, results, strict=True):
        key = tuple(o for o in overrides if not o.startswith("parallel."))
        if key not in refs:
            refs[key] = H.reference(arch, overrides)
        try:
            H.assert_matches(result, refs[key], f"{arch} {overrides}")
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)

    lora_ref = refs[tuple(LORA)]
    start = H.run_steps(H.make_config("llama", LORA), steps=0)["params"]
    # The base stays frozen; every adapter B (zero at the start) has moved.
    for name, value in lora_ref["params"].items():
        if is_lora_param(name):
            if "lora_B" in name:
                assert float(start[name].abs().max()) == 0.0
                assert float(value.abs().max()) > 1e-4, name
        else:
            assert torch.equal(value, start[name]), f"{name}: frozen base weight changed"

    # init_from really was read (weights differ from the run's own init) ...
    hf_ref = refs[tuple(PACK + [f"checkpoint.init_from={pretrained}"])]
    own = H.run_steps(H.make_config("llama", PACK), steps=0)["params"]
    from giantmodel.checkpoint import load_model_from_checkpoint

    saved = dict(load_model_from_checkpoint(pretrained).named_parameters())
    for name, value in hf_ref["start"].items():
        torch.testing.assert_close(value, saved[name].detach(), rtol=0, atol=0)
    assert any(not torch.equal(own[n], saved[n].detach()) for n in own)
    # ... and every layout started from those weights too.
    for (_, overrides), result in zip(cases, results, strict=True):
        if result["start"] is not None:
            for name, value in result["start"].items():
                if not is_lora_param(name):
                    np.testing.assert_array_equal(value, saved[name].detach().numpy(),
                                                  err_msg=f"{overrides} {name}")

    # Packing really confines attention: the same tokens unpacked train differently.
    unpacked = H.reference("llama", [f"checkpoint.init_from={pretrained}"], steps=1)
    assert abs(unpacked["losses"][0] - hf_ref["losses"][0]) > 1e-4
