"""``giantmodel convert`` through its main(): HF -> giantmodel -> HF, and a
checkpoint written during training (with the run's config.yaml) -> HF."""

from __future__ import annotations

import argparse

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from giantmodel.checkpoint import CheckpointManager, ModelState, OptimizerState, load_model_from_checkpoint
from giantmodel.checkpoint.convert import add_arguments, main
from giantmodel.config.errors import UserInputError
from giantmodel.config.loader import to_dict
from giantmodel.config.model import ModelConfig
from giantmodel.config.train import CheckpointConfig
from giantmodel.models import build_model, init_weights


def run_convert(*argv) -> int:
    parser = argparse.ArgumentParser(prog="giantmodel convert")
    add_arguments(parser)
    return main(parser.parse_args([str(a) for a in argv]))


def _tokens(vocab):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.timeout(90)
def test_hf_to_giantmodel_to_hf(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=96, max_position_embeddings=32)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path / "hf")
    tokens = _tokens(96)
    with torch.no_grad():
        ref = hf(tokens).logits

    assert run_convert(tmp_path / "hf", tmp_path / "run") == 0
    run = tmp_path / "run"
    assert (run / "checkpoints" / "step-00000000" / ".metadata").is_file()
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["num_kv_heads"] == 2
    model = load_model_from_checkpoint(run)
    with torch.no_grad():
        assert (model(tokens) - ref).abs().max().item() <= 1e-5

    assert run_convert(run, tmp_path / "back", "--to", "hf") == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert (back(tokens).logits - ref).abs().max().item() <= 1e-5
    with pytest.raises(UserInputError, match="already holds model weights"):
        run_convert(run, tmp_path / "back")
    with pytest.raises(UserInputError, match="already holds a giantmodel run"):
        run_convert(tmp_path / "hf", run)


@pytest.mark.timeout(90)
def test_training_checkpoint_to_hf(tmp_path):
    """A GPT checkpoint saved with its optimizer, next to the run's
    config.yaml, exports to a GPT2LMHeadModel with the same logits."""
    cfg = ModelConfig(arch="gpt", name="gpt-tiny", hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=None, ffn_hidden_size=128, vocab_size=80, max_seq_len=16,
                      tie_embeddings=True)
    model = init_weights(build_model(cfg), cfg, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_tokens(80)).square().mean().backward()
    opt.step()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": to_dict(cfg),
                                                           "train": {"steps": 7}}))
    mgr = CheckpointManager(CheckpointConfig(), tmp_path, is_rank0=True)
    mgr.save(7, {"model": ModelState([model]), "optimizer": OptimizerState([model], opt)})

    out = tmp_path / "hf"
    assert run_convert(tmp_path / "checkpoints", out, "--max-shard-size", "20KB") == 0
    assert (out / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    tokens = _tokens(80)
    with torch.no_grad():
        assert (hf(tokens).logits - model.eval()(tokens)).abs().max().item() <= 1e-5

    with pytest.raises(UserInputError, match="not a complete checkpoint"):
        run_convert(tmp_path, tmp_path / "hf2", "--step", "3")
    with pytest.raises(UserInputError, match="no such directory"):
        run_convert(tmp_path / "missing", tmp_path / "x")
