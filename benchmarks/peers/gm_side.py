"""giantmodel's side of a peer case: the real Trainer, on spawned gloo ranks.

    python benchmarks/peers/gm_side.py --case dp2-zero1 --steps 20 --out gm.json \
        [--set comm.backend=giant ...] [--profile]

Writes one JSON object: tokens/s (slowest rank), per-rank peak RSS, the loss
after every step, and optionally a one-step profile of rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload


class _TimedLoader:
    """The trainer's loader, with its reads marked as the data phase."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        from stepprofile import phase

        with phase("data"):
            return next(self.inner)


def _mark_phases(trainer) -> None:
    """Wrap the engine's step pieces in profiler phases (instance attributes
    only: the trainer's own train_step runs unchanged)."""
    from stepprofile import phase

    def wrap(obj, name, label):
        fn = getattr(obj, name)

        def marked(*a, **k):
            with phase(label):
                return fn(*a, **k)
        setattr(obj, name, marked)

    wrap(trainer.engine, "forward_backward", "compute")
    for name in ("clip_grad_norm_", "optimizer_step", "zero_grad"):
        wrap(trainer.engine, name, "optimizer")
    trainer.train_loader = _TimedLoader(trainer.train_loader)


def rank_main(rank: int, world: int, case_name: str, steps: int, warmup: int,
              extra: tuple[str, ...], want_profile: bool) -> dict:
    import torch

    from giantmodel.config import load_config
    from giantmodel.train.trainer import Trainer

    case = workload.find_case(case_name)
    run_dir = tempfile.mkdtemp(prefix="gm-peer-")
    cfg = load_config(None, workload.gm_overrides(case, steps + 1, run_dir, extra))
    trainer = Trainer(cfg)
    try:
        losses, times = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = trainer.train_step()
            if case.gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(out["loss"])
        rss = workload.peak_memory_bytes(trainer.device)
        prof = None
        if want_profile:
            from stepprofile import profile_step

            _mark_phases(trainer)
            prof = profile_step(trainer.train_step)
        return {"losses": losses, "step_times": times[warmup:], "peak_rss": rss,
                "profile": prof if rank == 0 else None,
                # what the run used: comm.backend=auto resolves per device and
                # world size, and the giant backend tunes its bucket size
                "backend": trainer.backend, "bucket_mb": trainer.bucket_mb}
    finally:
        trainer.close()


def summarize(case: workload.Case, per_rank: list[dict]) -> dict:
    # The slowest rank sets the pace of a synchronous step.
    step = max(sum(r["step_times"]) / len(r["step_times"]) for r in per_rank)
    return {"system": "giantmodel", "case": case.name,
            "tokens_per_sec": case.global_batch * workload.seq_len(case) / step,
            "step_s": step, "loss": per_rank[0]["losses"][-1],
            "losses": per_rank[0]["losses"],
            "peak_rss_mib": [round(r["peak_rss"] / 2**20, 1) for r in per_rank],
            "profile": per_rank[0]["profile"], "settings": {
                "comm.backend": per_rank[0]["backend"],
                "parallel.bucket_mb": per_rank[0]["bucket_mb"]}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", help="the case (not with --serve)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--serve", action="store_true",
                   help="be one rank (RANK/WORLD_SIZE/MASTER_ADDR from the environment, as "
                        "srun or the emulated cluster start it) serving the suite's commands "
                        "on stdin (benchmarks/peers/launch.py)")
    p.add_argument("--out", help="the JSON to write (not with --serve)")
    a = p.parse_args()
    if a.serve:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        import giantmodel.train.trainer  # noqa: F401 - imported once, before the cases fork

        def one(name, dest, steps, profile):
            r = rank_main(rank, world, name, steps, a.warmup, tuple(a.extra), profile)
            Path(f"{dest}.rank{rank}").write_text(json.dumps(r))
        return workload.serve(one)
    if not (a.case and a.out):
        p.error("--case and --out are needed without --serve")
    case = workload.find_case(a.case)
    from giantmodel.testing import run_ranks

    t0 = time.perf_counter()
    per_rank = run_ranks(rank_main, case.ranks, a.case, a.steps, a.warmup, tuple(a.extra),
                         a.profile, backend=None, timeout=a.timeout)
    result = {"overrides": a.extra, "wall_s": time.perf_counter() - t0,
              "load_avg": workload.load_avg(), **summarize(case, per_rank)}
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
