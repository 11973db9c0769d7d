"""Case 3: giantmodel's giant backend all-reduce against DeepSpeed's
shared-memory all-reduce (``deepspeed.comm.inference_all_reduce``), in one
run: both live in the same ranks (DeepSpeed's environment, giantmodel on
PYTHONPATH), and every size alternates between them, window by window.
giantmodel is timed twice: through ``dist.all_reduce`` on a giant group,
and through ``giantmodel.comm.all_reduce_inline``, which calls the core
directly as DeepSpeed's call does its op.

    <deepspeed venv>/bin/python benchmarks/peers/collectives.py --ranks 2 --out coll.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload

SIZES = ["4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M", "256M"]


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _slowest(seconds: float, group) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _window(fn, t, budget: float, group) -> float:
    """Mean seconds per call over one window of about ``budget`` seconds (at
    least 3 calls); the slowest rank's figure. Every rank runs the same
    number of calls: the count comes from the slowest rank's probe."""
    import torch.distributed as dist

    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn(t)
    probe = _slowest(time.perf_counter() - t0, group)
    n = max(3, min(10_000, int(budget / max(probe, 1e-7))))
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(t)
    return _slowest((time.perf_counter() - t0) / n, group)


def rank_main(rank: int, world: int, sizes: list[str], windows: int, budget: float) -> list[dict]:
    import deepspeed.comm as dc
    import torch
    import torch.distributed as dist

    from giantmodel.comm import register_backend

    torch.set_num_threads(1)
    workload.init_deepspeed("gloo")
    cdb = dc.comm.cdb
    ds_path = ("shm" if getattr(cdb, "shm_comm_op", None) is not None
               and hasattr(torch.ops, "deepspeed")
               and hasattr(torch.ops.deepspeed, "inference_all_reduce_") else "gloo-fallback")
    from giantmodel.comm import all_reduce_inline

    register_backend()
    giant = dist.new_group(backend="giant")
    ctrl = dist.new_group(backend="gloo")  # timing barriers and maxima

    def run_giant(t):
        dist.all_reduce(t, group=giant)

    def run_inline(t):
        all_reduce_inline(t, giant)

    def run_ds(t):
        dc.inference_all_reduce(t, op=dc.ReduceOp.SUM)

    systems = (("giant", run_giant), ("giant_inline", run_inline), ("deepspeed", run_ds))

    rows = []
    for size in sizes:
        numel = parse_size(size) // 4
        # Check both sums before timing: rank r contributes r + 1 everywhere.
        for name, fn in systems:
            t = torch.full((numel,), float(rank + 1))
            fn(t)
            want = world * (world + 1) / 2
            if not torch.all(t == want):
                raise RuntimeError(f"{name} all-reduce of {size} is wrong: {t[:4]} != {want}")
        t = torch.ones(numel)
        best = {name: float("inf") for name, _ in systems}
        for _ in range(windows):
            for name, fn in systems:
                best[name] = min(best[name], _window(fn, t, budget, ctrl))
        nbytes = numel * 4
        bus = 2 * (world - 1) / world
        row = {"size": size, "bytes": nbytes, "deepspeed_path": ds_path}
        for name, _ in systems:
            row[f"{name}_us"] = best[name] * 1e6
            row[f"{name}_busbw_gbps"] = nbytes / best[name] * bus / 1e9
        row["ratio"] = best["deepspeed"] / best["giant"]
        row["ratio_inline"] = best["deepspeed"] / best["giant_inline"]
        rows.append(row)
    return rows


def _figure(row: dict, name: str) -> str:
    if row["bytes"] < 2**20:
        return f"{row[f'{name}_us']:.1f} µs"
    return f"{row[f'{name}_busbw_gbps']:.2f} GB/s"


def format_table(rows: list[dict], world: int) -> str:
    """Two giant figures: through ``dist.all_reduce``, and the direct path
    (``giantmodel.comm.all_reduce_inline``), the like of DeepSpeed's call."""
    lines = ["| ranks | size | giant, dist.all_reduce | giant, all_reduce_inline | DeepSpeed shm"
             " | dist / DS | inline / DS |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        inline = r.get("ratio_inline")  # absent in results written before the direct path
        lines.append(f"| {world} | {r['size']} | {_figure(r, 'giant')} | "
                     f"{_figure(r, 'giant_inline') if inline else '-'} | "
                     f"{_figure(r, 'deepspeed')} | **{r['ratio']:.2f}x** | "
                     f"{f'**{inline:.2f}x**' if inline else '-'} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--budget", type=float, default=0.1, help="seconds per timing window")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    from giantmodel.testing import run_ranks

    env = {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": str(a.ranks)}
    t0 = time.perf_counter()
    rows = run_ranks(rank_main, a.ranks, a.sizes.split(","), a.windows, a.budget,
                     backend=None, env=env, timeout=900)[0]
    out = {"case": "collectives", "ranks": a.ranks, "rows": rows,
           "wall_s": time.perf_counter() - t0, "load_avg": workload.load_avg()}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(format_table(rows, a.ranks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
