"""MFU is the job's model FLOP/s over the job's peak, on every layout: with
CPU ranks sharing a host (pinned to their share of its cores or not), the
peak is the host's, not one rank's share counted per rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from giantmodel.testing import run_ranks, scratch_dir

COMMON = ["model.arch=llama", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
          "model.num_kv_heads=2", "model.ffn_hidden_size=128", "model.vocab_size=256",
          "model.max_seq_len=32", "train.seq_len=16", "train.global_batch_size=8",
          "train.micro_batch_size=2", "train.steps=3", "train.eval_every=0", "train.log_every=1",
          "train.sample_tokens=0", "data.source=synthetic", "precision=fp32",
          "checkpoint.every=0", "run.tensorboard=false", "run.progress=false"]


def _train(rank: int, world: int, run_dir: str, overrides: list[str]) -> dict:
    """Train a few steps under ``overrides`` (the trainer makes its own
    process group and pins the ranks as it would in a real run)."""
    from giantmodel.config import load_config
    from giantmodel.metrics.flops import cpu_peak_flops, job_peak_flops
    from giantmodel.train.trainer import Trainer

    trainer = Trainer(load_config(None, [*COMMON, f"run.dir={run_dir}", *overrides]))
    pinned = sorted(os.sched_getaffinity(0))
    job_peak = job_peak_flops(trainer.device, "fp32")
    trainer.train()
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"pinned": pinned, "job_peak": job_peak, "host_peak": cpu_peak_flops(
        frozenset(range(os.cpu_count() or 1))), "mfu": [r["mfu"] for r in rows if "mfu" in r]}


@pytest.mark.parametrize("world,layouts", [
    (2, [["parallel.dp=2", "parallel.zero=1"], ["parallel.tp=2"], ["parallel.pp=2"]]),
    (4, [["parallel.dp=2", "parallel.tp=2"], ["parallel.dp=4", "parallel.zero=3"]]),
])
def test_mfu_is_the_jobs_flops_over_the_hosts_peak(world, layouts):
    for overrides in layouts:
        out = run_ranks(_train, world, scratch_dir(), overrides, backend=None, timeout=150)
        for r in out:
            # one host: the job's peak is the host's, whether or not each rank
            # was pinned to its own share of the cores
            assert r["job_peak"] == pytest.approx(r["host_peak"]), (overrides, r)
        mfu = out[0]["mfu"]
        assert mfu and all(0 < m <= 1 for m in mfu), (overrides, mfu)
