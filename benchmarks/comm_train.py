"""Trainer step time with comm.backend=giant next to gloo, same run.

Tiny LLaMA (configs/llama/tiny.yaml) at dp=N on local CPU ranks; loss curves
must match (printed) and the median step time of steps after the first is
compared.

  PYTHONPATH=. python benchmarks/comm_train.py [--ranks 4] [--steps 8] [--zero 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path


def _worker(rank: int, world: int, run_dir: str, backend: str, steps: int, zero: int):
    from giantmodel.config import load_config
    from giantmodel.train.trainer import run_training

    cfg = load_config("configs/llama/tiny.yaml", [
        f"run.dir={run_dir}", f"comm.backend={backend}", f"parallel.dp={world}",
        f"parallel.zero={zero}", f"train.steps={steps}", "train.log_every=1",
        "train.eval_every=0", "train.sample_tokens=0", "run.tensorboard=false",
        "checkpoint.every=100000", "comm.autotune=false", "data.source=synthetic",
        "parallel.timeout_s=300", "train.micro_batch_size=4"])
    run_training(cfg)
    if rank:
        return None
    recs = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r]


def main() -> int:
    from giantmodel.testing import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in ("gloo", "giant"):
            recs = run_ranks(_worker, a.ranks, f"{tmp}/{backend}", backend, a.steps, a.zero,
                             timeout=1200, backend=None)[0]
            times = [r["step_time_s"] for r in recs[1:]]
            out[backend] = {"losses": [r["loss"] for r in recs],
                            "median_step_s": statistics.median(times),
                            "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in recs[1:])}
    out["speedup"] = out["gloo"]["median_step_s"] / out["giant"]["median_step_s"]
    out["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(out["gloo"]["losses"],
                                                              out["giant"]["losses"]))
    out["loadavg_1m"] = os.getloadavg()[0]
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"tiny LLaMA, dp={a.ranks}, zero={a.zero}, {a.steps} steps")
    for b in ("gloo", "giant"):
        print(f"{b:<6} median step {out[b]['median_step_s'] * 1e3:8.1f} ms  "
              f"{out[b]['tokens_per_sec']:9.0f} tok/s  losses "
              + " ".join(f"{x:.6f}" for x in out[b]["losses"]))
    print(f"giant speedup {out['speedup']:.2f}x, max |loss diff| {out['max_abs_loss_diff']:.2e}, "
          f"load avg {out['loadavg_1m']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
