"""A rank that stalls or dies mid-collective makes the others fail fast, and
no shared-memory segment is left behind.

These tests spawn ranks by hand: ``run_ranks`` treats any dead rank as a test
failure, while here a rank dies on purpose and the survivors report.
"""

from __future__ import annotations

import os
import queue as queue_mod
import signal
import subprocess
import time
from datetime import timedelta

import pytest
import torch.multiprocessing as mp

from giantmodel.comm import _lib
from giantmodel.comm.shm import list_segments, remove_stale_segments
from giantmodel.testing import free_port

needs_core = pytest.mark.skipif(_lib.skip_reason_for_tests() is not None, reason=str(_lib.skip_reason_for_tests()))
WORLD = 3
VICTIM = WORLD - 1


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from giantmodel.comm import register_backend

    register_backend()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    # 1) a stalled rank: the others time out after the group's 3 s timeout
    g1 = dist.new_group(backend="giant", timeout=timedelta(seconds=3))
    queue.put(("segment", rank, g1._shm.name))
    if rank == VICTIM:
        time.sleep(6)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 20), group=g1)
        queue.put(("stall", rank, "no error", time.monotonic() - t0))
    except Exception as exc:  # noqa: BLE001 - the error text is the result
        queue.put(("stall", rank, str(exc), time.monotonic() - t0))
    # 2) a killed rank: the others notice its death long before the timeout
    g2 = dist.new_group(backend="giant", timeout=timedelta(seconds=30))
    queue.put(("segment", rank, g2._shm.name))
    dist.barrier()
    if rank == VICTIM:
        time.sleep(0.5)  # let the others enter the collective first
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4 << 20), group=g2)
        queue.put(("kill", rank, "no error", time.monotonic() - t0))
    except Exception as exc:  # noqa: BLE001
        queue.put(("kill", rank, str(exc), time.monotonic() - t0))
    queue.close()
    queue.join_thread()  # flush the reports: os._exit below skips the feeder thread
    os._exit(0)  # skip teardown that would wait on the dead rank


@pytest.mark.slow
@needs_core
@pytest.mark.timeout(90)
def test_stalled_and_killed_rank_fail_fast_and_leave_no_segments():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    got: dict[tuple[str, int], tuple] = {}
    want = {("stall", r) for r in range(WORLD)} | {("kill", r) for r in range(VICTIM)}
    deadline = time.monotonic() + 75
    try:
        while not want <= set(got) and time.monotonic() < deadline:
            try:
                kind, rank, *rest = queue.get(timeout=1)
            except queue_mod.Empty:
                continue
            key = (kind, rank) if kind != "segment" else (kind, rank, rest[0])
            got[key] = tuple(rest)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert want <= set(got), f"missing reports: {sorted(want - set(got))}"
    stall = [got[("stall", r)] for r in range(VICTIM)]
    # the first rank to time out aborts the others at that moment: a rank
    # that entered the collective later reports less than the timeout
    assert max(secs for _, secs in stall) > 2.5, stall
    for r in range(VICTIM):
        msg, secs = got[("stall", r)]
        assert "timed out" in msg or "aborted" in msg, msg
        assert secs < 10, secs
        msg, secs = got[("kill", r)]
        assert "died" in msg or "aborted" in msg, msg
        assert secs < 5, f"rank {r} took {secs:.1f}s to notice a dead peer"
    msg, _ = got[("stall", VICTIM)]
    assert "aborted" in msg or "timed out" in msg, msg  # late rank is told, not hung
    names = {k[2].lstrip("/") for k in got if k[0] == "segment"}
    assert len(names) == 2
    assert not names & set(list_segments()), "shared-memory segment left in /dev/shm"


def test_stale_segment_of_dead_creator_is_removed():
    proc = subprocess.run(["sh", "-c", "echo $$"], check=True, capture_output=True, text=True)
    dead_pid = int(proc.stdout.strip())
    path = f"/dev/shm/giantmodel-{dead_pid}-0123456789ab"
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    mine = f"/dev/shm/giantmodel-{os.getpid()}-0123456789ab"
    with open(mine, "wb") as f:
        f.write(b"x")
    try:
        removed = remove_stale_segments()
        assert os.path.basename(path) in removed and not os.path.exists(path)
        assert os.path.exists(mine), "a live process's segment must be kept"
    finally:
        for p in (path, mine):
            if os.path.exists(p):
                os.unlink(p)
