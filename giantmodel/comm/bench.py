"""``giantmodel bench comm``: collective bandwidth, giant next to gloo.

Spawns its own local ranks and prints sizes x ops x backends with the time,
algbw and busbw of each cell, using nccl-tests' definitions (S = the full
buffer: the all-reduce buffer, the gathered/scattered whole):

  all_reduce      busbw = algbw * 2(n-1)/n
  reduce_scatter  busbw = algbw * (n-1)/n
  all_gather      busbw = algbw * (n-1)/n
  all_to_all      busbw = algbw * (n-1)/n
  broadcast       busbw = algbw

``ratio`` is giant's busbw over gloo's in the same run. Each cell is the
best of five timing windows (see :func:`_cell`); ``--repeat R`` measures
every cell R times, giant and gloo taking turns to go first, reports each
backend's best and the spread of the R per-turn ratios (on a host shared
with other work one pair of cells can land on a quiet and a busy second).
``--splits even,random`` times all-to-all with equal blocks and with the
uneven blocks of an MoE dispatch (seeded, the same every run: each rank
still sends S bytes in all, to each peer between 0.25 and 1.75 times an
equal share, so ranks receive different amounts). ``--node-size K``
makes giant treat every K ranks as one node (hierarchical collectives; only
TCP between the emulated nodes) while gloo stays flat. ``--stream`` adds the
host's STREAM copy/triad bandwidth, from which the memory-bound column is
derived (see :func:`memory_bound_busbw`).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from giantmodel import comm
from giantmodel.comm import _lib
from giantmodel.core import compat
from giantmodel.testing import run_ranks

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0}
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    mult = _UNITS.get(text[-1:], 1)
    num = text[:-1] if text[-1:] in _UNITS else text
    try:
        return int(float(num) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 4K, 1M, 64M") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", default="2", help="comma list of local rank counts (2,4)")
    parser.add_argument("--sizes", default="4K,1M,64M", help="comma list of buffer sizes")
    parser.add_argument("--ops", "--op", default="all_reduce,reduce_scatter,all_gather",
                        help=f"comma list from {','.join(OPS)}")
    parser.add_argument("--splits", default="even",
                        help="all_to_all blocks, comma list: even (equal), random (uneven, "
                             "as an MoE dispatch)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure each cell this many times, backends alternating first")
    parser.add_argument("--backends", default="giant,gloo", help="comma list: giant,gloo")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--node-size", type=int, default=0,
                        help="emulate nodes of this many ranks for giant (hierarchical)")
    parser.add_argument("--seconds", type=float, default=0.5,
                        help="approximate timing budget per cell")
    parser.add_argument("--stream", action="store_true",
                        help="also measure memory bandwidth and the memory-bound busbw")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--timeout", type=float, default=600)


def _run_op(op: str, buf, out, group, rank: int, splits=()):
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(buf, group=group)
    elif op == "reduce_scatter":
        compat.reduce_scatter_single(out, buf, group=group)
    elif op == "all_gather":
        compat.all_gather_single(out, buf, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(out, buf, *splits, group=group)
    elif op == "broadcast":
        dist.broadcast(buf, src=0, group=group)


def random_splits(n: int, world: int, seed: int = 0) -> list[list[int]]:
    """m[s][d]: elements rank s sends rank d; each row sums to n, each entry
    0.25-1.75 times n / world. Seeded, so every rank draws the same matrix."""
    import torch

    g = torch.Generator().manual_seed(seed)
    weights = 0.25 + 1.5 * torch.rand(world, world, generator=g, dtype=torch.float64)
    m = (weights / weights.sum(1, keepdim=True) * n).floor().long()
    m[:, -1] += n - m.sum(1)  # rounding: each row still sends n
    return m.tolist()


def _buffers(op: str, nbytes: int, world: int, dtype, rank: int = 0, splits: str = "even"):
    """(buf, out, split sizes) for one op, S = nbytes being the full buffer."""
    import torch

    esize = torch.tensor([], dtype=dtype).element_size()
    n = max(world, nbytes // esize // world * world)
    full = torch.ones(n, dtype=dtype)
    if op == "all_to_all" and splits == "random":
        m = random_splits(n, world)
        recv = [m[s][rank] for s in range(world)]
        return full, torch.empty(sum(recv), dtype=dtype), (recv, m[rank])
    if op == "reduce_scatter":
        return full, torch.empty(n // world, dtype=dtype), ()
    if op == "all_gather":
        return full, torch.ones(n // world, dtype=dtype), ()  # out (full) <- buf (a part)
    if op == "all_to_all":
        return full, torch.empty_like(full), ()
    return full, None, ()


def _cell(op, nbytes, world, group, rank, dtype, budget, windows: int = 5,
          splits: str = "even") -> float:
    """Seconds per call: the best of ``windows`` timing windows, each the
    average over its iterations and the max over ranks. On a shared host the
    best window is the least disturbed by other processes; every backend is
    measured the same way."""
    import torch
    import torch.distributed as dist

    buf, out, sizes = _buffers(op, nbytes, world, dtype, rank, splits)
    if op == "all_gather":
        buf, out = out, buf
    _run_op(op, buf, out, group, rank, sizes)
    dist.barrier()
    t0 = time.perf_counter()
    _run_op(op, buf, out, group, rank, sizes)
    one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(one, op=dist.ReduceOp.MAX)
    iters = int(max(2, min(2000, budget / windows / max(float(one.item()), 1e-6))))
    best = float("inf")
    for _ in range(windows):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            _run_op(op, buf, out, group, rank, sizes)
        per = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(per, op=dist.ReduceOp.MAX)
        best = min(best, float(per.item()))
    return best


def _bench_ranks(rank: int, world: int, spec: dict) -> list[dict]:
    import torch
    import torch.distributed as dist


    comm.register_backend()
    dtype = getattr(torch, spec["dtype"])
    groups = {}
    for name in spec["backends"]:
        # emulated nodes are asked for to time the hierarchical forms, the
        # all-to-all's too (which "auto" keeps flat)
        options = comm.GiantOptions(node_size=spec["node_size"],
                                    hierarchical="on" if spec["node_size"] else "auto")
        groups[name] = (dist.new_group(backend=name, pg_options=options) if name == "giant"
                        else None)
    rows = []
    names = list(groups)
    for nbytes in spec["sizes"]:
        for op in spec["ops"]:
            for splits in (spec["splits"] if op == "all_to_all" else ["even"]):
                times: dict[str, list[float]] = {name: [] for name in names}
                for turn in range(spec["repeat"]):
                    # alternate who goes first, so neither always meets the
                    # other's leftovers (caches, a neighbour's burst)
                    for name in (names if turn % 2 == 0 else names[::-1]):
                        times[name].append(_cell(op, nbytes, world, groups[name], rank, dtype,
                                                 spec["seconds"], splits=splits))
                for name in names:
                    t = min(times[name])
                    algbw = nbytes / t / 1e9
                    rows.append({"ranks": world, "op": op, "bytes": nbytes, "backend": name,
                                 "splits": splits, "dtype": spec["dtype"],
                                 "node_size": spec["node_size"], "time_us": t * 1e6,
                                 "times_us": [x * 1e6 for x in times[name]], "algbw_GBps": algbw,
                                 "busbw_GBps": algbw * BUS_FACTOR[op](world)})
    return rows


def memory_bound_busbw(op: str, world: int, mem_gbps: float) -> float:
    """busbw if the op moved only the bytes it cannot avoid, at mem_gbps.

    Each rank must at least read its input and write its output in its own
    memory, all ranks sharing one memory bus. For all-reduce of S bytes that
    is 2*S per rank, so t >= 2*S*n / B and busbw <= 2(n-1)/n * S / t
    = (n-1)/n^2 * B. For reduce-scatter (read S, write S/n) t >= S*(n+1)/B;
    for all-gather (read S/n, write S) the same.
    """
    n = world
    if op == "all_reduce":
        return (n - 1) / n ** 2 * mem_gbps
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n * mem_gbps / (n + 1)
    if op == "all_to_all":
        return (n - 1) / n * mem_gbps / (2 * n)
    return mem_gbps / n


def stream_bandwidth() -> dict:

    lib = _lib.load()
    if lib is None:
        return {}
    out = {}
    for threads in (1, 2):
        out[f"copy_{threads}t"] = lib.gm_stream(256 << 20, threads, 0, 5)
        out[f"triad_{threads}t"] = lib.gm_stream(256 << 20, threads, 1, 5)
    return out


def _add_ratios(rows: list[dict], mem: dict) -> None:
    def key(r):
        return r["ranks"], r["op"], r["bytes"], r.get("splits", "even")

    base = {key(r): r for r in rows if r["backend"] == "gloo"}
    bound_bw = max(mem.values()) if mem else 0.0
    for r in rows:
        ref = base.get(key(r))
        r["ratio_vs_gloo"] = r["busbw_GBps"] / ref["busbw_GBps"] if ref else None
        if ref and len(r.get("times_us", ())) > 1:
            # turn by turn: the same seconds of the host for both backends
            turns = sorted(g / t for g, t in zip(ref["times_us"], r["times_us"]))
            r["ratio_turns"] = turns
            r["ratio_median"] = turns[len(turns) // 2]
        if bound_bw:
            bound = memory_bound_busbw(r["op"], r["ranks"], bound_bw)
            r["mem_bound_busbw_GBps"] = bound
            r["fraction_of_bound"] = r["busbw_GBps"] / bound


def _fmt_bytes(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def format_table(rows: list[dict], mem: dict) -> str:
    lines = []
    if mem:
        lines.append("memory bandwidth (GB/s): " +
                     ", ".join(f"{k} {v:.1f}" for k, v in mem.items()))
    head = (f"{'ranks':>5} {'op':<15}{'splits':<7}{'size':>6} {'backend':<8}{'time_us':>11}"
            f"{'algbw':>9}{'busbw':>9}{'x gloo':>8}{'turns: min-median-max':>23}{'of bound':>9}")
    lines += [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['ratio_vs_gloo']:.2f}" if r.get("ratio_vs_gloo") else "-"
        turns = r.get("ratio_turns")
        spread = (f"{turns[0]:.2f}-{r['ratio_median']:.2f}-{turns[-1]:.2f}"
                  if turns and r["backend"] != "gloo" else "-")
        frac = f"{r['fraction_of_bound']:.0%}" if "fraction_of_bound" in r else "-"
        lines.append(f"{r['ranks']:>5} {r['op']:<15}{r.get('splits', 'even'):<7}"
                     f"{_fmt_bytes(r['bytes']):>6} "
                     f"{r['backend']:<8}{r['time_us']:>11.1f}{r['algbw_GBps']:>9.3f}"
                     f"{r['busbw_GBps']:>9.3f}{ratio:>8}{spread:>23}{frac:>9}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise SystemExit(f"--ops: unknown {bad}; choose from {','.join(OPS)}")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if any(b not in ("giant", "gloo") for b in backends):
        raise SystemExit("--backends: use giant and/or gloo")
    splits = [x.strip() for x in args.splits.split(",") if x.strip()]
    if not splits or any(x not in ("even", "random") for x in splits):
        raise SystemExit("--splits: use even and/or random")
    if args.repeat < 1:
        raise SystemExit("--repeat: must be >= 1")
    worlds = [int(r) for r in args.ranks.split(",")]
    uneven = [w for w in worlds if args.node_size and w % args.node_size]
    if uneven:  # hierarchical collectives need equal nodes (Topology refuses others)
        raise SystemExit(f"--node-size {args.node_size} does not divide --ranks {uneven}; "
                         "emulated nodes must be equal")
    spec = {"sizes": [parse_size(s) for s in args.sizes.split(",")], "ops": ops,
            "backends": backends, "dtype": args.dtype, "node_size": args.node_size,
            "seconds": args.seconds, "splits": splits, "repeat": args.repeat}
    mem = stream_bandwidth() if args.stream else {}
    load_before = os.getloadavg()[0]
    rows: list[dict] = []
    for world in worlds:
        rows += run_ranks(_bench_ranks, world, spec, timeout=args.timeout,
                          pg_timeout=args.timeout)[0]
    _add_ratios(rows, mem)
    # Other work on the host skews every figure; the load average says how much.
    load = {"before": load_before, "after": os.getloadavg()[0]}
    if args.json:
        print(json.dumps({"memory_GBps": mem, "host_cpus": os.cpu_count(), "loadavg_1m": load,
                          "rows": rows}, indent=1))
    else:
        print(format_table(rows, mem))
        print(f"host: {os.cpu_count()} cpus, 1-min load average {load['before']:.1f} before, "
              f"{load['after']:.1f} after")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    raise SystemExit(main(p.parse_args()))
