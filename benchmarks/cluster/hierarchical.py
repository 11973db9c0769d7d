"""The giant backend's hierarchical all-reduce against flat gloo, across two
emulated hosts (2 ranks each, 200 Mbit/s and 1 ms between hosts, shared
memory inside a host), 1 MB to 256 MB: busbw and the ratio, in one run.

    PYTHONPATH=. python benchmarks/cluster/hierarchical.py \\
        --json benchmarks/results/cluster_hierarchical.json

``--op reduce_scatter`` or ``all_gather`` times those instead (the size is
the whole tensor: the reduce-scatter's input, the all-gather's output).

The giant group learns its nodes from the hosts' names (each emulated host
has its own UTS namespace): intra-node reduce-scatter over shared memory,
one inter-node all-reduce per local rank (two flows at once over the host
link), intra-node all-gather. gloo runs one flat ring over the 4 ranks.
Each cell: one warm-up call, then the median of ``--reps`` calls (the
slowest rank's time per call), giant and gloo alternating per size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIZES = ("1M", "4M", "16M", "64M", "256M")


def _collective(op: str, nbytes: int, world: int, rank: int):
    """A call of ``op`` on ``nbytes`` (the whole tensor: the input of
    reduce-scatter, the output of all-gather) and its bus-bandwidth factor."""
    import torch
    import torch.distributed as dist

    whole = torch.ones(nbytes // 4 // world * world)
    part = torch.ones(whole.numel() // world)
    if op == "reduce_scatter":
        return (lambda g: dist.reduce_scatter_tensor(part, whole, group=g)), (world - 1) / world
    if op == "all_gather":
        return (lambda g: dist.all_gather_into_tensor(whole, part, group=g)), (world - 1) / world
    return (lambda g: dist.all_reduce(whole, group=g)), 2 * (world - 1) / world


def worker(out: str, sizes: list[int], reps: int, op: str = "all_reduce") -> None:
    import torch
    import torch.distributed as dist
    from common import write_rank_result

    from giantmodel import comm

    comm.register_backend()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    giant = dist.new_group(backend="giant", pg_options=comm.GiantOptions())
    rows = []
    for nbytes in sizes:
        call, factor = _collective(op, nbytes, world, rank)
        for name, group in (("giant", giant), ("gloo", None)):
            call(group)  # warm-up
            times = []
            for _ in range(reps if nbytes < (128 << 20) else max(2, reps // 2)):
                dist.barrier()
                t0 = time.perf_counter()
                call(group)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times.append(float(t))
            sec = statistics.median(times)
            rows.append({"backend": name, "bytes": nbytes, "time_s": sec,
                         "busbw_GBps": nbytes / sec / 1e9 * factor})
    write_rank_result(out, rank, {"rows": rows, "hierarchical": _is_hierarchical(giant)})
    dist.destroy_process_group()


def _is_hierarchical(group) -> bool:
    """Whether the giant group found two nodes and runs hierarchically."""
    return bool(group.topology.hierarchical and group.topology.num_nodes == 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rate-mbit", type=float, default=200)
    p.add_argument("--delay-ms", type=float, default=1.0)
    p.add_argument("--op", default="all_reduce",
                   choices=("all_reduce", "reduce_scatter", "all_gather"))
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    from giantmodel.comm.bench import parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(args.worker, sizes, args.reps, args.op)
        return 0
    from common import conditions, run_workers

    from giantmodel.testing.cluster import EmulatedCluster, Link

    with EmulatedCluster(2, link=Link(args.rate_mbit, args.delay_ms)) as c:
        t0 = time.time()
        res = run_workers(c, [[0, 1], [2, 3]], __file__,
                          ["--sizes", args.sizes, "--reps", str(args.reps), "--op", args.op],
                          timeout=1800)
        cond = conditions(c)
    rows = res[0]["rows"]
    by = {(r["backend"], r["bytes"]): r for r in rows}
    print(f"{'size':>6} {'gloo GB/s':>10} {'giant GB/s':>11} {'ratio':>6}")
    table = []
    for n in sizes:
        g, f = by[("giant", n)], by[("gloo", n)]
        ratio = g["busbw_GBps"] / f["busbw_GBps"]
        table.append({"bytes": n, "gloo_busbw_GBps": f["busbw_GBps"],
                      "giant_busbw_GBps": g["busbw_GBps"], "ratio": ratio})
        print(f"{n >> 20:>5}M {f['busbw_GBps']:>10.4f} {g['busbw_GBps']:>11.4f} {ratio:>6.2f}")
    print(f"{args.op}; giant hierarchical: {res[0]['hierarchical']}; wall {time.time() - t0:.0f}s; "
          f"load {cond['loadavg']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"conditions": cond, "op": args.op, "rows": table,
                                               "hierarchical": res[0]["hierarchical"]},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
