"""Hung ranks: who did not arrive, and where every rank was.

A rank stuck before a collective (a deadlocked data loader, a slow file
system, a debugger) makes its peers fail after ``parallel.timeout_s`` with a
transport error that says little. :class:`HangWatch` turns that into:

- ``run.dir/hang-<rank>.txt`` for every rank that can still run Python: its
  host and pid, the last collective phase it entered (``step 3
  forward_backward``), the last collectives its process groups entered (op,
  group and its ranks, sequence number, sizes: torch's flight recorder, on by
  default for gloo and NCCL, ``TORCH_FR_BUFFER_SIZE`` entries, merged with
  the giant backend's record of its shared-memory collectives), and the
  Python stack of each of its threads (faulthandler, so a
  main thread blocked in C code is shown too);
- an error naming the rank(s) that did not arrive: those whose count of
  entered phases is behind the others'.

How: each rank records every phase it enters in the process group's store
(one small write per phase). The first rank whose collective fails sets a
store key; a daemon thread on every rank polls for it and writes that rank's
file, so the stuck rank reports even while its main thread is blocked.

Who did not arrive is decided at the granularity of the trainer's phases
(forward/backward, gradient norm, optimizer step, checkpoint save): every rank
runs the same phases, while the collectives inside one differ by layout.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import threading
import time
from pathlib import Path

import torch._C._distributed_c10d as torch_c10d
import torch.distributed as dist
from torch.distributed import distributed_c10d

from giantmodel.comm import record as giant_record

_KEY = "giantmodel/hang"
_POLL_S = 0.5
_SHOW_COLLECTIVES = 12


def _default_store():
    # the store torch's default process group rendezvoused on: reachable from
    # every rank on every host while any collective is stuck
    return distributed_c10d._get_default_store()


def _group_ranks(name: str) -> str:
    try:
        group = distributed_c10d._resolve_process_group(name)
        return str(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - destroyed or unknown here: the name still says which
        return "?"


def _describe(entry: dict) -> str:
    name, desc = (entry.get("process_group") or ["?", "?"])[:2]
    seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    return (f"group {name} ({desc}, ranks {_group_ranks(name)}) #{seq} "
            f"{entry.get('profiling_name')}")


def last_collectives(limit: int) -> tuple[str, str | None]:
    """The newest ``limit`` collectives this process entered, as lines (group
    name, description and global ranks, the group's sequence number, the op,
    input sizes and dtypes), and the newest one alone: where a rank that is
    stuck inside a collective waits. Ranks that disagree on a group's newest
    sequence number show the collective some did not reach.

    Entries come from torch's flight recorder (gloo, NCCL) and from the giant
    backend's own record (its shared-memory collectives), merged by time.
    (Gloo marks a timed-out collective finished, so completion states are
    not shown.)"""
    try:
        trace = json.loads(torch_c10d._dump_fr_trace_json(includeCollectives=True))
        recorded, source = trace.get("entries", []), "torch flight recorder"
    except Exception as e:  # noqa: BLE001 - an older torch or a backend without a recorder
        recorded, source = [], f"torch flight recorder unavailable: {e}"
    giant = giant_record.entries()
    if giant:
        source += ", giant backend record"
    merged = sorted(recorded + giant, key=lambda e: e.get("time_created_ns") or 0)
    entries = merged[-limit:]
    if not entries:
        return (f"last collectives entered: none recorded ({source}; TORCH_FR_BUFFER_SIZE=0, "
                "or no collective yet)\n", None)
    lines = [f"last collectives entered ({len(entries)} newest first, {source}):"]
    lines += [f"  {_describe(e)} in {e.get('input_sizes')} {e.get('input_dtypes')}"
              for e in reversed(entries)]
    return "\n".join(lines) + "\n", _describe(entries[-1])


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
        collectives, newest = last_collectives(_SHOW_COLLECTIVES)
        with open(path, "w") as f:
            f.write(f"rank {self.rank} of {self.world}, pid {os.getpid()} on "
                    f"{socket.gethostname()}, at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                    f"last collective phase entered: {self.entered} (phase #{self.count})\n\n"
                    f"{collectives}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        if newest is not None and self._store is not None:
            self._store.set(f"{_KEY}/collective/{self.rank}", newest)
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
            at = {r: (int(c), p) for r, (c, p) in self._read("at").items()}
            newest = self._read("collective")
        except Exception:  # noqa: BLE001 - the store is gone too: nothing to add
            return None
        ahead = max((c for c, _ in at.values()), default=0)
        late = [r for r in range(self.world) if at.get(r, (0, "start"))[0] < ahead]
        if not late:
            return None
        lead = next(p for c, p in at.values() if c == ahead)
        where = "; ".join(f"rank {r} last entered {at.get(r, (0, 'start'))[1]}" for r in late)
        shown = [self.rank] + late
        coll = ", ".join(f"rank {r} {newest[r][0]}" for r in shown if r in newest)
        return (f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not arrive "
                f"at {lead} ({where}); newest collective entered: {coll or 'not recorded'}; "
                f"every rank's stack is in {self.run_dir}/hang-<rank>.txt")

    def _read(self, kind: str) -> dict[int, list[str]]:
        """Each rank's ``kind`` record in the store, split on ``|``."""
        out = {}
        for r in range(self.world):
            key = f"{_KEY}/{kind}/{r}"
            if self._store.check([key]):
                out[r] = self._store.get(key).decode().split("|", 1)
        return out

    def close(self) -> None:
        """Stop the poller and wait for it: a daemon thread still inside a store
        call when the interpreter exits is torn down mid-C++ call, which can
        abort the process (SIGABRT) after training succeeded."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10 * _POLL_S)
