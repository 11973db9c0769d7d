"""The run directory: checked before any process group, owned by one run.

* :func:`check_run_paths` refuses, before any process group exists, a
  ``run.dir`` that cannot be created or written (a read-only parent, a path
  through a regular file) and a ``checkpoint.init_from`` that does not exist.
  Missing parents of ``run.dir`` are created when the nearest existing one
  is a writable directory.
* :class:`RunLock` makes a second run in the same ``run.dir`` fail at once
  instead of interleaving checkpoints and metrics with the first. The lock
  is an ``flock`` on ``run.dir/run.lock``, which names the holder's pid and
  host. The kernel drops it when the holder dies (even by SIGKILL), so a
  crashed run never leaves a stale lock behind and a restarted job (torchrun
  ``--max-restarts``) takes it again. ``flock`` is advisory and per host:
  two hosts sharing ``run.dir`` over NFS are not guaranteed to exclude each
  other.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from giantmodel.config import ConfigError, JobConfig

LOCK_NAME = "run.lock"


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def check_run_paths(cfg: JobConfig) -> None:
    """Raise ConfigError naming ``run.dir`` or ``checkpoint.init_from`` when
    the run could not write its directory or read its initial weights."""
    run = Path(cfg.run.dir).absolute()
    if run.exists():
        if not run.is_dir():
            raise ConfigError(f"{run} exists and is not a directory; choose another run.dir",
                              key="run.dir")
        if not os.access(run, os.W_OK | os.X_OK):
            raise ConfigError(f"{run} is not writable; fix its permissions or choose "
                              "another run.dir", key="run.dir")
    else:
        probe = _nearest_existing(run)
        if not probe.is_dir():
            raise ConfigError(f"cannot create {run}: {probe} is not a directory; choose "
                              "another run.dir", key="run.dir")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ConfigError(f"cannot create {run}: {probe} is not writable; fix its "
                              "permissions or choose another run.dir", key="run.dir")
    init = cfg.checkpoint.init_from
    if init and not Path(init).exists():
        raise ConfigError(f"{init} does not exist; give a Hugging Face directory or a "
                          "giantmodel checkpoint directory", key="checkpoint.init_from")


class RunLock:
    """Exclusive ownership of a run directory for this process's lifetime."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "an unknown process"
        except OSError:
            return "an unknown process"

    def acquire(self) -> None:
        """Take the lock or raise ConfigError naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"{self.path.parent} is in use by another run ({self.holder()}, lock "
                f"{self.path}); wait for it to finish, stop it, or choose another run.dir",
                key="run.dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, (f"pid {os.getpid()} on host {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n").encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
