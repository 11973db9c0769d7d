"""LoRA through the real trainer and CLI: adapter-only checkpoints, resuming
one (base from ``checkpoint.init_from``) lands where an uninterrupted run
does, and ``giantmodel convert --to peft`` / ``--to hf --merge-lora`` give
Hugging Face models whose logits match giantmodel's within 1e-5 (fp32)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from giantmodel.checkpoint import load_model_from_checkpoint
from giantmodel.cli import main
from giantmodel.config import load_config
from giantmodel.models import build_model, init_weights
from giantmodel.models.hf import to_hf
from giantmodel.models.lora import is_lora_param
from giantmodel.train.trainer import Trainer

TOL = 1e-5
TINY = ["model.arch=llama", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.ffn_hidden_size=128", "model.vocab_size=256",
        "model.max_seq_len=64"]


def _config(run_dir, base, steps: int):
    return load_config(overrides=TINY + [
        "objective=lora", "lora.rank=4", "lora.alpha=8.0", "lora.targets=[all_linear]",
        "data.source=synthetic", f"checkpoint.init_from={base}", f"run.dir={run_dir}",
        f"train.steps={steps}", "train.seq_len=16", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.eval_every=0", "train.sample_tokens=0",
        "train.device=cpu", "checkpoint.every=2", "run.tensorboard=false", "run.progress=false",
        "optim.lr=0.01", "optim.warmup_steps=0", "optim.schedule=constant", "precision=fp32"])


def _train(cfg) -> int:
    """Train; returns the step the run started from (> 0 when it resumed)."""
    trainer = Trainer(cfg)
    try:
        start = trainer.state.step
        trainer.train()
    finally:
        trainer.close()
    return start


def _adapters(run_dir) -> dict[str, torch.Tensor]:
    model = load_model_from_checkpoint(run_dir)
    return {n: p.detach().clone() for n, p in model.named_parameters() if is_lora_param(n)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-train")
    cfg = load_config(overrides=TINY + ["train.seq_len=16"])
    model = build_model(cfg.model, device="cpu")
    init_weights(model, cfg.model, seed=7)
    to_hf(model, cfg.model, root / "base")
    assert _train(_config(root / "whole", root / "base", 4)) == 0
    assert _train(_config(root / "split", root / "base", 2)) == 0
    assert _train(_config(root / "split", root / "base", 4)) == 2  # resumed
    return root


def test_checkpoints_hold_adapters_only_and_resume_exactly(runs):
    step_dir = runs / "whole" / "checkpoints" / "step-00000004"
    keys = [k.removeprefix("model.") for k in FileSystemReader(str(step_dir)).read_metadata()
            .state_dict_metadata if k.startswith("model.")]
    assert keys and all(is_lora_param(k) for k in keys), keys
    assert len(keys) == 2 * 7 * 2  # A and B of 7 linears in each of 2 blocks
    whole, split = _adapters(runs / "whole"), _adapters(runs / "split")
    assert any(float(v.abs().max()) > 0 for n, v in whole.items() if "lora_B" in n)
    for name, value in whole.items():
        torch.testing.assert_close(split[name], value, rtol=0, atol=1e-6)
    # The base the checkpoint is completed with is init_from's, untouched.
    base = load_model_from_checkpoint(runs / "base")
    merged_view = load_model_from_checkpoint(runs / "whole")
    for name, p in base.named_parameters():
        torch.testing.assert_close(merged_view.get_parameter(name), p, rtol=0, atol=0)


def test_convert_peft_and_merged_match_giantmodel(runs, capsys):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    run = runs / "whole"
    assert main(["convert", str(run), str(runs / "peft"), "--to", "peft"]) == 0
    assert (runs / "peft" / "adapter_config.json").is_file()
    assert (runs / "peft" / "adapter_model.safetensors").is_file()
    assert main(["convert", str(run), str(runs / "merged"), "--to", "hf", "--merge-lora"]) == 0
    capsys.readouterr()
    # Without --merge-lora a LoRA run is refused with one line naming the fix.
    assert main(["convert", str(run), str(runs / "plain"), "--to", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "--merge-lora" in err and "\n" not in err

    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = load_model_from_checkpoint(run)(tokens)
        merged = transformers.AutoModelForCausalLM.from_pretrained(runs / "merged").eval()
        with_adapter = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(runs / "base"),
            runs / "peft").eval()
        a, b = merged(tokens).logits, with_adapter(tokens).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(runs / "base")(tokens).logits
    assert (ours - plain).abs().max().item() > 1e-3  # the adapters change the output
    assert (ours - a).abs().max().item() < TOL
    assert (ours - b).abs().max().item() < TOL


def test_run_path_preflight_leaves_builtin_weights_to_the_objective(tmp_path):
    from giantmodel.checkpoint.run_dir import check_run_paths
    from giantmodel.config.errors import ConfigError

    cfg = load_config(overrides=TINY + ["train.seq_len=16", f"run.dir={tmp_path / 'run'}",
                                        "checkpoint.init_from=builtin:tiny-chat"])
    check_run_paths(cfg)  # built on first use by the objective, not a path
    cfg.checkpoint.init_from = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="does not exist"):
        check_run_paths(cfg)
