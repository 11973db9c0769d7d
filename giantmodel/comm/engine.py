"""Background engine that runs a process group's collectives off the caller.

Each group owns one engine thread. ``submit`` queues a job and returns a
``torch.futures.Future`` at once, so ``async_op=True`` callers (DDP's gradient
buckets, FSDP2's prefetches) keep computing while the collective runs; the
C++ core and gloo release the GIL while they wait and copy.

Order is the whole difficulty: every rank must run the same collectives in the
same order or the group deadlocks. FIFO mode runs jobs in submission order,
which is identical on every rank of an SPMD program. Priority mode lets a
higher-priority job overtake queued ones (a DDP hook gives the first layers'
buckets the highest priority, since the next forward needs them first). Rank
0 alone chooses and posts each choice to a ring in shared memory; the other
ranks run whatever was posted, waiting for that job to be submitted locally
if need be. Any order rank 0 picks is one every rank can follow, because in
an SPMD program the set of jobs submitted before a rank blocks is the same
everywhere.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable

from torch.futures import Future

from giantmodel.comm.shm import CommArgError, CommError, ShmGroup

Job = Callable[[], object]


class CollectiveEngine:
    """Runs jobs for one process group on a daemon thread."""

    def __init__(self, name: str, sched: ShmGroup | None = None, leader: bool = True):
        self.name = name
        self._sched = sched  # priority mode when set
        self._leader = leader
        # Two conditions over one lock: the engine thread waits for work on
        # ``_cv``, drain() waits for idleness on ``_idle``. With one condition
        # every inline collective woke the sleeping engine thread for nothing.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._fifo: deque[tuple[int, Job, Future]] = deque()
        self._heap: list[tuple[int, int, Job, Future]] = []
        self._by_id: dict[int, tuple[Job, Future]] = {}
        self._ids = itertools.count()
        self._in_flight = 0
        self._drainers = 0   # threads waiting in drain(): notify only when there are some
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self._exec_lock = threading.Lock()
        self._k = 0

    @property
    def priority_mode(self) -> bool:
        return self._sched is not None

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"giant-{self.name}",
                                            daemon=True)
            self._thread.start()

    def idle(self) -> bool:
        return self._in_flight == 0

    def run_inline(self, job: Job) -> object | None:
        """Run ``job`` in the caller when nothing is queued; returns a sentinel
        ``NotImplemented`` when the engine is busy and the job must be queued.

        FIFO mode only: with the queue empty, running now is the order every
        other rank uses too. It saves a thread hand-off on small messages.
        """
        if self._sched is not None:
            return NotImplemented
        with self._lock:
            if self._in_flight:
                return NotImplemented
            self._in_flight += 1
        try:
            with self._exec_lock:
                self._raise_if_failed()
                return job()
        except BaseException as exc:
            self._note_failure(exc)
            raise
        finally:
            with self._lock:
                self._in_flight -= 1
                if not self._in_flight and self._drainers:
                    self._idle.notify_all()

    def submit(self, job: Job, priority: int = 0) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise CommError(f"process group {self.name} is shut down")
            op_id = next(self._ids)
            self._in_flight += 1
            if not self.priority_mode:
                self._fifo.append((op_id, job, fut))
            elif self._leader:
                heapq.heappush(self._heap, (-priority, op_id, job, fut))
            else:
                self._by_id[op_id] = (job, fut)
            self._ensure_thread()
            self._cv.notify_all()
        return fut

    def _note_failure(self, exc: BaseException) -> None:
        """Later collectives fail too: ranks may now disagree on what ran.
        Not after a :class:`CommArgError`, which every rank raised alike
        before any data moved."""
        if not isinstance(exc, CommArgError):
            self._failure = self._failure or exc

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise CommError(f"an earlier collective on group {self.name} failed: "
                            f"{self._failure}") from self._failure

    def _next(self) -> tuple[Job, Future] | None:
        """The next job to run per this rank's role, or None at shutdown."""
        if self._sched is not None and not self._leader:
            k, self._k = self._k, self._k + 1
            op_id = self._sched.sched_wait(k)
            with self._cv:
                self._cv.wait_for(lambda: op_id in self._by_id or self._closed)
                return self._by_id.pop(op_id) if op_id in self._by_id else None
        with self._cv:
            self._cv.wait_for(lambda: self._fifo or self._heap or self._closed)
            if self._fifo:
                _, job, fut = self._fifo.popleft()
            elif self._heap:
                _, op_id, job, fut = heapq.heappop(self._heap)
            else:
                return None
        if self._sched is not None:
            k, self._k = self._k, self._k + 1
            self._sched.sched_post(k, op_id)
        return job, fut

    def _loop(self) -> None:
        while True:
            try:
                item = self._next()
            except BaseException as exc:  # noqa: BLE001 - fail every queued job
                self._fail_all(exc)
                return
            if item is None:
                return
            job, fut = item
            try:
                with self._exec_lock:
                    self._raise_if_failed()
                    result = job()
                fut.set_result(result)
            except BaseException as exc:  # noqa: BLE001 - surfaces in Work.wait()
                self._note_failure(exc)
                fut.set_exception(exc)
            finally:
                with self._lock:
                    self._in_flight -= 1
                    if not self._in_flight:
                        self._idle.notify_all()

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            self._failure = self._failure or exc
            pending = [f for _, _, f in self._fifo] + [f for *_, f in self._heap]
            pending += [f for _, f in self._by_id.values()]
            self._fifo.clear()
            self._heap.clear()
            self._by_id.clear()
            self._in_flight = 0
            self._cv.notify_all()
            self._idle.notify_all()
        for f in pending:
            f.set_exception(exc)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job finished; False on timeout."""
        with self._lock:
            self._drainers += 1
            try:
                return self._idle.wait_for(lambda: self._in_flight == 0, timeout)
            finally:
                self._drainers -= 1

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the thread; True when it has exited (so shared memory may be
        unmapped). A thread blocked in a schedule wait must be released by
        cancelling the segment first."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()
            self._idle.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
