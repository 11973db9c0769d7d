"""Measure latency (α) and bandwidth (β) between ranks over the real backend.

Point-to-point probes between two ranks, the others idle: the round trip of
an 8-byte message (median of repeats) gives α = rtt / 2; a large message
answered by an 8-byte acknowledgement gives β = size / (time - rtt). The large
size is chosen per pair from a 1 MiB trial so each transfer takes about
``target_s`` (bounded to 256 KiB .. 64 MiB): small enough to keep the probe
to seconds on slow links, large enough to dwarf α on fast ones.

``mode="hosts"`` (the default, and what start-up measurement uses) probes one
pair of ranks inside each host and the first ranks of every pair of hosts,
then gives every rank pair its hosts' numbers: H + H(H-1)/2 probes.
``mode="all"`` probes every rank pair (for hosts whose ranks differ among
themselves, e.g. GPUs in NVLink islands). Probes run in rounds in which no
host takes part in two probes, so two probes never share a NIC.

``giantmodel bench topology`` runs this under torchrun (or spawns
``--nproc-per-node`` local ranks) and writes ``topology.yaml``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from giantmodel.distributed.links import (
    LinkTopology,
    derive_classes,
    from_host_matrices,
    host_set_key,
    load_topology,
)

MIN_BYTES, MAX_BYTES, TRIAL_BYTES = 256 << 10, 64 << 20, 1 << 20


def gather_hosts(group=None) -> tuple[list[str], list[list[int]]]:
    """Host names in order of their lowest rank, and each host's global ranks."""
    names: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    order: dict[str, list[int]] = {}
    for r, n in enumerate(names):
        order.setdefault(n, []).append(r)
    return list(order), list(order.values())


def schedule(pairs: list[tuple[int, int]], host_of) -> list[list[tuple[int, int]]]:
    """Rounds of probes in which no host appears twice (greedy colouring)."""
    rounds: list[list[tuple[int, int]]] = []
    busy: list[set[int]] = []
    for a, b in pairs:
        hosts = {int(host_of[a]), int(host_of[b])}
        for rnd, used in zip(rounds, busy):
            if not hosts & used:
                rnd.append((a, b))
                used |= hosts
                break
        else:
            rounds.append([(a, b)])
            busy.append(set(hosts))
    return rounds


def _pingpong(me: int, peer: int, initiator: bool, reps_small: int, reps_large: int,
              target_s: float, device: torch.device) -> tuple[float, float] | None:
    """One probe between ``me`` and ``peer``; (α s, β bytes/s) on the initiator."""
    small = torch.zeros(2, device=device)

    def exchange(buf: torch.Tensor) -> float:
        t0 = time.perf_counter()
        if initiator:
            dist.send(buf, peer)
            dist.recv(small, peer)
        else:
            dist.recv(buf, peer)
            dist.send(small, peer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    for _ in range(3):
        exchange(small)
    rtt = statistics.median(exchange(small) for _ in range(reps_small))
    trial = exchange(torch.empty(TRIAL_BYTES // 4, device=device))
    size = torch.tensor([0], dtype=torch.int64, device=device)
    if initiator:
        rate = TRIAL_BYTES / max(trial - rtt, 1e-7)
        size[0] = int(min(MAX_BYTES, max(MIN_BYTES, rate * target_s))) // 4 * 4
        dist.send(size, peer)
    else:
        dist.recv(size, peer)
    big = torch.empty(int(size[0]) // 4, device=device)
    exchange(big)
    t = statistics.median(exchange(big) for _ in range(reps_large))
    if not initiator:
        return None
    return rtt / 2, int(size[0]) / max(t - rtt, 1e-9)


def probe_links(mode: str = "hosts", reps_small: int = 20, reps_large: int = 3,
                target_s: float = 0.05, backend: str = "") -> LinkTopology:
    """Measure the default process group's links; every rank returns the same result.
    Messages live where the backend wants them: CUDA memory for NCCL."""
    if mode not in ("hosts", "all"):
        raise ValueError(f"mode must be 'hosts' or 'all', got {mode!r}")
    me, world = dist.get_rank(), dist.get_world_size()
    device = (torch.device("cuda", torch.cuda.current_device())
              if "nccl" in str(dist.get_backend()).lower() else torch.device("cpu"))
    names, ranks = gather_hosts()
    host_of = np.empty(world, dtype=np.int64)
    for h, rs in enumerate(ranks):
        host_of[rs] = h
    if mode == "hosts":
        pairs = [(rs[0], rs[1]) for rs in ranks if len(rs) > 1]
        pairs += [(ranks[a][0], ranks[b][0]) for a in range(len(ranks))
                  for b in range(a + 1, len(ranks))]
    else:
        pairs = [(a, b) for a in range(world) for b in range(a + 1, world)]
    found: dict[tuple[int, int], tuple[float, float]] = {}
    for rnd in schedule(pairs, host_of):
        for a, b in rnd:
            if me in (a, b):
                res = _pingpong(me, b if me == a else a, me == a, reps_small, reps_large,
                                target_s, device)
                if res is not None:
                    found[(a, b)] = res
        dist.barrier()
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, found)
    measured = {k: v for d in gathered for k, v in d.items()}
    backend = backend or dist.get_backend()
    if mode == "hosts":
        return _from_host_probes(names, ranks, host_of, measured, backend)
    alpha, beta = np.zeros((world, world)), np.full((world, world), np.inf)
    for (a, b), (al, be) in measured.items():
        alpha[a, b] = alpha[b, a] = al
        beta[a, b] = beta[b, a] = be
    topo = LinkTopology(names, ranks, alpha, beta, source="measured", backend=backend)
    topo.classes = derive_classes(alpha, beta, ranks)
    return topo


def _from_host_probes(names, ranks, host_of, measured, backend) -> LinkTopology:
    n = len(names)
    ha, hb = np.zeros((n, n)), np.full((n, n), np.inf)
    for (a, b), (al, be) in measured.items():
        x, y = int(host_of[a]), int(host_of[b])
        ha[x, y] = ha[y, x] = al
        hb[x, y] = hb[y, x] = be
    # a host with one rank has no inside link to measure; it is never used
    for h in range(n):
        if not np.isfinite(hb[h, h]):
            hb[h, h] = np.nanmax(np.where(np.isfinite(hb), hb, np.nan)) if n > 1 else 1e12
    return from_host_matrices(names, ranks, ha, hb, source="measured", backend=backend)


# ---------------------------------------------------------------- caching
def cache_dir() -> str:
    root = os.environ.get("GIANTMODEL_CACHE") or os.path.expanduser("~/.cache/giantmodel")
    return os.path.join(root, "topology")


def measure_or_load(spec: str, backend: str, refresh: bool = False,
                    log=print) -> LinkTopology:
    """The job's topology, the same on every rank: read from ``spec`` (a
    file), or measured ("measure") and cached per host set by rank 0.

    A cached measurement serves any rank order on the same hosts; rank 0
    decides whether it is usable and broadcasts the outcome."""
    world = dist.get_world_size()
    if spec != "measure":
        box = [None]
        if dist.get_rank() == 0:
            box[0] = load_topology(spec, world)
        dist.broadcast_object_list(box, src=0)
        return box[0]
    names, ranks = gather_hosts()
    path = os.path.join(cache_dir(), host_set_key(names, [len(r) for r in ranks], backend)
                        + ".yaml")
    box = [None]
    if dist.get_rank() == 0 and not refresh and os.path.isfile(path):
        try:
            box[0] = load_topology(path).remapped(names, ranks)
            log(f"topology: cached measurement {path}")
        except (ValueError, OSError) as e:
            log(f"topology: ignoring cache {path}: {e}")
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        return box[0]
    t0 = time.perf_counter()
    topo = probe_links(backend=backend)
    if dist.get_rank() == 0:
        log(f"topology: measured {len(names)} hosts in {time.perf_counter() - t0:.1f}s; "
            f"cached at {path}")
        try:
            topo.save(path)
        except OSError as e:
            log(f"topology: could not cache the measurement at {path}: {e}")
    return topo


# ------------------------------------------------------------------- cli
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="topology.yaml", help="where rank 0 writes the topology")
    p.add_argument("--mode", choices=("hosts", "all"), default="hosts",
                   help="hosts: one probe per host and per host pair; all: every rank pair")
    p.add_argument("--backend", default="gloo", help="process-group backend to probe (gloo, "
                   "nccl, giant)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="spawn this many local ranks (otherwise run under torchrun)")
    p.add_argument("--reps", type=int, default=20, help="round trips per latency probe")
    p.add_argument("--target-ms", type=float, default=50.0,
                   help="aim each bandwidth transfer at about this long")


def main(args) -> int:
    if args.nproc_per_node and "WORLD_SIZE" not in os.environ:
        from torch.distributed.run import main as torchrun_main

        argv = ["--standalone", f"--nproc-per-node={args.nproc_per_node}", "-m",
                "giantmodel", "bench", "topology", "--out", args.out, "--mode", args.mode,
                "--backend", args.backend, "--reps", str(args.reps), "--target-ms",
                str(args.target_ms)]
        torchrun_main(argv)
        return 0
    if "WORLD_SIZE" not in os.environ:
        print("error: run under torchrun, or pass --nproc-per-node", file=sys.stderr)
        return 2
    _init_backend(args.backend)
    try:
        t0 = time.perf_counter()
        topo = probe_links(args.mode, reps_small=args.reps, target_s=args.target_ms / 1e3,
                           backend=args.backend)
        if dist.get_rank() == 0:
            topo.save(args.out)
            print(format_topology(topo))
            print(f"measured in {time.perf_counter() - t0:.1f}s; wrote {args.out}")
    finally:
        dist.destroy_process_group()
    return 0


def _init_backend(backend: str) -> None:
    # "giant" is registered by ``import giantmodel`` (the package's __init__)
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device_id = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, device_id=device_id)


def format_topology(topo: LinkTopology) -> str:
    """Hosts, link classes and the per-pair table, for the terminal."""
    lines = [f"{topo.world_size} ranks on {topo.num_hosts} hosts ({topo.backend or 'declared'})"]
    for n, r in zip(topo.host_names, topo.host_ranks):
        lines.append(f"  {n}: ranks {r}")
    lines.append("link classes (fastest first):")
    for c in topo.classes:
        groups = "all ranks" if c.groups is None else c.groups
        lines.append(f"  {c.name:10s} alpha {c.latency_s * 1e6:9.1f} us  beta "
                     f"{c.bandwidth / 1e9:9.4f} GB/s  {groups}")
    return "\n".join(lines)
