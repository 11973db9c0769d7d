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

On NCCL a hang never raises in Python: the collective is asynchronous, the
main thread waits in a CUDA synchronisation, and when the process-group
timeout passes NCCL's watchdog thread aborts the process (the default
``TORCH_NCCL_ASYNC_ERROR_HANDLING``), so a report made after the error would
never print. The watch therefore has its own, earlier deadline
(:func:`report_deadlines`): rank 0, when its phase has not changed for 40%
of the timeout and some rank's phase count is behind the others', asks every
rank for its file and prints the line itself, well before torch gives up.

Who did not arrive is decided at the granularity of the trainer's phases
(forward/backward, gradient norm, optimizer step, checkpoint save): every rank
runs the same phases, while the collectives inside one differ by layout.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch._C._distributed_c10d as torch_c10d
import torch.distributed as dist
from torch.distributed import distributed_c10d

from giantmodel.comm import record as giant_record

_KEY = "giantmodel/hang"
_POLL_S = 0.5
_SHOW_COLLECTIVES = 12
# torch's default for TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: its monitor thread
# kills the process when NCCL's watchdog thread has not ticked for this long.
_NCCL_HEARTBEAT_DEFAULT_S = 480.0


@dataclass(frozen=True)
class Deadlines:
    """When the hang report fires, against when torch ends the process."""

    report_after_s: float
    """Rank 0 reports once its phase has not changed for this long."""
    report_wait_s: float
    """How long the report waits for the other ranks' files."""
    pg_timeout_s: float
    """The process-group timeout (``parallel.timeout_s``): gloo raises then,
    NCCL's watchdog aborts the process then."""
    nccl_heartbeat_s: float
    """``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``: NCCL's monitor may kill a process
    whose watchdog is stuck this long after its last tick."""

    @property
    def report_done_s(self) -> float:
        """Latest time, after the last progress, that the report has printed."""
        return self.report_after_s + _POLL_S + self.report_wait_s

    @property
    def killed_s(self) -> float:
        """Earliest time torch may end a hung process (NCCL), or raise (gloo)."""
        return min(self.pg_timeout_s, self.nccl_heartbeat_s)


def report_deadlines(timeout_s: float, env=None) -> Deadlines:
    """The report's own deadline for a process-group timeout of ``timeout_s``.

    Ordering (tests/test_gpu_path.py checks it): the report is complete
    (``report_after + poll + wait``) before the earliest moment torch may end
    the process, the PG timeout or NCCL's heartbeat limit, whichever is
    sooner. Reporting at 40% of that leaves the rest as margin for a slow
    store and for ranks whose last progress came later than rank 0's; the
    wait for the other ranks' files covers two of their polls, at most a
    tenth of the limit beyond that (holds for timeouts from about 2 s). A
    phase that honestly lasts longer than 40% of the timeout
    only costs a spurious report when ranks' phase counts also differ for that
    long, which a healthy step does not do: every rank enters the same phases.
    """
    env = os.environ if env is None else env
    heartbeat = float(env.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", _NCCL_HEARTBEAT_DEFAULT_S))
    limit = min(timeout_s, heartbeat)
    return Deadlines(report_after_s=0.4 * limit, report_wait_s=min(5.0, max(2 * _POLL_S, 0.1 * limit)),
                     pg_timeout_s=timeout_s, nccl_heartbeat_s=heartbeat)


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


def _store_timeout_s(store) -> float | None:
    # init_process_group rendezvoused with its own timeout: the PG timeout
    try:
        return store.timeout.total_seconds()
    except Exception:  # noqa: BLE001 - a store without one
        return None


class HangWatch:
    """``timeout_s`` is the process groups' timeout (``parallel.timeout_s``);
    without it, the default store's timeout, which init_process_group set to
    the same value. It sets the early report's deadline."""

    def __init__(self, run_dir: str | os.PathLike, rank: int, world_size: int,
                 timeout_s: float | None = None):
        self.run_dir, self.rank, self.world = Path(run_dir), rank, world_size
        self.entered, self.count = "start", 0
        self._store = _default_store() if world_size > 1 and dist.is_initialized() else None
        if timeout_s is None and self._store is not None:
            timeout_s = _store_timeout_s(self._store)
        self.deadlines = report_deadlines(timeout_s) if timeout_s else None
        self.early_report: str | None = None  # what the early report printed
        self._progress_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        if self._store is not None:
            self._thread = threading.Thread(target=self._poll, name="giantmodel-hangwatch",
                                            daemon=True)
            self._thread.start()

    def enter(self, phase: str) -> None:
        """Record that this rank entered ``phase`` (it holds collectives)."""
        self.entered, self.count = phase, self.count + 1
        self._progress_at = time.monotonic()
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
                if self._stalled() and self._report_early():
                    return
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return

    def _stalled(self) -> bool:
        """Rank 0 only (one reader of every rank's record, not N): no phase
        entered for the report's deadline."""
        d = self.deadlines
        return (self.rank == 0 and d is not None
                and time.monotonic() - self._progress_at > d.report_after_s)

    def _report_early(self) -> bool:
        """Report before torch's timeout when some rank is behind; else look
        again after another deadline (a long phase that every rank is in)."""
        at = {r: int(c) for r, (c, _) in self._read("at").items()}
        ahead = max(at.values(), default=0)
        if not any(at.get(r, 0) < ahead for r in range(self.world)):
            self._progress_at = time.monotonic()
            return False
        line = self.report(self.deadlines.report_wait_s)
        if line is None:
            return False
        self._store.set(f"{_KEY}/done/{self.rank}", "1")
        d = self.deadlines
        self.early_report = (f"no progress for {d.report_after_s:.0f} s (process-group timeout "
                             f"{d.pg_timeout_s:.0f} s): {line}")
        print(f"error: rank {self.rank}: {self.early_report}", file=sys.stderr, flush=True)
        return True

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
