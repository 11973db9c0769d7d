"""CPU training with and without keeping freed heap memory (giantmodel.core.hostmem).

Runs the peer suite's giantmodel case (benchmarks/peers/workload.py: the
same model, batch and defaults) on 2 ranks, alternating runs with the
setting (the default) and with ``GIANTMODEL_KEEP_HOST_MEMORY=0``, and
prints per run: ms per step, page faults and system ms per step on each
rank, and each rank's peak RSS (MiB):

    PYTHONPATH=. python benchmarks/host_memory.py [--case dp2-zero1] [--pairs 3] [--steps 15]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import workload  # noqa: E402

from giantmodel.core.hostmem import OPT_OUT  # noqa: E402
from giantmodel.testing import run_ranks  # noqa: E402

WARMUP = 3


def rank_main(rank: int, world: int, case_name: str, steps: int) -> list[float]:
    from giantmodel.config import load_config
    from giantmodel.train.trainer import Trainer

    case = workload.find_case(case_name)
    cfg = load_config(None, workload.gm_overrides(case, steps + WARMUP + 2, tempfile.mkdtemp(), ()))
    trainer = Trainer(cfg)
    for _ in range(WARMUP):
        trainer.train_step()
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    seconds, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    trainer.close()
    return [seconds / steps * 1e3, (after.ru_minflt - before.ru_minflt) / steps,
            (after.ru_stime - before.ru_stime) / steps * 1e3, after.ru_maxrss / 1024]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="dp2-zero1")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args(argv)
    world = workload.find_case(args.case).ranks
    print(f"{args.case}: ms/step, faults/step, sys ms/step, peak RSS MiB per rank; "
          f"load average {os.getloadavg()[0]:.2f}")
    for pair in range(args.pairs):
        for keep in ("1", "0"):
            os.environ[OPT_OUT] = keep   # the ranks inherit it
            res = run_ranks(rank_main, world, args.case, args.steps, backend=None, timeout=900)
            cols = " | ".join(f"{r[0]:.1f} ms, {r[1]:,.0f} faults, {r[2]:.1f} sys ms, "
                              f"{r[3]:.0f} MiB" for r in res)
            print(f"pair {pair + 1} {'kept    ' if keep == '1' else 'defaults'} {cols}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
