"""The giant backend's hierarchical collectives against flat gloo, across two
emulated hosts (2 ranks each, 200 Mbit/s and 1 ms between hosts, shared
memory inside a host), 1 MB to 256 MB: busbw and the ratio, in one run.

    PYTHONPATH=. python benchmarks/cluster/hierarchical.py \\
        --json benchmarks/results/cluster_hierarchical.json

``--op reduce_scatter`` or ``all_gather`` times those instead (the size is
the whole tensor: the reduce-scatter's input, the all-gather's output).
``--op all_to_all`` times the all-to-all, the size being what each rank
sends in all, with ``--splits even,random`` (equal blocks, or the uneven
blocks of an MoE dispatch: ``giantmodel.comm.bench.random_splits``).
``--ranks-per-host 2,1`` runs each layout in turn on the same cluster.

The giant group learns its nodes from the hosts' names (each emulated host
has its own UTS namespace): intra-node reduce-scatter over shared memory,
one inter-node all-reduce per local rank (two flows at once over the host
link), intra-node all-gather. gloo runs one flat ring over the 4 ranks.
Each cell: one warm-up call, then the median of ``--reps`` calls (the
slowest rank's time per call). ``--turns T`` measures every cell T times,
giant and gloo taking turns to go first, and reports the median and range
of the T paired ratios (gloo's time over giant's, a few seconds apart).
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


def _collective(op: str, nbytes: int, world: int, rank: int, splits: str = "even"):
    """A call of ``op`` on ``nbytes`` (the whole tensor: the input of
    reduce-scatter, the output of all-gather; what each rank sends, for
    all-to-all) and its bus-bandwidth factor."""
    import torch
    import torch.distributed as dist

    from giantmodel.comm.bench import random_splits

    whole = torch.ones(nbytes // 4 // world * world)
    part = torch.ones(whole.numel() // world)
    if op == "reduce_scatter":
        return (lambda g: dist.reduce_scatter_tensor(part, whole, group=g)), (world - 1) / world
    if op == "all_gather":
        return (lambda g: dist.all_gather_into_tensor(whole, part, group=g)), (world - 1) / world
    if op == "all_to_all":
        if splits == "random":
            m = random_splits(whole.numel(), world)  # seeded: the same matrix on every rank
            recv, send = [m[s][rank] for s in range(world)], m[rank]
        else:
            recv = send = [whole.numel() // world] * world
        got = torch.empty(sum(recv))
        return ((lambda g: dist.all_to_all_single(got, whole, recv, send, group=g)),
                (world - 1) / world)
    return (lambda g: dist.all_reduce(whole, group=g)), 2 * (world - 1) / world


def _cell(call, group, reps: int) -> float:
    """Seconds per call: the median of ``reps`` calls after one warm-up,
    each the slowest rank's time."""
    import torch
    import torch.distributed as dist

    call(group)  # warm-up
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        call(group)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


def worker(out: str, sizes: list[int], reps: int, op: str = "all_reduce",
           splits: tuple[str, ...] = ("even",), turns: int = 1) -> None:
    import torch.distributed as dist
    from common import write_rank_result

    from giantmodel import comm

    comm.register_backend()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # "on": the all-to-all runs hierarchically only when asked for (under
    # "auto" it is flat gloo, which would time gloo against itself)
    giant = dist.new_group(backend="giant", pg_options=comm.GiantOptions(hierarchical="on"))
    rows = []
    for nbytes in sizes:
        for split in splits if op == "all_to_all" else ("even",):
            call, factor = _collective(op, nbytes, world, rank, split)
            n = reps if nbytes < (128 << 20) else max(2, reps // 2)
            turn_s: dict[str, list[float]] = {"giant": [], "gloo": []}
            for turn in range(turns):
                # alternate who goes first, so neither always meets the other's leftovers
                order = (("giant", giant), ("gloo", None))
                for name, group in order if turn % 2 == 0 else order[::-1]:
                    turn_s[name].append(_cell(call, group, n))
            for name, ts in turn_s.items():
                sec = statistics.median(ts)
                rows.append({"backend": name, "bytes": nbytes, "splits": split, "time_s": sec,
                             "turn_s": ts, "busbw_GBps": nbytes / sec / 1e9 * factor})
    write_rank_result(out, rank, {"rows": rows, "hierarchical": _is_hierarchical(giant)})
    dist.destroy_process_group()


def _is_hierarchical(group) -> bool:
    """Whether the giant group found two nodes and runs hierarchically."""
    return bool(group.topology.hierarchical and group.topology.num_nodes == 2)


def _table(rows: list[dict], sizes: list[int], per_host: int) -> list[dict]:
    """giant against gloo per cell: busbw of the median turn, and the paired
    per-turn ratios (gloo's time over giant's)."""
    by = {(r["backend"], r["bytes"], r["splits"]): r for r in rows}
    table = []
    for n in sizes:
        for split in dict.fromkeys(r["splits"] for r in rows):
            g, f = by[("giant", n, split)], by[("gloo", n, split)]
            turns = sorted(a / b for a, b in zip(f["turn_s"], g["turn_s"]))
            table.append({"ranks_per_host": per_host, "bytes": n, "splits": split,
                          "gloo_ms": f["time_s"] * 1e3, "giant_ms": g["time_s"] * 1e3,
                          "gloo_busbw_GBps": f["busbw_GBps"],
                          "giant_busbw_GBps": g["busbw_GBps"],
                          "ratio": g["busbw_GBps"] / f["busbw_GBps"],
                          "ratio_turns": turns, "ratio_median": statistics.median(turns)})
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--turns", type=int, default=1,
                   help="measure each cell this many times, backends alternating first")
    p.add_argument("--rate-mbit", type=float, default=200, help="0: an unshaped veth link")
    p.add_argument("--delay-ms", type=float, default=1.0)
    p.add_argument("--op", default="all_reduce",
                   choices=("all_reduce", "reduce_scatter", "all_gather", "all_to_all"))
    p.add_argument("--splits", default="even", help="all_to_all: comma list of even, random")
    p.add_argument("--ranks-per-host", default="2", help="comma list: one run per layout")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    from giantmodel.comm.bench import _fmt_bytes, parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    splits = tuple(x.strip() for x in args.splits.split(",") if x.strip())
    if not splits or any(x not in ("even", "random") for x in splits):
        raise SystemExit("--splits: use even and/or random")
    if args.worker:
        worker(args.worker, sizes, args.reps, args.op, splits, args.turns)
        return 0
    from common import conditions, run_workers

    from giantmodel.testing.cluster import EmulatedCluster, Link

    table, hier = [], []
    with EmulatedCluster(2, link=Link(args.rate_mbit or None, args.delay_ms)) as c:
        t0 = time.time()
        for k in (int(x) for x in args.ranks_per_host.split(",")):
            res = run_workers(c, [list(range(k)), list(range(k, 2 * k))], __file__,
                              ["--sizes", args.sizes, "--reps", str(args.reps), "--op", args.op,
                               "--splits", args.splits, "--turns", str(args.turns)],
                              timeout=1800)
            table += _table(res[0]["rows"], sizes, k)
            hier.append(res[0]["hierarchical"])
        cond = conditions(c)
    print(f"{'hosts x ranks':>13} {'splits':>7} {'size':>6} {'gloo ms':>9} {'giant ms':>9} "
          f"{'gloo GB/s':>10} {'giant GB/s':>11} {'ratio':>6} {'turns min-med-max':>17}")
    for t in table:
        turns = t["ratio_turns"]
        spread = f"{turns[0]:.2f}-{t['ratio_median']:.2f}-{turns[-1]:.2f}"
        print(f"{'2 x ' + str(t['ranks_per_host']):>13} {t['splits']:>7} "
              f"{_fmt_bytes(t['bytes']):>6} {t['gloo_ms']:>9.2f} {t['giant_ms']:>9.2f} "
              f"{t['gloo_busbw_GBps']:>10.4f} {t['giant_busbw_GBps']:>11.4f} {t['ratio']:>6.2f} "
              f"{spread:>17}")
    print(f"{args.op}; giant hierarchical: {hier}; wall {time.time() - t0:.0f}s; "
          f"load {cond['loadavg']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"conditions": cond, "op": args.op, "rows": table,
                                               "hierarchical": all(hier),
                                               "argv": sys.argv[1:]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
