"""Does DDP's gradient sync overlap backward on the giant backend?

Per step, on every rank (max over ranks; medians over interleaved repetitions):
  compute = forward + backward under no_sync (no communication)
  comm    = all-reducing the same gradients alone, in DDP-sized buckets
  step    = a DDP forward + backward (sync included)
  hidden  = (compute + comm - step) / comm: the share of communication hidden
            behind backward; 0 = fully serial, 1 = fully overlapped.
Backends: gloo, giant (FIFO engine), giant with the priority hook.

  PYTHONPATH=. python benchmarks/comm_overlap.py [--ranks 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _one(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _setup(group, hook, spec) -> dict:
    """Three closures for one backend: compute only, comm only, DDP step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(spec["width"], spec["depth"]), process_group=group,
                bucket_cap_mb=spec["bucket_mb"])
    if hook is not None:
        model.register_comm_hook(state=group, hook=hook)
    x = torch.randn(spec["batch"], spec["width"])

    def compute():
        with model.no_sync():
            model(x).square().mean().backward()

    def step():
        model(x).square().mean().backward()

    cap = int(spec["bucket_mb"] * (1 << 20)) // 4
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    buckets = list(flat.split(cap))

    def comm():
        works = [dist.all_reduce(b, group=group, async_op=True) for b in buckets]
        for w in works:
            w.wait()

    return {"compute": compute, "comm": comm, "step": step,
            "grad_MB": flat.numel() * 4 / 2**20}


def _worker(rank: int, world: int, spec: dict) -> dict:
    from giantmodel import comm
    from giantmodel.comm.hooks import priority_allreduce_hook

    comm.register_backend()
    torch.set_num_threads(spec["threads"])
    cases = {"gloo": _setup(dist.new_group(backend="gloo"), None, spec),
             "giant": _setup(dist.new_group(backend="giant"), None, spec)}
    cases["giant+priority"] = _setup(dist.new_group(backend="giant",
                                                    pg_options=comm.GiantOptions(priority=True)),
                                     priority_allreduce_hook, spec)
    times = {name: {k: [] for k in ("compute", "comm", "step")} for name in cases}
    # Interleaved so that load from other processes hits every cell alike.
    for rep in range(spec["reps"] + 1):
        for name, fns in cases.items():
            for k in ("compute", "comm", "step"):
                t = _one(fns[k])
                if rep:  # the first round warms up
                    times[name][k].append(t)
    out = {}
    for name, ts in times.items():
        c, m, s = (statistics.median(ts[k]) for k in ("compute", "comm", "step"))
        out[name] = {"compute_ms": c * 1e3, "comm_ms": m * 1e3, "step_ms": s * 1e3,
                     "hidden": (c + m - s) / m if m > 0 else 0.0,
                     "grad_MB": cases[name]["grad_MB"]}
    return out


def main() -> int:
    from giantmodel.testing import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    spec = {"width": a.width, "depth": a.depth, "batch": a.batch, "bucket_mb": a.bucket_mb,
            "threads": a.threads, "reps": a.reps}
    res = run_ranks(_worker, a.ranks, spec, timeout=900)[0]
    if a.json:
        print(json.dumps({"ranks": a.ranks, "spec": spec, "results": res}, indent=1))
        return 0
    print(f"ranks={a.ranks} model={a.depth}x Linear({a.width}) batch={a.batch} "
          f"bucket={a.bucket_mb} MB grads={res['gloo']['grad_MB']:.0f} MB")
    print(f"{'backend':<16}{'compute ms':>11}{'comm ms':>9}{'step ms':>9}{'hidden':>8}")
    for name, r in res.items():
        print(f"{name:<16}{r['compute_ms']:>11.1f}{r['comm_ms']:>9.1f}{r['step_ms']:>9.1f}"
              f"{r['hidden']:>8.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
