"""Where a data-parallel step's time goes, against its ranks' compute alone.

Runs the planner host check's model (benchmarks/planner_cpu_check.py) in
two ways, alternating, on 2 ranks: (1) dp2 with the given ZeRO stage on the
backend training picks, each step split into forward/backward of the
micro-batches, the wait in the strategy's ``finish``, and clip + optimizer
step + zero_grad; (2) two independent one-rank processes side by side,
each with the same per-rank work and no process group. If (1) is no slower
than (2), the distributed step adds nothing to its ranks' compute, and a
planner miss lies in the compute model.

    PYTHONPATH=. python benchmarks/planner_step_parts.py [--zero 0] [--pairs 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from giantmodel.testing import run_ranks  # noqa: E402


def rank_main(rank: int, world: int, zero: int, steps: int, solo: bool) -> list[float]:
    """Median ms per step of: forward/backward, finish wait, optimizer, whole step."""
    import torch
    import torch.distributed as dist
    from planner_cpu_check import MODEL, TRAIN

    from giantmodel.comm import backend_for
    from giantmodel.config import load_config
    from giantmodel.core.precision import Precision
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.objectives import LanguageModel
    from giantmodel.parallel.engine import TrainEngine
    from giantmodel.planner import hostcheck

    torch.set_num_threads(1)   # the engine sets the heap as training does (core.hostmem)
    if solo:  # one rank's share of the dp2 batch, alone
        train = [t for t in TRAIN if "global_batch" not in t] + ["train.global_batch_size=4"]
        cfg, world = load_config(overrides=MODEL + train), 1
    else:
        cfg = load_config(overrides=MODEL + TRAIN + ["parallel.dp=2", f"parallel.zero={zero}"])
        name, opts = backend_for(cfg.comm, "cpu", world)
        dist.init_process_group(name, rank=rank, world_size=world, pg_options=opts)
    dims = ParallelDims.from_config(cfg, world)
    if world > 1:
        dims.build_mesh("cpu")
    engine = TrainEngine(LanguageModel(cfg.model, data=cfg.data, train=cfg.train), dims,
                         torch.device("cpu"), parallel=cfg.parallel, recompute=cfg.recompute,
                         recompute_layers=cfg.recompute_layers, offload=cfg.offload,
                         compile=False, precision=cfg.precision, bucket_mb=cfg.parallel.bucket_mb)
    precision, opt = Precision(cfg.precision, "cpu"), engine.build_optimizer(cfg.optim)
    strategy, finish = engine.runner.strategy, engine.runner.strategy.finish
    waits: list[float] = []

    def timed_finish():
        t0 = time.perf_counter()
        finish()
        waits.append(time.perf_counter() - t0)

    strategy.finish = timed_finish
    rows = []
    for step in range(steps + 2):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        engine.forward_backward(hostcheck._batches(cfg, step, engine.data_rank, engine.data_world),
                                precision)
        t1 = time.perf_counter()
        engine.clip_grad_norm_(cfg.optim.grad_clip)
        engine.optimizer_step(opt)
        engine.zero_grad(opt)
        t2 = time.perf_counter()
        rows.append((t1 - t0 - waits[-1], waits[-1], t2 - t1, t2 - t0))
    if world > 1:
        dist.destroy_process_group()
    return [round(statistics.median(col) * 1e3, 1) for col in zip(*rows[2:])]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2))
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    print("ms per step, per rank: forward/backward, finish wait, clip+optimizer+zero_grad, step")
    for _ in range(a.pairs):
        dp = run_ranks(rank_main, 2, a.zero, a.steps, False, backend=None, timeout=900)
        solo = run_ranks(rank_main, 2, a.zero, a.steps, True, backend=None, timeout=900)
        print(f"dp2 zero {a.zero}: {dp}")
        print(f"two one-rank processes: {solo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
