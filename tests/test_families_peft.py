"""``giantmodel convert --to peft`` through each family's own HF names:
Gemma 3 (its own norm names around the same projections), Phi-3 (q/k/v
and gate/up adapters combined into one exact LoRA on the fused
``qkv_proj`` / ``gate_up_proj``, all of their parts adapted or some) and
GPT-2 (fused, transposed Conv1D weights). transformers + peft on the
exported adapter agrees with ``--merge-lora`` within 1e-5."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from hf_helpers import lora_run_dir  # noqa: E402
from test_families_gemma_phi import GEMMA_TYPES, make_hf  # noqa: E402

from giantmodel.checkpoint.convert import add_arguments, main  # noqa: E402

TOL = 1e-5


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


CASES = [
    # name, base model, targets, expected adapter_config entries
    ("gemma3", lambda: make_hf("gemma3", head_dim=24, sliding_window=8,
                               layer_types=GEMMA_TYPES, query_pre_attn_scalar=20),
     ["all_linear"], {"target_modules": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                         "up_proj", "v_proj"], "rank_pattern": {}}),
    ("phi3", lambda: make_hf("phi3"), ["all_linear"],
     {"target_modules": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"],
      "rank_pattern": {"self_attn.qkv_proj": 12, "mlp.gate_up_proj": 8},
      "alpha_pattern": {"self_attn.qkv_proj": 24.0, "mlp.gate_up_proj": 16.0}}),
    # q and v of qkv_proj (k's rows stay unadapted), up of gate_up_proj alone
    ("phi3_some", lambda: make_hf("phi3"), ["q_proj", "v_proj", "up_proj"],
     {"target_modules": ["gate_up_proj", "qkv_proj"],
      "rank_pattern": {"self_attn.qkv_proj": 8}}),
    ("gpt2", _gpt2, ["all_linear"],
     {"target_modules": ["attn.c_proj", "c_attn", "c_fc", "mlp.c_proj"],
      "fan_in_fan_out": True}),
]


@pytest.mark.timeout(180)
def test_peft_export_matches_merged(tmp_path):
    from giantmodel.checkpoint import load_model_from_checkpoint

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    for name, make, targets, expect in CASES:
        base, run = tmp_path / f"{name}-base", tmp_path / f"{name}-run"
        make().save_pretrained(base)
        lora_run_dir(run, base, targets)
        adapter, merged_dir = tmp_path / f"{name}-peft", tmp_path / f"{name}-merged"
        assert main(parser.parse_args([str(run), str(adapter), "--to", "peft"])) == 0
        assert main(parser.parse_args([str(run), str(merged_dir), "--to", "hf",
                                       "--merge-lora"])) == 0
        config = json.loads((adapter / "adapter_config.json").read_text())
        for key, value in expect.items():
            assert config[key] == value, (name, key, config[key])
        with torch.no_grad():
            ours = load_model_from_checkpoint(run)(tokens)
            merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
            merged = merged(tokens).logits
            base_model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
            plain = base_model(tokens).logits
            with_adapter = peft.PeftModel.from_pretrained(base_model, adapter).eval()
            with_adapter = with_adapter(tokens).logits
        assert (ours - plain).abs().max().item() > 1e-3, name  # the adapters matter
        assert (ours - merged).abs().max().item() < TOL, name
        assert (with_adapter - merged).abs().max().item() < TOL, name


def test_fused_adapter_is_each_parts_update():
    """B A of the combined adapter is, row block by row block, each part's
    own B A (zero where a part has none)."""
    from giantmodel.models.lora import _fused_adapter

    g = torch.Generator().manual_seed(0)
    parts = {"q": (torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)),
             "v": (torch.randn(2, 5, generator=g), torch.randn(3, 2, generator=g))}
    a, b = _fused_adapter(("q", "k", "v"), (6, 3, 3), parts)
    assert a.shape == (4, 5) and b.shape == (12, 4)
    delta = b @ a
    torch.testing.assert_close(delta[:6], parts["q"][1] @ parts["q"][0])
    assert torch.equal(delta[6:9], torch.zeros(3, 5))
    torch.testing.assert_close(delta[9:], parts["v"][1] @ parts["v"][0])
