"""Bad steps on two data-parallel ranks (failure modes 5, 6 and 7).

One spawned process group runs four short trainings with the real Trainer.
A wrapper around the engine's forward/backward injects the fault after the
real backward, on rank 1 only, the way a flipped bit or an overflow on one
GPU would appear:

- 5: a NaN in one gradient on rank 1: both ranks skip that update, the
  parameters stay identical across ranks; with the fault on every step the
  run stops after ``train.max_skipped_steps`` with a message naming the step
  and the first non-finite tensor (and its rank).
- 6: with ``train.spike_factor`` a step whose loss jumps is skipped and logged.
- 7: fp16: an Inf in one gradient on rank 1: the scaler backs off on both
  ranks, no update is applied, parameters stay identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from giantmodel.testing import run_ranks

TINY = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.ffn_hidden_size=128", "model.vocab_size=256",
        "model.max_seq_len=64", "train.seq_len=32", "train.global_batch_size=8",
        "train.micro_batch_size=4", "data.source=synthetic", "train.log_every=1",
        "train.sample_tokens=0", "train.eval_every=0", "optim.warmup_steps=2",
        "run.tensorboard=false", "run.progress=false", "parallel.dp=2",
        "parallel.timeout_s=60", "checkpoint.every=1000", "checkpoint.save_final=false",
        "train.threads=1"]

# scenario -> (extra config, steps where rank 1's gradient is poisoned, poison value)
SCENARIOS = {
    "nan": (["train.steps=5"], {3}, float("nan")),
    "stop": (["train.steps=8", "train.max_skipped_steps=3"], set(range(2, 9)), float("nan")),
    "fp16": (["train.steps=5", "precision=fp16"], {3}, float("inf")),
    "spike": (["train.steps=9", "train.spike_factor=3"], set(), 0.0),
}
SPIKE_STEP = 8


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float().clone() for p in params])


def _run(rank: int, base: str, name: str) -> dict:
    from giantmodel.config import load_config
    from giantmodel.config.errors import RunStopped
    from giantmodel.train.trainer import Trainer

    extra, poison_steps, value = SCENARIOS[name]
    run = Path(base) / name
    t = Trainer(load_config(None, [*TINY, *extra, f"run.dir={run}"]))
    real = t.engine.forward_backward
    before: dict[int, torch.Tensor] = {}
    first = next(n for part in t.engine.parts for n, _ in part.named_parameters())

    def faulty(mbs, precision):
        step = t.state.step + 1
        before[step] = _flat(t.engine.parameters())
        loss = real(mbs, precision)
        if rank == 1 and step in poison_steps:
            p = next(p for part in t.engine.parts for p in part.parameters())
            p.grad.view(-1)[0] = value
        if name == "spike" and step == SPIKE_STEP:
            loss = loss * 10  # the global loss, the same on both ranks
        return loss

    t.engine.forward_backward = faulty
    try:
        t.train()
        outcome = "finished"
    except RunStopped as e:
        outcome = str(e)
    finally:  # keep the spawned process group for the next scenario
        t.ckpt.close()
        t.metrics.close()
        t.run_lock.release()
        t.hang.close()
    recs = []
    if rank == 0:
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {"outcome": outcome, "final": _flat(t.engine.parameters()), "before": before,
            "scale": t.precision.scale, "records": [r for r in recs if "loss" in r],
            "first": first}


def _worker(rank: int, world: int, base: str) -> dict:
    return {name: _run(rank, base, name) for name in SCENARIOS}


@pytest.mark.timeout(240)
def test_non_finite_overflow_and_spike_steps_are_skipped_on_every_rank(tmp_path, capfd):
    r0, r1 = run_ranks(_worker, 2, str(tmp_path), timeout=200, backend="gloo")

    # 5: NaN on rank 1 at step 3: both skip it, the others apply
    for name, bad in (("nan", 3), ("fp16", 3)):
        a, b = r0[name], r1[name]
        assert a["outcome"] == b["outcome"] == "finished"
        assert torch.equal(a["final"], b["final"]), f"{name}: ranks diverged"
        skipped = [r["step"] for r in a["records"] if r.get("skipped")]
        assert skipped == [bad], (name, skipped)
        assert torch.equal(a["before"][bad], a["before"][bad + 1]), f"{name}: step {bad} updated"
        assert not torch.equal(a["before"][bad - 1], a["before"][bad]), f"{name}: no update"
    # 7: the scaler backed off once on both ranks (2^16 -> 2^15)
    assert r0["fp16"]["scale"] == r1["fp16"]["scale"] == 2.0**15

    # 5: persistent NaN from step 2 stops at step 4 (3 in a row), on both ranks
    msg = r0["stop"]["outcome"]
    assert msg == r1["stop"]["outcome"], (msg, r1["stop"]["outcome"])
    assert msg.startswith("step 4: 3 steps in a row skipped"), msg
    assert "train.max_skipped_steps=3" in msg
    assert f"the grad of {r0['stop']['first']} on rank 1" in msg, msg
    assert torch.equal(r0["stop"]["final"], r1["stop"]["final"])
    # a stop every rank decided alike is no hang: no rank wrote a hang report
    assert not sorted((tmp_path / "stop").glob("hang-*.txt"))

    # 6: the loss spike at step 8 is skipped and logged
    s = r0["spike"]
    assert [r["step"] for r in s["records"] if r.get("skipped")] == [SPIKE_STEP]
    assert torch.equal(s["before"][SPIKE_STEP], s["before"][SPIKE_STEP + 1])
    assert torch.equal(s["final"], r1["spike"]["final"])
    out = capfd.readouterr().out
    assert f"step {SPIKE_STEP}: skipped the update (loss spike:" in out, out[-3000:]
    assert "step 3: skipped the update (non-finite values: first in the grad of" in out
