"""The trainer end to end on the CPU: metrics, schedules, precision, resume."""

import json
import math

import pytest
import torch

from giantmodel.config import load_config
from giantmodel.config.train import OptimConfig
from giantmodel.core.optim import lr_at
from giantmodel.core.precision import Precision
from giantmodel.train.trainer import Trainer, run_training

SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=128", "model.vocab_size=256", "model.max_seq_len=64",
         "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=4",
         "data.source=synthetic", "train.log_every=1", "train.sample_tokens=0",
         "optim.warmup_steps=2", "run.tensorboard=false"]


def cfg_for(tmp_path, *extra):
    return load_config(None, [*SMALL, f"run.dir={tmp_path}", *extra])


def records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.timeout(120)
def test_run_writes_metrics_config_and_checkpoints(tmp_path):
    cfg = cfg_for(tmp_path, "train.steps=6", "train.eval_every=3", "checkpoint.every=2",
                  "checkpoint.keep=2")
    summary = run_training(cfg)
    recs = records(tmp_path)
    train = [r for r in recs if "loss" in r]
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu"):
            assert key in r and math.isfinite(r[key])
        assert r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1
    assert [r["step"] for r in val] == [3, 6]
    assert summary["val_loss"] == val[-1]["val_loss"]
    assert (tmp_path / "config.yaml").is_file()
    assert load_config(tmp_path / "config.yaml") == cfg
    steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-00000004", "step-00000006"]  # keep=2


@pytest.mark.timeout(180)
def test_resumed_run_reproduces_uninterrupted_losses_exactly(tmp_path):
    """fp32 on the CPU: 3 steps, stop, resume to 6 == 6 steps straight, bit for bit."""
    extra = ["train.steps=6", "train.eval_every=0", "checkpoint.every=3", "model.dropout=0.1",
             "model.arch=gpt", "model.num_kv_heads=null"]
    straight = tmp_path / "straight"
    run_training(cfg_for(straight, *extra))
    # Interrupted: 3 steps, a checkpoint, then the process "dies"; running the
    # same command again resumes from run.dir.
    interrupted = tmp_path / "interrupted"
    t = Trainer(cfg_for(interrupted, *extra))
    for _ in range(3):
        t.train_step()
    t._save()
    t.close()
    run_training(cfg_for(interrupted, *extra))
    a = [r["loss"] for r in records(straight) if "loss" in r]
    b = [(r["step"], r["loss"]) for r in records(interrupted) if "loss" in r]
    assert len(a) == 6
    assert b == [(4, a[3]), (5, a[4]), (6, a[5])], (a, b)


@pytest.mark.timeout(120)
def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path):
    a = Trainer(cfg_for(tmp_path / "a", "train.steps=3", "train.micro_batch_size=2"))
    b = Trainer(cfg_for(tmp_path / "b", "train.steps=3", "train.micro_batch_size=8"))
    assert a.microbatches == 4 and b.microbatches == 1
    la = [a.train_step()["loss"] for _ in range(3)]
    lb = [b.train_step()["loss"] for _ in range(3)]
    a.close(), b.close()
    assert la == pytest.approx(lb, rel=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, precision):
    t = Trainer(cfg_for(tmp_path, "train.steps=8", f"precision={precision}", "optim.lr=1e-2"))
    losses = [t.train_step()["loss"] for _ in range(8)]
    t.close()
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


def test_fp16_loss_scaler_skips_overflow_and_backs_off():
    p = torch.nn.Parameter(torch.ones(3))
    prec = Precision("fp16", "cpu", init_scale=1024.0, growth_interval=2)
    p.grad = torch.tensor([1024.0, float("inf"), 0.0])
    assert prec.unscale_and_check([p]) is True and prec.scale == 512.0
    for expected in (512.0, 1024.0):
        p.grad = torch.tensor([512.0, 512.0, 512.0])
        assert prec.unscale_and_check([p]) is False
        assert torch.equal(p.grad, torch.ones(3) * 512.0 / (prec.scale if expected == 512.0 else 512.0))
        assert prec.scale == expected


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_lr_schedules(schedule):
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule=schedule, decay_fraction=0.2)
    lrs = [lr_at(s, cfg, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b + 1e-12 for a, b in zip(lrs[:10], lrs[1:10]))
    if schedule == "constant":
        assert lrs[-1] == 1.0
    else:
        assert all(b <= a + 1e-12 for a, b in zip(lrs[10:], lrs[11:]))
        assert lrs[-1] == pytest.approx(0.1, abs=0.02)
    if schedule == "wsd":
        assert lrs[79] == 1.0 and lrs[85] < 1.0


def test_weight_decay_skips_norms_and_biases(tmp_path):
    t = Trainer(cfg_for(tmp_path, "train.steps=1", "model.arch=gpt", "model.num_kv_heads=null"))
    groups = t.optimizer.param_groups
    t.close()
    assert groups[0]["weight_decay"] > 0 and all(p.dim() >= 2 for p in groups[0]["params"])
    assert groups[1]["weight_decay"] == 0 and all(p.dim() == 1 for p in groups[1]["params"])


@pytest.mark.timeout(300)
def test_compiled_blocks_train_like_eager_and_keep_parameter_names(tmp_path):
    losses, names = {}, {}
    for flag in ("false", "true"):
        t = Trainer(cfg_for(tmp_path / flag, "train.steps=2", f"train.compile={flag}"))
        losses[flag] = [t.train_step()["loss"] for _ in range(2)]
        names[flag] = [n for n, _ in t.engine.parts[0].named_parameters()]
        compiled = t.engine.parts[0].layers["0"]._compiled_call_impl is not None
        t.close()
        assert compiled == (flag == "true")
    assert names["true"] == names["false"]  # checkpoints stay interchangeable
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5)
