"""Bandwidth-aware placement on emulated clusters, against every other order.

    PYTHONPATH=. python benchmarks/cluster/placement.py \\
        --layout tp2dp2 --rounds 6 --json benchmarks/results/cluster_placement_tp2dp2.json
    PYTHONPATH=. python benchmarks/cluster/placement.py \\
        --layout pp2dp2 --rounds 6 --json benchmarks/results/cluster_placement_pp2dp2.json

Two emulated hosts x 2 ranks, 200 Mbit/s and 1 ms between the hosts, shared
memory (loopback TCP for gloo) inside a host. Ranks arrive as Slurm's cyclic
distribution deals them: ranks 0 and 2 on host0, 1 and 3 on host1. In ONE
process group:

1. a trainer with ``parallel.placement: auto`` and ``comm.topology: measure``
   probes the links and resolves the placement (what a real run does);
2. a trainer is built for every candidate order (every permutation that keeps
   pipeline groups in increasing rank order: 24 for tp2dp2, 6 for pp2dp2);
3. after a warm-up round, ``--rounds`` rounds visit every candidate in a
   shuffled order and time ``--steps`` optimizer steps (the slowest rank's
   wall time); a candidate's figure is the median over rounds. The meshes
   share one process group per rank set (see ``_share_groups_by_rank_set``).

``--cluster hetero4`` / ``hetero4-scrambled``: 4 single-rank hosts where two
pairs of hosts share 1 Gbit/s links and every other pair crosses 100 Mbit/s
(shaped veths); ``--candidates classes`` times one order per distinct
predicted cost.

It reports, from the same run: auto / identity step time, auto against the
best measured order and (all rounds of a class pooled) auto's class of
equivalent orders against the best class (:func:`mesh_groups`), and the
Spearman rank correlation between the predicted communication time and the
measured step time over every candidate. ``--summarize JSON`` recomputes the
summary of a JSON it wrote.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Two tiny LLaMAs: one whose tensor-parallel activations dominate its traffic,
# one whose data-parallel gradients do (a large vocabulary), so that the
# launcher's cyclic order is the wrong one for each.
LAYOUTS = {
    "tp2dp2": ["parallel.tp=2", "model.hidden_size=128", "model.num_layers=2",
               "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_hidden_size=384",
               "model.vocab_size=512", "train.seq_len=256", "train.micro_batch_size=4",
               "train.global_batch_size=16"],
    "pp2dp2": ["parallel.pp=2", "model.hidden_size=256", "model.num_layers=2",
               "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_hidden_size=512",
               "model.vocab_size=8192", "train.seq_len=64", "train.micro_batch_size=2",
               "train.global_batch_size=8"],
}
COMMON = ["data.source=synthetic", "train.device=cpu", "train.eval_every=0",
          "train.sample_tokens=0", "train.log_every=1000000", "checkpoint.every=0",
          "checkpoint.save_final=false", "checkpoint.resume=false", "run.tensorboard=false",
          "run.progress=false", "train.steps=1000000", "parallel.timeout_s=300"]


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rho with average ranks for ties."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / den if den else float("nan")


# name: (hosts' ranks, NIC link, dedicated pair links)
CLUSTERS = {
    # Slurm's cyclic distribution on 2 hosts: ranks 0 and 2 on host0
    "cyclic2x2": ([[0, 2], [1, 3]], (200, 1.0), {}),
    # 4 single-rank hosts; hosts 0-1 and 2-3 share 1 Gbit/s links, the rest 100 Mbit/s
    "hetero4": ([[0], [1], [2], [3]], (100, 0.0), {(0, 1): (1000, 0.0), (2, 3): (1000, 0.0)}),
    # the same links, ranks launched in another order: the fast pairs are {0,2}, {1,3}
    "hetero4-scrambled": ([[0], [2], [1], [3]], (100, 0.0),
                          {(0, 1): (1000, 0.0), (2, 3): (1000, 0.0)}),
}


def _pick(perms, predicted, auto, how: str):
    """Indices of the candidates to time: all, or one per distinct predicted
    cost plus the identity and auto's own."""
    if how == "all":
        return list(range(len(perms)))
    keep, seen = [], set()
    for i, (p, c) in enumerate(zip(perms, predicted)):
        key = round(float(c), 9)
        if key not in seen or list(p) in (sorted(p), auto):
            seen.add(key)
            keep.append(i)
    return keep


def worker(out: str, layout: str, steps: int, rounds: int, how: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from common import write_rank_result

    from giantmodel.config import load_config
    from giantmodel.core.traffic import mesh_traffic
    from giantmodel.distributed.placement import CostModel
    from giantmodel.train.trainer import Trainer

    _share_groups_by_rank_set()
    scratch = Path(tempfile.mkdtemp(prefix="gm-place-"))
    base = [*COMMON, *LAYOUTS[layout]]
    import os
    os.environ["GIANTMODEL_CACHE"] = str(scratch / "cache")  # measure afresh
    t0 = time.perf_counter()
    auto = Trainer(load_config(None, [*base, "parallel.placement=auto",
                                      f"run.dir={scratch}/auto"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    result = auto.placement
    cfg0 = load_config(None, [*base, f"run.dir={scratch}/x"])
    from giantmodel.distributed.parallel_dims import ParallelDims
    dims = ParallelDims.from_config(cfg0, world)
    micro = dims.pipeline.n_micro if dims.pipeline is not None else None
    traffic = mesh_traffic(cfg0.model, cfg0.train, cfg0.parallel, dims.degree_map,
                           microbatches=micro)
    from giantmodel.distributed.linkprobe import measure_or_load
    topo = measure_or_load("measure", "gloo")  # the cached probe the auto trainer made
    model = CostModel(dims.degree_map, traffic, topo)
    perms = np.asarray(list(itertools.permutations(range(world))))
    perms = perms[model.valid(perms)]
    predicted = model.cost(perms)
    keep = _pick(perms, predicted, result.placement if result else None, how)
    perms, predicted = perms[keep], predicted[keep]
    trainers = []
    for i, p in enumerate(perms):
        cfg = load_config(None, [*base, f"run.dir={scratch}/c{i}"])
        cfg.parallel.placement = [int(x) for x in p]
        trainers.append(Trainer(cfg))
    setup_s = time.perf_counter() - t0
    times: list[list[float]] = [[] for _ in trainers]
    for r in range(rounds + 1):  # round 0 warms up every candidate
        for i in random.Random(r).sample(range(len(trainers)), len(trainers)):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(steps):
                trainers[i].train_step()
            dt = torch.tensor([(time.perf_counter() - t) / steps], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if r > 0:
                times[i].append(float(dt))
    write_rank_result(out, rank, {
        "auto": result.placement if result else None,
        "auto_log": result.log_line() if result else None,
        "predicted_auto_s": result.cost_s if result else None,
        "setup_s": setup_s,
        "candidates": [{"placement": [int(x) for x in p], "predicted_comm_s": float(c),
                        "step_s": statistics.median(t), "steps_s": t}
                       for p, c, t in zip(perms, predicted, times)],
        "host_of": [int(h) for h in topo.host_of],
        "inter_host_mbit": float(topo.beta[0, 1] * 8 / 1e6),
        "inter_host_latency_ms": float(topo.alpha[0, 1] * 1e3)})
    dist.destroy_process_group()


def _share_groups_by_rank_set() -> None:
    """One process group per rank set for every mesh this process builds.

    The candidates' meshes ask for groups over the same few rank sets (a
    4-rank world has 6 pairs). gloo gives every group threads that wake every
    10 ms: 100 idle groups cost about 11% of a core per rank here, so 25
    meshes x 8 groups would take the 2 cores the steps run on. Groups hold no
    state between collectives, and one trainer runs at a time, so sharing
    them changes nothing else."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    made: dict = {}
    original = dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        key = None if ranks is None else tuple(sorted(ranks))
        if key not in made:
            made[key] = original(ranks, *args, **kwargs)
        return made[key]

    dist.new_group = new_group
    device_mesh.new_group = new_group


def mesh_groups(placement: list[int], layout: str) -> tuple:
    """The rank groups of every mesh dimension: orders with the same groups are
    one placement up to relabelling (which member is tp rank 0, which dp rank
    reads which shard), so they move the same bytes over the same links."""
    deg = {k.split(".")[1]: int(v) for k, v in (o.split("=") for o in LAYOUTS[layout])
           if k in ("parallel.tp", "parallel.pp")}
    tp, pp = deg.get("tp", 1), deg.get("pp", 1)
    mesh = [[placement[(s * len(placement) // pp) + d * tp + t] for d in
             range(len(placement) // (pp * tp)) for t in range(tp)] for s in range(pp)]
    flat = [r for stage in mesh for r in stage]
    shape = [x for x in (pp, len(placement) // (pp * tp), tp) if x > 1]
    assert len(shape) == 2, shape  # the 2-D layouts this benchmark runs
    rows = [flat[i * shape[1]:(i + 1) * shape[1]] for i in range(shape[0])]
    cols = [list(c) for c in zip(*rows)]
    return tuple(frozenset(frozenset(g) for g in gs) for gs in (rows, cols))


def summarize(res: dict, layout: str) -> dict:
    """Per order: its median round. Per class of orders with the same groups
    (:func:`mesh_groups`): the median of all their rounds pooled, which the
    best single order of a class (a minimum over noisy equals) undercuts."""
    cands = res["candidates"]
    by = {tuple(c["placement"]): c for c in cands}
    identity = by[tuple(range(len(cands[0]["placement"])))]
    auto = by[tuple(res["auto"])]
    best = min(cands, key=lambda c: c["step_s"])
    classes: dict[tuple, list[dict]] = {}
    for c in cands:
        classes.setdefault(mesh_groups(c["placement"], layout), []).append(c)
    pooled = {k: statistics.median([t for c in v for t in c["steps_s"]])
              for k, v in classes.items()}
    auto_cls = pooled[mesh_groups(res["auto"], layout)]
    return {"auto": res["auto"], "auto_step_s": auto["step_s"],
            "identity_step_s": identity["step_s"], "best": best["placement"],
            "best_step_s": best["step_s"],
            "identity_over_auto": identity["step_s"] / auto["step_s"],
            "auto_over_best": auto["step_s"] / best["step_s"],
            "classes": len(classes),
            "auto_class_orders": len(classes[mesh_groups(res["auto"], layout)]),
            "auto_class_step_s": auto_cls, "best_class_step_s": min(pooled.values()),
            "auto_class_over_best_class": auto_cls / min(pooled.values()),
            "spearman_predicted_vs_measured": spearman(
                [c["predicted_comm_s"] for c in cands], [c["step_s"] for c in cands]),
            "candidates": len(cands)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="tp2dp2")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per timing")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds over all candidates")
    p.add_argument("--cluster", choices=sorted(CLUSTERS), default="cyclic2x2")
    p.add_argument("--candidates", choices=("all", "classes"), default="all",
                   help="time every order, or one per distinct predicted cost")
    p.add_argument("--json", default=None)
    p.add_argument("--summarize", default=None, metavar="JSON",
                   help="recompute the summary of a JSON this script wrote, in place")
    args = p.parse_args()
    if args.summarize:
        doc = json.loads(Path(args.summarize).read_text())
        doc["summary"] = summarize(doc["result"], doc["layout"])
        Path(args.summarize).write_text(json.dumps(doc, indent=1))
        print(json.dumps(doc["summary"], indent=1))
        return 0
    if args.worker:
        worker(args.worker, args.layout, args.steps, args.rounds, args.candidates)
        return 0
    from common import conditions, run_workers

    from giantmodel.testing.cluster import EmulatedCluster, Link

    t0 = time.time()
    host_ranks, nic, pairs = CLUSTERS[args.cluster]
    with EmulatedCluster(len(host_ranks), link=Link(*nic),
                         pair_links={k: Link(*v) for k, v in pairs.items()}) as c:
        res = run_workers(c, host_ranks, __file__,
                          ["--layout", args.layout, "--steps", str(args.steps),
                           "--rounds", str(args.rounds), "--candidates", args.candidates],
                          timeout=3000)[0]
        cond = conditions(c)
    summary = summarize(res, args.layout)
    print(res["auto_log"])
    print(f"{'placement':<14} {'predicted comm ms':>18} {'step ms':>9}")
    for cnd in sorted(res["candidates"], key=lambda x: x["step_s"]):
        mark = " <- auto" if cnd["placement"] == res["auto"] else (
            " <- identity" if cnd["placement"] == sorted(cnd["placement"]) else "")
        print(f"{cnd['placement']!s:<14} {cnd['predicted_comm_s'] * 1e3:>18.1f} "
              f"{cnd['step_s'] * 1e3:>9.1f}{mark}")
    print(json.dumps({k: v for k, v in summary.items()}, indent=1))
    print(f"wall {time.time() - t0:.0f}s, setup {res['setup_s']:.0f}s, load {cond['loadavg']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"conditions": cond, "layout": args.layout,
                                               "cluster": args.cluster, "host_ranks": host_ranks,
                                               "config": LAYOUTS[args.layout] + COMMON,
                                               "summary": summary, "result": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
