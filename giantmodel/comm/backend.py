"""The "giant" torch.distributed backend: a ProcessGroup that torch calls.

``GiantProcessGroup`` is what ``init_process_group("giant")`` and
``new_group(backend="giant")`` return. For CPU tensors on one host it runs the
C++ shared-memory core; across hosts it runs the hierarchical all-reduce,
reduce-scatter and all-gather (:mod:`giantmodel.comm.hierarchical`), and
the all-to-all too when ``comm.hierarchical`` is "on" (flat otherwise).
All-to-all takes even and uneven splits (an MoE dispatch), and checks that
the split sizes agree, wherever the core runs it. Everything else -- other
dtypes and ops, point-to-point, CUDA tensors -- goes to an inner gloo
(CPU) or NCCL (CUDA) backend over the same store, so a result is either
accelerated or exactly the stock one, never an approximation.

The inner gloo backend is also registered as this group's CPU backend, and
the inner NCCL one (gloo without CUDA) as its CUDA backend. Torch reads a
group's name through its registered backends, and FSDP2 and the functional
collectives look groups up by name, so without them they fail with
"ProcessGroup name not set"; ``init_process_group(device_id=...)`` asks for
the CUDA backend by device.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.autograd import profiler as autograd_profiler
from torch.distributed import ReduceOp
from torch.futures import Future
from torch.profiler import record_function

from giantmodel.comm import _lib, record
from giantmodel.comm.cuda_reduce import CpuReduce
from giantmodel.comm.engine import CollectiveEngine
from giantmodel.comm.hierarchical import HierarchicalAllReduce
from giantmodel.comm.settings import GiantOptions, default_chunk_bytes
from giantmodel.comm.shm import (
    DTYPE_CODES,
    OP_AVG,
    OP_MAX,
    OP_MIN,
    OP_SUM,
    CommError,
    ShmGroup,
    SplitMismatch,
)
from giantmodel.comm.topology import Topology

log = logging.getLogger(__name__)

# Keyed by the enum's integer: hashing and comparing pybind enums costs
# microseconds, and a small all-reduce's whole budget is a few of them.
_OPS = {int(ReduceOp.RedOpType.SUM): OP_SUM, int(ReduceOp.RedOpType.AVG): OP_AVG,
        int(ReduceOp.RedOpType.MAX): OP_MAX, int(ReduceOp.RedOpType.MIN): OP_MIN}
_PREMUL_SUM = int(ReduceOp.RedOpType.PREMUL_SUM)


def _op_and_scale(red, world: int) -> tuple[int | None, float]:
    """(core op code, scale) for a ReduceOp, or (None, 0) when not handled."""
    kind = int(getattr(red, "op", red))
    if kind == _PREMUL_SUM:
        factor = getattr(red, "factor", None)
        return (OP_AVG, float(factor)) if isinstance(factor, float) else (None, 0.0)
    code = _OPS.get(kind)
    return code, (1.0 / world if code == OP_AVG else 1.0)


class _DoneWork(dist.Work):
    """The Work of a collective that already ran in the caller. Cheaper to
    make than a Future-backed Work (a third of a small all-reduce's Python
    cost); the Future is made only if someone asks for it."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self):
        return self.value

    def get_future(self) -> Future:
        fut: Future = Future()
        fut.set_result(self.value)
        return fut


def _done(value) -> dist.Work:
    work = _DoneWork()
    work.value = value
    return work


class _FutureWork(dist.Work):
    """The Work of a collective that runs on the engine thread.

    torch's ``_create_work_from_future`` gives a Work whose ``wait()``
    returns True even when the future holds an exception, so a collective
    that timed out or lost a peer would look done and its caller would read
    partial data. This one re-raises the collective's error in ``wait()``."""

    def __init__(self, fut: Future):
        super().__init__()
        self._fut = fut

    def wait(self, timeout=None) -> bool:
        self._fut.wait()  # raises the collective's exception, if any
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self) -> Future:
        return self._fut


class GiantProcessGroup(dist.ProcessGroup):
    """Shared-memory collectives with gloo/NCCL underneath."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta,
                 global_ranks: list[int] | None = None,
                 settings: GiantOptions | None = None, group_name: str = "?"):
        super().__init__(rank, size)
        self._rank, self._world = rank, size  # read per call; pybind getters cost
        self._settings = settings or GiantOptions()
        self._group_name, self._seq = group_name, 0
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM,
                               self._gloo)
        self._nccl = self._make_nccl(store, rank, size, timeout)
        self._register_cuda_backend()
        self._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        self.topology = Topology.discover(store, rank, size, global_ranks, self._settings)
        self._shm: ShmGroup | None = None
        self._hier: HierarchicalAllReduce | None = None
        self._coalescing: list[dist.Work] | None = None
        self._cpu_reduce = None
        self._store, self._timeout, self._generation = store, timeout, 0
        self._use_hier = self.topology.hierarchical
        usable = self._settings.accelerate and (self.topology.num_nodes == 1
                                                 or self.topology.hierarchical)
        if _all_agree(store, rank, size, "accelerate", usable and _lib.load() is not None):
            self._shm = self._first_shm(store, rank, size)
            if self._shm is not None and self.topology.hierarchical:
                self._hier = HierarchicalAllReduce(self._shm, store, self.topology, timeout)
        # All-to-all moves the same bytes over the network either way, and the
        # hierarchical form adds passes over memory: across 2 emulated hosts
        # it ran at 0.57-0.68x flat gloo's speed with 2 ranks per host and
        # 0.84-0.99x with 1 (benchmarks/results/alltoall-hier-2026-11-28.md),
        # so it runs only when asked for ("on"); "auto" leaves it flat.
        self._hier_all_to_all = self._hier is not None and self._settings.hierarchical == "on"
        topo = self.topology
        use_sched = self._settings.priority and self._shm is not None and topo.num_nodes == 1
        self._engine = CollectiveEngine(f"giant{size}", sched=self._shm if use_sched else None,
                              leader=rank == 0)

    @staticmethod
    def _make_nccl(store, rank: int, size: int, timeout: timedelta):
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            return None
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts)
        return pg

    def _register_cuda_backend(self) -> None:
        """Answer torch's look-ups of this group's CUDA backend.

        ``init_process_group(device_id=cuda:N)`` (the trainer binds each rank
        to its GPU) asks the group for ``_get_backend(cuda)`` to connect it
        eagerly, and ``_set_pg_timeout``, abort and shutdown look it up too;
        with only a CPU backend registered the first fails before any
        collective runs. The inner NCCL backend is the true answer (its own
        type, so torch's NCCL-specific paths recognise it); without NCCL the
        gloo backend answers, and this group's own collectives still refuse
        CUDA tensors with a clear message (:meth:`_inner`)."""
        if self._nccl is not None:
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL,
                                   self._nccl)
        else:  # the same backend type as cpu: torch reuses the gloo object
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.CUSTOM,
                                   self._gloo)

    def _first_shm(self, store, rank: int, size: int) -> ShmGroup | None:
        """The group's shared-memory segment, or None on every rank when any
        rank could not map one (a small /dev/shm in a container, say): then
        the group runs on gloo, as without the C++ core, instead of failing."""
        chunk = self._settings.chunk_bytes or default_chunk_bytes(
            self.topology.local_size, os.cpu_count() or 1)
        try:
            shm = self._make_shm(chunk)
        except CommError as e:
            log.warning("giant backend: %s; this group runs its collectives on gloo", e)
            shm = None
        if _all_agree(store, rank, size, "shm_mapped", shm is not None):
            return shm
        if shm is not None:
            shm.close()
        return None

    def _make_shm(self, chunk_bytes: int) -> ShmGroup:
        topo = self.topology
        threads = self._settings.threads or max(1, (os.cpu_count() or 1) // topo.local_size)
        prefix = f"shm/{self._generation}/{topo.node_index}/"
        self._generation += 1
        return ShmGroup(_lib.load(), dist.PrefixStore(prefix, self._store), topo.local_rank,
                        topo.local_size, chunk_bytes=chunk_bytes, threads=threads,
                        timeout=self._timeout)

    def reconfigure(self, chunk_bytes: int | None = None,
                    hierarchical: bool | None = None) -> None:
        """Switch chunk size and/or cross-node algorithm. Collective: every
        rank of the group calls it with the same values, with no collective
        in flight. Used by the autotuner."""
        if self._shm is None:
            return
        self._engine.drain()
        if chunk_bytes is not None and chunk_bytes != self._shm.chunk_bytes:
            if self._engine.priority_mode:
                raise RuntimeError("reconfigure is not supported in priority mode")
            old, self._shm = self._shm, self._make_shm(chunk_bytes)
            old.close()
            if self._hier is not None:
                self._hier.shm = self._shm
        if hierarchical is not None and self._hier is not None:
            self._use_hier = hierarchical

    @property
    def chunk_bytes(self) -> int:
        return self._shm.chunk_bytes if self._shm is not None else 0

    # ---- plumbing -------------------------------------------------------
    def name(self) -> str:
        return "giant"

    def _get_backend_name(self) -> str:
        return "giant"

    @property
    def accelerated(self) -> bool:
        """True when CPU collectives run on the shared-memory core."""
        return self._shm is not None

    def _fast(self, tensors, op_code: int | None = OP_SUM, flat_only: bool = True,
              reduces: bool = True) -> bool:
        """Whether the shared-memory core runs this collective; else it is
        delegated. Copies take any dtype the core knows; reductions only the
        ones this build can add (fp16 needs compiler support)."""
        if self._shm is None or op_code is None:
            return False
        if flat_only and self.topology.num_nodes > 1:
            return False
        dtypes = self._shm.reducible if reduces else DTYPE_CODES
        for t in tensors:
            if not t.is_cpu or t.dtype not in dtypes or t.is_sparse:
                return False
            if op_code == OP_AVG and not t.is_floating_point():
                return False
        return True

    def _inner(self, tensors) -> dist.ProcessGroup:
        if tensors and tensors[0].device.type == "cuda":
            if self._nccl is None:
                raise RuntimeError("CUDA tensor given to a giant group created without NCCL")
            return self._nccl
        return self._gloo

    def _launch(self, op: str, tensors, job: Callable[[], object], opts=None,
                priority: int = 0) -> dist.Work:
        self._seq += 1
        record.note(self._group_name, self._seq, op, tensors)
        if not getattr(opts, "asyncOp", True) and self._coalescing is None:
            # inline: the profiler's state cannot change before it runs
            result = self._engine.run_inline(
                _profiled(job) if autograd_profiler._is_profiler_enabled else job)
            if result is not NotImplemented:
                return _done(result)
        work = _FutureWork(self._engine.submit(_profiled(job), priority))
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    def _delegated(self, work: dist.Work) -> dist.Work:
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    # ---- all-reduce family ---------------------------------------------
    def _allreduce_one(self, t: torch.Tensor, op: int, scale: float) -> None:
        if t.numel() == 0:
            return
        flat = t if t.is_contiguous() else t.contiguous()
        if self._hier is not None and self._use_hier:
            self._hier.all_reduce(flat.view(-1), op, scale)
        else:
            self._shm.all_reduce_scaled(flat, flat, op, scale)
        if flat is not t:
            t.copy_(flat)

    def allreduce(self, tensors, opts=None, priority: int = 0):
        opts = opts if isinstance(opts, dist.AllreduceOptions) else _ar_opts(opts)
        op, scale = _op_and_scale(opts.reduceOp, self._world)
        if self._cpu_reduce_ok(tensors, op):
            return self._cuda_allreduce(tensors, opts, op, scale)
        if not self._fast(tensors, op, flat_only=not self._use_hier):
            return self._delegated(self._inner(tensors).allreduce(tensors, opts))

        def job():
            for t in tensors:
                self._allreduce_one(t, op, scale)
            return tensors
        return self._launch("all_reduce", tensors, job, opts, priority)

    def all_reduce_now(self, t: torch.Tensor, red=ReduceOp.SUM) -> bool:
        """All-reduce one CPU tensor in place on the shared-memory core, in
        the caller, without torch.distributed's per-call path; False (and
        nothing done) when the core does not take it, so the caller uses
        ``dist.all_reduce``. Ordered with the group's other collectives:
        with asynchronous ones still queued it queues behind them and waits.
        """
        op, scale = _op_and_scale(red, self._world)
        if self._coalescing is not None or not self._fast((t,), op, flat_only=not self._use_hier):
            return False
        self._seq += 1
        record.note(self._group_name, self._seq, "all_reduce", (t,))

        def job():
            self._allreduce_one(t, op, scale)
        if autograd_profiler._is_profiler_enabled:
            job = _profiled(job)
        if self._engine.run_inline(job) is NotImplemented:
            self._engine.submit(job).wait()
        return True

    def _cpu_reduce_ok(self, tensors, op) -> bool:
        return (self._settings.cuda_cpu_reduce and self._shm is not None and op is not None
                and self.topology.num_nodes == 1 and bool(tensors)
                and all(t.device.type == "cuda" and t.dtype in self._shm.reducible
                        and t.is_contiguous() for t in tensors))

    def _cuda_allreduce(self, tensors, opts, op: int, scale: float) -> dist.Work:
        """CPU-Reduce for CUDA tensors (see cuda_reduce.py); ordered with the
        group's other shared-memory collectives by the same engine."""

        if self._cpu_reduce is None or self._cpu_reduce.shm is not self._shm:
            self._cpu_reduce = CpuReduce(self._shm)
        streams = [torch.cuda.current_stream(t.device) for t in tensors]
        kind = getattr(opts.reduceOp, "op", opts.reduceOp)
        premul = scale if kind == ReduceOp.RedOpType.PREMUL_SUM else None

        def job():
            for t, s in zip(tensors, streams):
                if premul is not None:
                    self._cpu_reduce.all_reduce(t, OP_SUM, 1.0, s, premul=premul)
                else:
                    self._cpu_reduce.all_reduce(t, op, scale, s)
            return tensors
        return self._launch("all_reduce", tensors, job, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        ar = dist.AllreduceOptions()
        ar.reduceOp = opts.reduceOp if opts is not None else ReduceOp.SUM
        ar.asyncOp = getattr(opts, "asyncOp", True)
        return self.allreduce(list(tensors), ar)

    def reduce(self, tensors, opts=None):
        op, scale = _op_and_scale(opts.reduceOp, self._world)
        if not self._fast(tensors, op, flat_only=self._hier is None) or len(tensors) != 1:
            return self._delegated(self._inner(tensors).reduce(tensors, opts))
        t, root = tensors[0], opts.rootRank

        def job():
            src = t.contiguous()
            out = src if self._rank == root else torch.empty_like(src)
            if src.numel() and self.topology.num_nodes > 1:
                self._hier.reduce(src.view(-1), root, op, scale)
            elif src.numel():
                self._shm.all_reduce_scaled(src, out, op, scale)
            if self._rank == root and src is not t:
                t.copy_(src)
            return tensors
        return self._launch("reduce", tensors, job, opts)

    # ---- reduce-scatter / all-gather -----------------------------------
    def reduce_scatter_single(self, output, input, opts=None):
        op, scale = _op_and_scale(opts.reduceOp, self._world)
        # Across nodes always hierarchical: gloo's reduce-scatter is an
        # all-reduce underneath, and the tuner's flat-or-hierarchical choice
        # (_use_hier) is measured on all-reduce alone.
        ok = (self._fast([input, output], op, flat_only=self._hier is None)
              and input.dtype == output.dtype and input.numel() == output.numel() * self._world)
        if not ok:
            return self._delegated(self._inner([input])._reduce_scatter_base(output, input, opts))

        def job():
            inp = input.contiguous()
            out = output if output.is_contiguous() else torch.empty_like(output)
            if out.numel() and self.topology.num_nodes > 1:
                self._hier.reduce_scatter(inp, out, op, scale)
            elif out.numel():
                self._shm.reduce_scatter_scaled(inp, out, op, scale)
            if out is not output:
                output.copy_(out)
            return [output]
        return self._launch("reduce_scatter", [input], job, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _chain(works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        op, _ = _op_and_scale(opts.reduceOp, self._world)
        if len(output_tensors) != 1 or not self._fast(output_tensors + list(input_lists[0]), op):
            return self._delegated(self._inner(output_tensors).reduce_scatter(
                output_tensors, input_lists, opts))
        flat = torch.cat([t.reshape(-1) for t in input_lists[0]])
        return self.reduce_scatter_single(output_tensors[0], flat, opts)

    def all_gather_single(self, output, input, opts=None):
        ok = (self._fast([input, output], reduces=False, flat_only=self._hier is None)
              and input.dtype == output.dtype and output.numel() == input.numel() * self._world)
        if not ok:
            return self._delegated(self._inner([input])._allgather_base(output, input, opts))

        def job():
            inp = input.contiguous()
            out = output if output.is_contiguous() else torch.empty_like(output)
            if inp.numel() and self.topology.num_nodes > 1:
                self._hier.all_gather(inp, out)
            elif inp.numel():
                self._shm.all_gather(inp, out)
            if out is not output:
                output.copy_(out)
            return [output]
        return self._launch("all_gather", [input], job, opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _chain(works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, input_list, opts=None):
        if len(input_list) != 1 or not self._fast(list(input_list) + list(output_lists[0]), reduces=False):
            return self._delegated(self._inner(input_list).allgather(output_lists, input_list,
                                                                     opts))
        inp, outs = input_list[0], output_lists[0]

        def job():
            flat = torch.empty(self._world * inp.numel(), dtype=inp.dtype)
            if inp.numel():
                self._shm.all_gather(inp.contiguous(), flat)
            for r, o in enumerate(outs):
                o.copy_(flat[r * inp.numel():(r + 1) * inp.numel()].view_as(o))
            return outs
        return self._launch("all_gather", input_list, job, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self._delegated(self._inner(input_list).allgather_coalesced(
            output_lists, input_list, opts))

    # ---- broadcast / all-to-all / barrier ------------------------------
    def broadcast(self, tensors, opts=None):
        if (not self._fast(tensors, reduces=False, flat_only=self._hier is None)
                or len(tensors) != 1):
            return self._delegated(self._inner(tensors).broadcast(tensors, opts))
        t, root = tensors[0], opts.rootRank

        def job():
            buf = t if t.is_contiguous() else t.contiguous()
            if buf.numel() and self.topology.num_nodes > 1:
                self._hier.broadcast(buf.view(-1), root)
            elif buf.numel():
                self._shm.broadcast(buf, root)
            if buf is not t:
                t.copy_(buf)
            return tensors
        return self._launch("broadcast", tensors, job, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        # Even and uneven splits take one path, so ranks that pass equal
        # splits and ranks that pass none still run the same kernel.
        ok = (self._fast([input, output], reduces=False, flat_only=not self._hier_all_to_all)
              and input.dtype == output.dtype and input.dim() > 0 and output.dim() > 0)
        if not ok:
            return self._delegated(self._inner([input]).alltoall_base(
                output, input, output_split_sizes, input_split_sizes, opts))
        send = _split_bytes(input, input_split_sizes, self._world, "input")
        recv = _split_bytes(output, output_split_sizes, self._world, "output")

        def job():
            inp = input.contiguous()
            out = output if output.is_contiguous() else torch.empty(
                output.shape, dtype=output.dtype)
            self._all_to_all_bytes(inp, out, send, recv, _row_bytes(input), _SINGLE)
            if out is not output:
                output.copy_(out)
            return [output]
        return self._launch("all_to_all", [input], job, opts)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        tensors = [*input_tensors, *output_tensors]
        ok = (len(input_tensors) == len(output_tensors) == self._world
              and self._fast(tensors, reduces=False, flat_only=not self._hier_all_to_all)
              and len({t.dtype for t in tensors}) == 1)
        if not ok:
            return self._delegated(self._inner(input_tensors).alltoall(
                output_tensors, input_tensors, opts))
        size = input_tensors[0].element_size()
        send = [t.numel() * size for t in input_tensors]
        recv = [t.numel() * size for t in output_tensors]

        def job():
            inp = torch.cat([t.reshape(-1) for t in input_tensors])
            out = torch.empty(sum(t.numel() for t in output_tensors), dtype=inp.dtype)
            self._all_to_all_bytes(inp, out, send, recv, size, _LIST)
            for o, got in zip(output_tensors, out.split([t.numel() for t in output_tensors])):
                o.copy_(got.view(o.shape))
            return list(output_tensors)
        return self._launch("all_to_all", list(input_tensors), job, opts)

    def _all_to_all_bytes(self, inp: torch.Tensor, out: torch.Tensor, send: list[int],
                          recv: list[int], unit: int, form: tuple[str, str, str]) -> None:
        """``send``/``recv``: bytes per group rank, blocks back to back in
        rank order in the contiguous ``inp``/``out``. ``unit`` and ``form``
        say how the caller counted them, for the error on a mismatch."""
        try:
            if self.topology.num_nodes > 1:
                self._hier.all_to_all(inp.view(-1).view(torch.uint8),
                                      out.view(-1).view(torch.uint8), send, recv)
            else:
                self._shm.all_to_all_v(inp, out, send, recv)
        except SplitMismatch as e:
            src, dst = e.src, e.dst
            if self.topology.num_nodes == 1:  # the core names local ranks
                src, dst = self.topology.nodes[0][src], self.topology.nodes[0][dst]
            raise SplitMismatch(src, dst, e.sent, e.want,
                                _mismatch_message(src, dst, e.sent, e.want, unit, form)) from None

    def barrier(self, opts=None):
        if self._shm is None or self.topology.num_nodes > 1:
            return self._delegated(self._gloo.barrier(opts or dist.BarrierOptions()))

        def job():
            self._shm.barrier()
            return []
        return self._launch("barrier", [], job, opts)

    # ---- delegated as-is -----------------------------------------------
    def send(self, tensors, dst, tag=0):
        return self._delegated(self._inner(tensors).send(tensors, dst, tag))

    def recv(self, tensors, src, tag=0):
        return self._delegated(self._inner(tensors).recv(tensors, src, tag))

    def recv_anysource(self, tensors, tag=0):
        return self._delegated(self._inner(tensors).recv_anysource(tensors, tag))

    def gather(self, output_lists, input_list, opts=None):
        return self._delegated(self._inner(input_list).gather(output_lists, input_list, opts))

    def scatter(self, output_list, input_lists, opts=None):
        return self._delegated(self._inner(output_list).scatter(output_list, input_lists, opts))

    # ---- coalescing and lifetime ---------------------------------------
    def _start_coalescing(self, device):
        self._coalescing = []

    def _end_coalescing(self, device):
        works, self._coalescing = self._coalescing or [], None
        return _chain(works, [])

    def wait_pending(self, timeout: float | None = None) -> bool:
        """Block until every queued collective finished (True) or timeout."""
        return self._engine.drain(timeout)

    def shutdown(self) -> None:
        self._engine.drain(timeout=5)
        if self._shm is not None:
            self._shm.cancel()  # releases an engine thread blocked on the segment
        stopped = self._engine.close()
        if self._shm is not None and stopped:
            self._shm.close()  # unmapping under a live thread would crash it
        self._shm = None

    def abort(self) -> None:
        if self._shm is not None:
            self._shm.abort()
            self._shm.cancel()
        self._engine.close(timeout=1)


def all_reduce_inline(t: torch.Tensor, group=None, op=ReduceOp.SUM) -> torch.Tensor:
    """``t`` summed (or averaged, maxed, minned) in place over ``group``, blocking.

    On a giant group whose shared-memory core takes the tensor, the core is
    called directly, as DeepSpeed's ``inference_all_reduce`` calls its
    shared-memory op: about 2 µs of Python per call instead of the 8-9 µs of
    ``dist.all_reduce``, which is most of a small message's time. Any other
    group, tensor or op goes through ``dist.all_reduce`` unchanged.
    """
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if isinstance(pg, GiantProcessGroup) and pg.all_reduce_now(t, op):
        return t
    flat = t if t.is_contiguous() else t.contiguous()   # gloo reduces contiguous tensors only
    dist.all_reduce(flat, op=op, group=group)
    if flat is not t:
        t.copy_(flat)
    return t


def _profiled(job: Callable[[], object]) -> Callable[[], object]:
    """``job`` named for torch.profiler on whichever thread runs it, so a
    trace shows the collective and the time a caller spends waiting for it.
    Costs one flag check when no profiler runs (small messages are
    latency-bound)."""
    def run():
        # The module flag torch.profiler sets for every thread (the C++
        # query answers False under the Kineto profiler).
        if not autograd_profiler._is_profiler_enabled:
            return job()
        with record_function("giant:collective"):
            return job()
    return run


def _all_agree(store, rank: int, size: int, name: str, mine: bool) -> bool:
    """True when every rank of the group says True. A rank without the C++
    core (not built on its host) must not leave the others waiting on a
    shared-memory segment: then the whole group delegates to gloo."""
    store.set(f"{name}/{rank}", "1" if mine else "0")
    return all(store.get(f"{name}/{r}") == b"1" for r in range(size))


def _split_bytes(t: torch.Tensor, splits, world: int, side: str) -> list[int]:
    """Bytes of ``t`` for each rank of an all-to-all: ``splits[r]`` rows (dim
    0) for rank r, or equal shares without splits. Checked on the calling
    rank as gloo checks them, before any peer is waited for."""
    rows = t.size(0)
    row_bytes = _row_bytes(t)
    if not splits:
        if rows % world:
            raise ValueError(f"all_to_all: the {side} tensor's {rows} rows (dim 0) do not "
                             f"divide equally over {world} ranks; pass split sizes")
        return [rows // world * row_bytes] * world
    splits = [int(n) for n in splits]
    if len(splits) != world or min(splits) < 0 or sum(splits) != rows:
        raise ValueError(f"all_to_all: {side} split sizes {splits} must be {world} numbers "
                         f">= 0 summing to the tensor's {rows} rows (dim 0)")
    return [n * row_bytes for n in splits]


# How each all-to-all form names a pair's split sizes: (what rank a sends b,
# what rank b expects from a, unit) -- the error shows the caller's own names.
_SINGLE = ("input_split_sizes[{b}]", "output_split_sizes[{a}]", "row")
_LIST = ("input_tensors[{b}].numel()", "output_tensors[{a}].numel()", "element")


def _row_bytes(t: torch.Tensor) -> int:
    return t.element_size() * math.prod(t.shape[1:])


def _mismatch_message(a: int, b: int, sent: int, want: int, unit: int,
                      form: tuple[str, str, str]) -> str:
    """One line: the pair, both sizes in the caller's units (bytes when
    they do not divide: the peer's rows or dtype differ), and the rule."""
    send_name, recv_name, noun = form

    def count(nbytes: int) -> str:
        if unit > 0 and nbytes % unit == 0:
            k = nbytes // unit
            return f"{k} {noun}{'' if k == 1 else 's'}"
        return f"{nbytes} bytes"

    sent_as = send_name.format(a=a, b=b)
    want_as = recv_name.format(a=a, b=b)
    rule_send = send_name.format(a="a", b="b")
    rule_recv = recv_name.format(a="a", b="b")
    return (f"all_to_all split sizes disagree: rank {a} sends rank {b} {count(sent)} "
            f"({sent_as} on rank {a}) but rank {b} expects {count(want)} from rank {a} "
            f"({want_as} on rank {b}); the split sizes must agree pairwise, rank a's "
            f"{rule_send} == rank b's {rule_recv} for every pair of group ranks a, b "
            f"(exchange the counts first, e.g. with an all_to_all_single of the split sizes)")


def _ar_opts(op) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    if op is not None:
        opts.reduceOp = op
    return opts


def _chain(works: list[dist.Work], value) -> dist.Work:
    """One Work that completes when all of ``works`` have."""
    if not works:
        return _done(value)
    futs = [w.get_future() for w in works]
    combined = torch.futures.collect_all(futs).then(lambda f: [_raise_first(f.value()), value][1])
    return _FutureWork(combined)


def _raise_first(futs) -> None:
    for f in futs:
        f.value()  # re-raises a failed member's exception


def create_giant_backend(dist_opts, backend_opts=None) -> GiantProcessGroup:
    """Creator registered with ``torch.distributed.Backend.register_backend``.

    ``backend_opts`` is the ``pg_options`` given to ``init_process_group`` or
    ``new_group``; without one, a sub-group takes the default group's."""
    settings = backend_opts if isinstance(backend_opts, GiantOptions) else _inherited_options()
    return GiantProcessGroup(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                             dist_opts.timeout, list(dist_opts.global_ranks_in_group or []),
                             settings, group_name=str(dist_opts.group_id))


def _inherited_options() -> GiantOptions:
    if dist.is_initialized():
        default = dist.distributed_c10d._get_default_group()
        if isinstance(default, GiantProcessGroup):
            return default._settings
    return GiantOptions()
