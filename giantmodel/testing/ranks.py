"""Run a function on N local ranks (gloo on CPU), for tests and benchmarks.

Every multi-process test goes through :func:`run_ranks`, so that a hang or a
crash in one rank fails the test within ``timeout`` seconds instead of stalling
CI. Starting a rank costs seconds on a small host (Python plus ``import
torch``), so callers should run several cases inside one call.

Ranks start in one of two ways (``start``, or ``GIANTMODEL_RANKS_START``):

- ``spawn`` (the default): a fresh interpreter per rank, as a launcher gives.
  What a rank measures of itself (RSS, start-up) is what training would see.
- ``forkserver``: ranks are forked from one server process that imported
  torch and giantmodel once. A rank then starts in tens of milliseconds
  instead of the 3-5 s that ``import torch`` plus giantmodel costs each rank
  of a 2-core host; the test suite uses it (tests/conftest.py). Each rank is
  still a new process with its own process group: nothing else is shared.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue as queue_module
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

# What the fork server imports once, so that a forked rank finds it loaded:
# the heavy imports of every rank (torch.distributed, DCP, pipelining, the
# trainer). A module that fails to import here is simply imported later.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "giantmodel.train.trainer",
                      "giantmodel.objectives", "giantmodel.checkpoint"]
START_METHODS = ("spawn", "forkserver")
_forkserver_ready = False


def _context(start: str | None):
    """The multiprocessing context for ``start`` (None: the environment's
    ``GIANTMODEL_RANKS_START``, else spawn)."""
    global _forkserver_ready
    method = start or os.environ.get("GIANTMODEL_RANKS_START") or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"unknown rank start method {method!r}: use one of {START_METHODS}")
    ctx = mp.get_context(method)
    if method == "forkserver" and not _forkserver_ready:
        # Preload is read when the server first starts; OMP_NUM_THREADS before
        # torch's import keeps the server (and its forks) single-threaded.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        _forkserver_ready = True
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _take_callers_stdio(caller: int) -> None:
    """Write to where the caller's stdout and stderr point now, as a spawned
    rank would: a forked rank inherits the fork server's, which were the
    caller's when the server started (pytest's capture of some earlier test)."""
    for fd in (1, 2):
        try:
            new = os.open(f"/proc/{caller}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:  # no /proc, or a socket: keep the server's
            continue
        os.dup2(new, fd)
        os.close(new)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple,
            env: dict, backend: str | None, pg_timeout: float, queue,
            caller: int | None = None) -> None:
    if caller is not None:
        _take_callers_stdio(caller)
    # A rank killed by a signal (a crash in native code) prints every
    # thread's Python stack to its stderr, which the test's capture shows.
    faulthandler.enable(all_threads=True)
    # A forked rank inherits the fork server's environment, not the caller's:
    # ``env`` carries the caller's whole environment (see _run_once).
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend is not None:
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout))
        # Plain pickle copies tensor data: torch's queue would pass tensors
        # through shared memory that dies with this process.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if backend is not None and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may be gone already
                pass


class RankFailure(RuntimeError):
    """A rank raised or died. ``peer_exit_codes`` holds the other ranks' exit
    codes (negative: killed by that signal; None: still running)."""

    def __init__(self, message: str, peer_exit_codes: dict[int, int | None]):
        super().__init__(message)
        self.peer_exit_codes = peer_exit_codes


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180,
              backend: str | None = "gloo", env: dict | None = None,
              pg_timeout: float = 60, start: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    ``fn`` must be importable (a module-level function). With ``backend`` set,
    the default process group is initialised first. Returns the per-rank
    results in rank order. Raises :class:`RankFailure` with the failing rank's
    traceback and its peers' exit codes, or ``TimeoutError`` after ``timeout``
    seconds; either way every rank is killed before returning. Nothing is
    retried: a rank that crashes fails the test, as it would fail training.
    ``start`` picks how ranks start (see the module's docstring); ``env`` is
    added to this process's environment for the ranks. A variable that a
    preloaded module reads at import time needs ``start="spawn"``.
    """
    return _run_once(fn, world_size, args, timeout, backend, env, pg_timeout, start)


def _run_once(fn: Callable, world_size: int, args: tuple, timeout: float,
              backend: str | None, env: dict | None, pg_timeout: float,
              start: str | None) -> list[Any]:
    ctx = _context(start)
    caller = os.getpid() if ctx.get_start_method() == "forkserver" else None
    sys.stdout.flush()
    sys.stderr.flush()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ) | dict(env or {})
    procs = []
    for rank in range(world_size):
        p = ctx.Process(target=_worker, daemon=True,
                        args=(rank, world_size, port, fn, args, env, backend,
                              pg_timeout, queue, caller))
        p.start()
        procs.append(p)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout}s")
            try:
                rank, ok, value = queue.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:  # check for ranks that died silently
                dead = [r for r, p in enumerate(procs)
                        if r not in results and not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    # give a dying rank's traceback a moment to arrive first
                    time.sleep(0.5)
                    while not queue.empty():
                        rank, ok, value = queue.get()
                        if not ok:
                            raise RankFailure(f"rank {rank} failed:\n{value}",
                                              _peer_exit_codes(procs, rank)) from None
                        results[rank] = pickle.loads(value)
                    codes = {r: procs[r].exitcode for r in dead}
                    raise RankFailure(f"ranks {dead} exited with codes {codes}", codes) from None
                continue
            if not ok:
                codes = _peer_exit_codes(procs, rank)
                raise RankFailure(f"rank {rank} failed:\n{value}\n(other ranks' exit codes: "
                                  f"{codes}; negative = killed by that signal, None = running)",
                                  codes)
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]


def _peer_exit_codes(procs, failed: int) -> dict[int, int | None]:
    """Exit codes of the other ranks, after a moment for them to finish: a
    rank that failed only because a peer vanished points at that peer, and a
    negative code names the signal that killed it (-11 is SIGSEGV)."""
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    return {r: p.exitcode for r, p in enumerate(procs) if r != failed}


def scratch_dir(prefix: str = "giantmodel-") -> str:
    """A fresh temporary directory that every rank of one test can share."""
    return tempfile.mkdtemp(prefix=prefix)
