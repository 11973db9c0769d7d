"""``giantmodel doctor`` under torchrun: the rendezvous, every rank's host and
problems, and a short all-reduce and send/recv probe with their bandwidth.

Each rank has run the local checks on its own host; rank 0 gathers them and
reports every problem once per host, so one command covers a whole cluster.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from giantmodel.train.doctor_check import Check

_ITERS = 3
_NET_FIX = ("check that every host reaches MASTER_ADDR:MASTER_PORT and the others (firewall, "
            "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME on the interface that connects them)")


def _init(timeout_s: float) -> tuple[str, torch.device, float]:
    """The process group from torchrun's environment: NCCL on GPUs, else gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    t0 = time.perf_counter()
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_backend(), device, time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, device: torch.device) -> float:
    """The slowest rank's time: a collective is as fast as its slowest member."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def probe_all_reduce(nbytes: int, device: torch.device) -> tuple[float, float, float]:
    """Seconds per all-reduce of ``nbytes`` fp32, its algbw and busbw (GB/s,
    nccl-tests' definitions: busbw = algbw x 2(n-1)/n)."""
    n = dist.get_world_size()
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(x)  # warm-up: connections and buffers
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(_ITERS):
        dist.all_reduce(x)
    _sync(device)
    sec = _slowest((time.perf_counter() - t0) / _ITERS, device)
    algbw = nbytes / sec / 1e9
    return sec, algbw, algbw * 2 * (n - 1) / n


def probe_ring(nbytes: int, device: torch.device) -> float:
    """GB/s of this rank's send to rank+1 while it receives from rank-1
    (every link of the ring busy at once, as in a ring all-reduce)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    send = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % n),
               dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    exchange()
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(_ITERS):
        exchange()
    _sync(device)
    return nbytes / ((time.perf_counter() - t0) / _ITERS) / 1e9


def _rendezvous_line(world: int, hosts: int, backend: str, init_s: float) -> str:
    addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return (f"torchrun: rendezvous {addr} (run id {run_id}, restart {restarts}), {world} ranks "
            f"on {hosts} host(s), {backend} process group up in {init_s:.2f} s")


def _rank_lines(entries: list[dict], mine: list[Check]) -> tuple[list[str], list[Check]]:
    """One line per rank, then each problem of another host that rank 0's
    own report does not already show (identical lines are shown once)."""
    lines, extra = [], []
    shown = {(c.name, c.status, c.detail, c.fix) for c in mine}
    for e in entries:
        lines.append(f"  rank {e['rank']:<3} host {e['host']} local rank {e['local_rank']}"
                     f"/{e['local_world']} device {e['device']} pid {e['pid']}")
    for e in entries:
        for fields in e["problems"]:
            if tuple(fields) in shown:
                continue
            shown.add(tuple(fields))
            name, status, detail, fix = fields
            extra.append(Check(f"{name}@{e['host']}", status, detail, fix))
            lines.append(f"  rank {e['rank']}: {extra[-1].line().strip()}")
    return lines, extra


def _probe_lines(nbytes: int, device: torch.device, backend: str) -> tuple[list[str], list[Check]]:
    n = dist.get_world_size()
    sec, algbw, busbw = probe_all_reduce(nbytes, device)
    ring = probe_ring(nbytes, device)
    rates = [None] * n
    dist.all_gather_object(rates, ring)
    slow = min(range(n), key=lambda r: rates[r])
    size = f"{nbytes / (1 << 20):g} MiB"
    lines = [f"  all-reduce {size} x {n} ranks ({backend}): {sec * 1e3:.2f} ms, algbw "
             f"{algbw:.2f} GB/s, busbw {busbw:.2f} GB/s",
             f"  send/recv ring {size}: slowest link {slow}->{(slow + 1) % n} "
             f"{rates[slow]:.2f} GB/s, median {sorted(rates)[n // 2]:.2f} GB/s"]
    return lines, []


def distributed_report(checks: list[Check], probe_mb: float | None,
                       timeout_s: float) -> tuple[list[str] | None, list[Check]]:
    """Collective over the torchrun world. Rank 0 gets the lines to print
    and the checks of every rank; the others get None and a list whose FAIL
    entries mirror the world's, so every rank exits with the same status."""
    try:
        backend, device, init_s = _init(timeout_s)
    except Exception as e:
        fail = Check("rendezvous", "fail", f"{type(e).__name__}: {e}"[:300], _NET_FIX)
        return ([] if int(os.environ.get("RANK", "0")) == 0 else None), checks + [fail]
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = [(c.name, c.status, c.detail, c.fix) for c in checks if c.status in ("warn", "fail")]
    entry = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
             "local_rank": os.environ.get("LOCAL_RANK", "?"),
             "local_world": os.environ.get("LOCAL_WORLD_SIZE", "?"),
             "device": str(device), "problems": problems}
    entries = [None] * world
    dist.all_gather_object(entries, entry)
    nbytes = int((probe_mb or (64 if device.type == "cuda" else 8)) * (1 << 20)) // 4 * 4
    lines = [_rendezvous_line(world, len({e["host"] for e in entries}), backend, init_s)]
    rank_lines, extra = _rank_lines(entries, checks)
    lines += rank_lines
    try:
        probe, _ = _probe_lines(nbytes, device, backend)
        lines += probe
    except Exception as e:
        extra.append(Check("probe", "fail", f"{type(e).__name__}: {e}"[:300], _NET_FIX))
        lines.append(extra[-1].line())
    any_fail = any(p[1] == "fail" for e in entries for p in e["problems"]) or any(
        c.status == "fail" for c in extra)
    try:
        dist.destroy_process_group()
    except Exception:  # a peer may be gone already; the report stands
        pass
    if rank != 0:
        mirror = [Check("world", "fail", "a rank failed")] if any_fail else []
        return None, checks + mirror
    return lines, checks + extra
