"""Hung ranks: who did not arrive, and where every rank was.

A rank stuck before a collective (a deadlocked data loader, a slow file
system, a debugger) makes its peers fail after ``parallel.timeout_s`` with a
transport error that says little. :class:`HangWatch` turns that into:

- ``run.dir/hang-<rank>.txt`` for every rank that can still run Python: its
  host and pid, the last collective phase it entered (``step 3
  forward_backward``), and the Python stack of each of its threads
  (faulthandler, so a main thread blocked in C code is shown too);
- an error naming the rank(s) that did not arrive: those whose count of
  entered phases is behind the others'.

How: each rank records every phase it enters in the process group's store
(one small write per phase). The first rank whose collective fails sets a
store key; a daemon thread on every rank polls for it and writes that rank's
file, so the stuck rank reports even while its main thread is blocked.

The granularity is the trainer's phases (forward/backward, gradient norm,
optimizer step, checkpoint save), each of which contains collectives, not
individual collectives.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import threading
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed import distributed_c10d

_KEY = "giantmodel/hang"
_POLL_S = 0.5


def _default_store():
    # the store torch's default process group rendezvoused on: reachable from
    # every rank on every host while any collective is stuck
    return distributed_c10d._get_default_store()


class HangWatch:
    def __init__(self, run_dir: str | os.PathLike, rank: int, world_size: int):
        self.run_dir, self.rank, self.world = Path(run_dir), rank, world_size
        self.entered, self.count = "start", 0
        self._store = _default_store() if world_size > 1 and dist.is_initialized() else None
        self._stop = threading.Event()
        self._thread = None
        if self._store is not None:
            self._thread = threading.Thread(target=self._poll, name="giantmodel-hangwatch",
                                            daemon=True)
            self._thread.start()

    def enter(self, phase: str) -> None:
        """Record that this rank entered ``phase`` (it holds collectives)."""
        self.entered, self.count = phase, self.count + 1
        if self._store is not None:
            try:
                self._store.set(f"{_KEY}/at/{self.rank}", f"{self.count}|{phase}")
            except Exception:  # noqa: BLE001 - the store's host left; the collective will say so
                self._store = None

    # ------------------------------------------------------------ reporting
    def _write(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / f"hang-{self.rank}.txt"
        with open(path, "w") as f:
            f.write(f"rank {self.rank} of {self.world}, pid {os.getpid()} on "
                    f"{socket.gethostname()}, at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                    f"last collective phase entered: {self.entered} (phase #{self.count})\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        return path

    def _poll(self) -> None:
        while not self._stop.wait(_POLL_S):
            try:
                if self._store.check([_KEY]):
                    self._write()
                    self._store.set(f"{_KEY}/done/{self.rank}", "1")
                    return
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return

    def report(self, wait_s: float = 5.0) -> str | None:
        """After a failed collective: ask every rank for its file, and name the
        ranks that did not arrive. None when there is no store to ask."""
        if self._store is None:
            return None
        try:
            self._store.set(_KEY, str(self.rank))
            deadline = time.monotonic() + wait_s
            keys = [f"{_KEY}/done/{r}" for r in range(self.world) if r != self.rank]
            self._write()
            while not self._store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.1)
            at = {}
            for r in range(self.world):
                key = f"{_KEY}/at/{r}"
                if self._store.check([key]):
                    count, phase = self._store.get(key).decode().split("|", 1)
                    at[r] = (int(count), phase)
        except Exception:  # noqa: BLE001 - the store is gone too: nothing to add
            return None
        ahead = max((c for c, _ in at.values()), default=0)
        late = [r for r in range(self.world) if at.get(r, (0, "start"))[0] < ahead]
        if not late:
            return None
        lead = next(p for c, p in at.values() if c == ahead)
        where = "; ".join(f"rank {r} last entered {at.get(r, (0, 'start'))[1]}" for r in late)
        return (f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not arrive "
                f"at {lead} ({where}); every rank's stack is in {self.run_dir}/hang-<rank>.txt")

    def close(self) -> None:
        self._stop.set()
