"""One host's shared-memory segment for the ranks of a process group.

:class:`ShmGroup` wraps the C++ core (``csrc/giant_shm.cpp``) for tensors:
every method takes contiguous CPU tensors and calls the core with their data
pointers, which releases the GIL while the collective runs.

Segment lifetime: local rank 0 creates ``/dev/shm/giantmodel-<pid>-<id>``,
publishes the name through the process group's store, waits until every
local rank has mapped it, and unlinks it at once. From then on the memory
lives only as long as some rank maps it, so it is freed on exit, clean or
not. A crash inside that short window leaves a file named after a dead pid,
which the next group created on the host removes.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import time
import uuid
from datetime import timedelta

import torch

from giantmodel.comm import _lib

DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2,
               torch.bfloat16: 3, torch.int32: 4, torch.int64: 5}
OP_SUM, OP_AVG, OP_MAX, OP_MIN = range(4)
_SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^giantmodel-(\d+)-[0-9a-f]+$")
# gm_alltoallv's message for a pair that disagrees (csrc/giant_shm.cpp)
_MISMATCH_RE = re.compile(r"local rank (\d+) sends (-?\d+) bytes to local rank (\d+), "
                          r"which expects (-?\d+)")


class CommError(RuntimeError):
    """A shared-memory collective failed: timeout, dead peer, or abort."""


class CommArgError(CommError):
    """A collective refused its arguments on every rank alike before moving
    any data (split sizes that disagree between ranks): the group stays
    usable, unlike after a :class:`CommError`."""


class SplitMismatch(CommArgError):
    """An all-to-all whose split sizes disagree for one pair of ranks:
    ``src`` sends ``sent`` bytes to ``dst``, which expects ``want``. Raised on
    every rank of the collective alike, before any data moves; the backend
    rewrites it in group ranks and the caller's units."""

    def __init__(self, src: int, dst: int, sent: int, want: int, message: str | None = None):
        self.src, self.dst, self.sent, self.want = src, dst, sent, want
        super().__init__(message or f"all_to_all split sizes disagree: rank {src} sends "
                                    f"{sent} bytes to rank {dst}, which expects {want}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments() -> list[str]:
    """Unlink segments whose creating process is gone; returns their names."""
    removed = []
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def list_segments() -> list[str]:
    """Names of giantmodel segments present in /dev/shm (for tests)."""
    try:
        return sorted(n for n in os.listdir(_SHM_DIR) if _NAME_RE.match(n))
    except OSError:
        return []


def offsets(sizes: list[int]) -> list[int]:
    """Start of each block when blocks of ``sizes`` lie back to back."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


class ShmGroup:
    """Shared-memory collectives among ``world`` ranks of one host.

    ``store`` must be a store prefix private to this group (every rank passes
    the same one); ``rank`` is the rank within this host's group.
    """

    def __init__(self, lib: ctypes.CDLL, store, rank: int, world: int, *,
                 chunk_bytes: int = 1 << 20, threads: int = 1,
                 timeout: timedelta = timedelta(minutes=5)):
        if chunk_bytes < 4096 or chunk_bytes % 4096:
            raise ValueError(f"comm chunk size must be a positive multiple of 4096 bytes, "
                             f"got {chunk_bytes}")
        self.lib, self.rank, self.world = lib, rank, world
        self.chunk_bytes, self.threads = chunk_bytes, threads
        self._timeout_s = timeout.total_seconds()
        self._handle: int | None = None
        self._name = ""
        self._open(store)
        # What this build reduces (fp16 needs compiler support): the backend
        # delegates the rest instead of failing.
        self.reducible = {dt for dt, code in DTYPE_CODES.items()
                          if self.lib.gm_supports(code, OP_SUM)}
        if world > (os.cpu_count() or 1):
            self.lib.gm_set_spin(self._handle, 0, 2)  # oversubscribed: sleep, don't spin

    # ---- lifetime -------------------------------------------------------
    def _open(self, store) -> None:
        err = ctypes.create_string_buffer(512)
        if self.rank == 0:
            remove_stale_segments()
            self._name = f"/giantmodel-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            atexit.register(self._unlink)
            h = self.lib.gm_open(self._name.encode(), 0, self.world, self.chunk_bytes, 1,
                                 self.threads, self._timeout_s, err, len(err))
            if not h:
                store.set("shm_name", "")  # the other local ranks stop waiting for it
                raise CommError(f"cannot create shared memory: {err.value.decode()}")
            self._handle = h
            store.set("shm_name", self._name)
            self._wait_opened(store)
            self._unlink()
        else:
            self._name = store.get("shm_name").decode()
            if not self._name:
                raise CommError("local rank 0 could not create the shared-memory segment")
            h = self.lib.gm_open(self._name.encode(), self.rank, self.world, self.chunk_bytes,
                                 0, self.threads, self._timeout_s, err, len(err))
            if not h:
                store.add("shm_failed", 1)
                raise CommError(f"cannot open shared memory {self._name}: {err.value.decode()}")
            self._handle = h
            store.add("shm_opened", 1)

    def _wait_opened(self, store) -> None:
        deadline = time.monotonic() + self._timeout_s
        while store.add("shm_opened", 0) < self.world - 1:
            if store.add("shm_failed", 0) > 0:
                self._unlink()
                raise CommError("a local rank could not map the shared-memory segment")
            if time.monotonic() > deadline:
                self._unlink()
                raise CommError(f"local ranks did not map shared memory within "
                                f"{self._timeout_s:.0f}s")
            time.sleep(0.002)

    def _unlink(self) -> None:
        if self._name and self.rank == 0:
            self.lib.gm_unlink(self._name.encode())
            atexit.unregister(self._unlink)

    def close(self) -> None:
        if self._handle:
            self.lib.gm_close(self._handle)
            self._handle = None

    def cancel(self) -> None:
        """Make this process's waits on the segment fail now (before close)."""
        if self._handle:
            self.lib.gm_cancel(self._handle)

    def abort(self) -> None:
        if self._handle:
            self.lib.gm_abort(self._handle)

    @property
    def name(self) -> str:
        return self._name

    # ---- collectives ----------------------------------------------------
    def _check(self, rc: int, what: str) -> None:
        if rc == _lib.OK:
            return
        if rc == _lib.UNSUPPORTED:
            raise NotImplementedError(f"{what}: dtype/op not handled by the shared-memory core")
        msg = self.lib.gm_error(self._handle).decode() if self._handle else "group closed"
        if rc == _lib.BAD_ARG:
            raise CommArgError(f"{what} refused on local rank {self.rank}: {msg}")
        raise CommError(f"{what} failed on local rank {self.rank}: {msg}")

    def _h(self) -> int:
        if not self._handle:
            raise CommError("shared-memory group is closed")
        return self._handle

    def all_reduce_scaled(self, inp: torch.Tensor, out: torch.Tensor, op: int,
                          scale: float) -> None:
        """``out = op(inp over ranks)``; with OP_AVG the sum is multiplied by
        ``scale`` (1/world for an average, the factor for a pre-scaled sum)."""
        rc = self.lib.gm_allreduce(self._h(), inp.data_ptr(), out.data_ptr(), inp.numel(),
                                   DTYPE_CODES[inp.dtype], op, scale)
        self._check(rc, "all_reduce")

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor, op: int) -> None:
        self.all_reduce_scaled(inp, out, op, 1.0 / self.world)

    def reduce_scatter_scaled(self, inp: torch.Tensor, out: torch.Tensor, op: int,
                              scale: float) -> None:
        """``inp`` holds ``world`` blocks of ``out.numel()`` elements."""
        rc = self.lib.gm_reduce_scatter(self._h(), inp.data_ptr(), out.data_ptr(), out.numel(),
                                        DTYPE_CODES[inp.dtype], op, scale)
        self._check(rc, "reduce_scatter")

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` holds ``world`` blocks, block r being rank r's ``inp``."""
        nbytes = inp.numel() * inp.element_size()
        self._check(self.lib.gm_allgather(self._h(), inp.data_ptr(), out.data_ptr(), nbytes),
                    "all_gather")

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        nbytes = t.numel() * t.element_size()
        self._check(self.lib.gm_broadcast(self._h(), t.data_ptr(), nbytes, root), "broadcast")

    def all_to_all(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        """Equal splits: ``inp`` and ``out`` hold ``world`` blocks each."""
        nbytes = inp.numel() * inp.element_size() // self.world
        self._check(self.lib.gm_alltoall(self._h(), inp.data_ptr(), out.data_ptr(), nbytes),
                    "all_to_all")

    def all_to_all_v(self, inp: torch.Tensor, out: torch.Tensor, send_bytes: list[int],
                     recv_bytes: list[int]) -> None:
        """Uneven splits, in bytes: ``inp`` holds, back to back in local-rank
        order, ``send_bytes[q]`` bytes for each local rank q; ``out`` gets
        ``recv_bytes[q]`` bytes from each q in the same order. Every pair must
        agree (q's ``send_bytes[r]`` is r's ``recv_bytes[q]``); the core checks
        that on every rank at once and raises on all of them if not."""
        w = self.world
        if len(send_bytes) != w or len(recv_bytes) != w:
            raise ValueError(f"all_to_all needs {w} split sizes per side, got "
                             f"{len(send_bytes)} and {len(recv_bytes)}")
        # the core trusts these with raw pointers
        if min(send_bytes) < 0 or min(recv_bytes) < 0:
            raise ValueError(f"all_to_all split sizes must be >= 0, got {send_bytes} and "
                             f"{recv_bytes} bytes")
        if (sum(send_bytes) > inp.numel() * inp.element_size()
                or sum(recv_bytes) > out.numel() * out.element_size()):
            raise ValueError("all_to_all split sizes exceed the tensors they split")
        arrays = (ctypes.c_int64 * (4 * w))(*send_bytes, *offsets(send_bytes),
                                          *recv_bytes, *offsets(recv_bytes))
        base, size = ctypes.addressof(arrays), ctypes.sizeof(ctypes.c_int64) * w
        rc = self.lib.gm_alltoallv(self._h(), inp.data_ptr(), out.data_ptr(), base,
                                   base + size, base + 2 * size, base + 3 * size)
        try:
            self._check(rc, "all_to_all")
        except CommArgError as e:
            m = _MISMATCH_RE.search(str(e))
            if m is None:
                raise
            q, sent, r, want = map(int, m.groups())
            raise SplitMismatch(q, r, sent, want, str(e)) from None

    def barrier(self) -> None:
        self._check(self.lib.gm_barrier(self._h()), "barrier")

    def sched_post(self, k: int, op_id: int) -> None:
        self._check(self.lib.gm_sched_post(self._h(), k, op_id), "schedule post")

    def sched_wait(self, k: int) -> int:
        got = self.lib.gm_sched_wait(self._h(), k)
        if got < 0:
            self._check(int(-got), "schedule wait")
        return int(got)
