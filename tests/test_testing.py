"""The multi-rank test runner: failures name the rank, and only native crashes are retried."""

import os
import signal
from pathlib import Path

import pytest
import torch.distributed as dist

from giantmodel.testing import RankFailure, run_ranks


def _segfault_first_time(rank, world, marker):
    """Rank 0 dies by SIGSEGV on the first attempt; rank 1 then loses its peer."""
    if rank == 0 and not Path(marker).exists():
        Path(marker).write_text("crashed once")
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
def test_native_crash_is_retried_once_and_logic_errors_are_not(tmp_path):
    marker = tmp_path / "crash"
    with pytest.warns(RuntimeWarning, match="killed by signals"):
        assert run_ranks(_segfault_first_time, 2, str(marker), timeout=60, pg_timeout=10,
                         retry_native_crash=True) == [0, 1]
    (tmp_path / "crash2").unlink(missing_ok=True)
    with pytest.raises(RankFailure) as err:  # without opting in, no retry
        run_ranks(_segfault_first_time, 2, str(tmp_path / "crash2"), timeout=60, pg_timeout=10)
    assert err.value.peer_exit_codes.get(0) == -signal.SIGSEGV or "exited with codes" in str(err.value)
    with pytest.raises(RankFailure, match="ValueError: boom"):
        run_ranks(_python_error, 2, timeout=60, retry_native_crash=True)
    with pytest.raises((RankFailure, TimeoutError)):
        run_ranks(_rank0_skips_a_collective, 2, timeout=20, pg_timeout=5, retry_native_crash=True)
