"""Expert-parallel checkpoints reshard across ep degrees.

A tiny MoE run trains 2 steps at ep2 (2 ranks) and saves; its checkpoint
then resumes at ep1 (one process) and, copied, at ep4 (4 ranks), 2 more
steps each. Both must give the losses of one uninterrupted single-process
run: the experts are ``Shard(0)`` DTensors over ep, so DCP hands each
layout its experts with their AdamW moments, and the routing bias and the
LR schedule carry over.
"""

from __future__ import annotations

import shutil

import pytest

from giantmodel.testing import run_ranks

STEPS = 2
COMMON = ["model.arch=llama", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4",
          "model.num_kv_heads=2", "model.ffn_hidden_size=64", "model.vocab_size=128",
          "model.max_seq_len=32", "model.moe.num_experts=8", "model.moe.top_k=2",
          "model.moe.router=sigmoid", "model.moe.expert_ffn_hidden_size=16",
          "model.moe.num_shared_experts=1", "model.moe.bias_update_rate=0.01",
          "model.moe.aux_loss_coeff=0.01", "model.moe.seq_aux_loss_coeff=0.01",
          "train.seq_len=16", "train.global_batch_size=8", "train.micro_batch_size=2",
          f"train.steps={2 * STEPS}", "train.eval_every=0", "train.log_every=1",
          "train.sample_tokens=0", "data.source=synthetic", "optim.warmup_steps=1",
          "optim.lr=0.01", "optim.grad_clip=1.0", "precision=fp32", "checkpoint.every=0",
          "checkpoint.keep=0", "run.tensorboard=false", "run.progress=false"]


def run_phase(rank: int, world: int, run_dir: str, overrides: list[str],
              steps: int = STEPS) -> dict:
    """Resume (or start) the run, train ``steps`` steps, save."""
    from giantmodel.config import load_config
    from giantmodel.train.trainer import Trainer

    trainer = Trainer(load_config(None, [*COMMON, f"run.dir={run_dir}", *overrides]))
    start = trainer.state.step
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    trainer._save()
    trainer.ckpt.close()
    trainer.metrics.close()
    trainer.run_lock.release()
    return {"start": start, "losses": losses}


@pytest.mark.timeout(240)
def test_ep2_checkpoint_resumes_at_ep1_and_ep4(tmp_path):
    first = run_ranks(run_phase, 2, str(tmp_path / "a"), ["parallel.ep=2"], timeout=200)[0]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    at_ep4 = run_ranks(run_phase, 4, str(tmp_path / "b"), ["parallel.ep=4"], timeout=200)[0]
    at_ep1 = run_phase(0, 1, str(tmp_path / "a"), [])
    ref = run_phase(0, 1, str(tmp_path / "straight"), [], steps=2 * STEPS)["losses"]
    assert first["start"] == 0 and at_ep1["start"] == STEPS and at_ep4["start"] == STEPS
    assert abs(ref[-1] - ref[0]) > 1e-3  # training moved the loss
    for label, got in (("ep1", first["losses"] + at_ep1["losses"]),
                       ("ep4", first["losses"] + at_ep4["losses"])):
        for step, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{label} step {step}: {a} vs uninterrupted {b}"
