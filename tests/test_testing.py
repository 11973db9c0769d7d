"""The multi-rank test runner: failures name the rank and how its peers
ended, and nothing is retried (a crash fails the test as it fails training)."""

import os
import signal

import pytest
import torch.distributed as dist

from giantmodel.testing import RankFailure, run_ranks


def _segfault(rank, world):
    """Rank 0 dies by SIGSEGV; rank 1 then loses its peer."""
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return rank


def _python_error(rank, world):
    if rank == 1:
        raise ValueError("boom")
    return rank


def _rank0_skips_a_collective(rank, world):
    # Rank 0 exits cleanly without the barrier rank 1 waits in: a logic bug.
    if rank == 1:
        dist.barrier()
    return rank


@pytest.mark.timeout(120)
def test_crashes_and_errors_fail_and_name_the_rank():
    with pytest.raises(RankFailure) as err:
        run_ranks(_segfault, 2, timeout=60, pg_timeout=10)
    codes = err.value.peer_exit_codes
    assert codes.get(0) == -signal.SIGSEGV or "exited with codes {0: -11}" in str(err.value), err.value
    with pytest.raises(RankFailure, match="ValueError: boom"):
        run_ranks(_python_error, 2, timeout=60)
    with pytest.raises((RankFailure, TimeoutError)):
        run_ranks(_rank0_skips_a_collective, 2, timeout=20, pg_timeout=5)
    assert "retry_native_crash" not in run_ranks.__code__.co_varnames


def _report(rank, world, marker):
    print(f"{marker} rank {rank} to stdout", flush=True)
    print(f"{marker} rank {rank} to stderr", file=__import__("sys").stderr, flush=True)
    return os.environ.get("GM_TEST_MARK"), os.getpid()


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_ranks_see_the_callers_output_and_environment(start, capfd, monkeypatch):
    """Forked ranks write where the caller's stdout and stderr point now and
    see its environment now, as spawned ones do (the fork server's were
    fixed when it started, an earlier test's)."""
    monkeypatch.setenv("GM_TEST_MARK", start)
    out = run_ranks(_report, 2, f"mark-{start}", backend=None, start=start)
    assert [env for env, _ in out] == [start, start]
    assert len({pid for _, pid in out} | {os.getpid()}) == 3
    got = capfd.readouterr()
    for rank in (0, 1):
        assert f"mark-{start} rank {rank} to stdout" in got.out
        assert f"mark-{start} rank {rank} to stderr" in got.err
