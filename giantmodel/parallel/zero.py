"""Own data parallelism: ZeRO stages 0, 1 and 2 on a flat gradient buffer.

* zero 0: parameters and optimizer replicated. Gradients are views into one
  flat buffer per dtype (autograd accumulates into them in place); on the
  last micro-batch each bucket is all-reduced in place as soon as backward
  has filled it. Wire bytes per step: 2(n-1)/n x the gradient bytes (ring).
* zero 1: as zero 0, but each bucket is reduce-scattered in place: rank r
  keeps the summed gradients of the parameters it owns
  (:mod:`giantmodel.parallel.flat_buffer`), AdamW keeps state only for
  those, and after the update one all-gather per bucket hands every rank the
  new parameters -- which are views into a flat parameter buffer, so the
  gather writes them in place. Wire bytes: (n-1)/n each way, 2(n-1)/n in
  all, against 3(n-1)/n for all-reduce plus broadcast.
* zero 2: gradients are not kept whole. Every micro-batch's backward copies
  each finished gradient into its bucket's scratch buffer and frees it; a
  full bucket is reduce-scattered and its owner's chunk added to a
  persistent shard, then the scratch is reused by a later bucket of the
  same backward. Only 1/n of the gradients and the buckets in flight live
  between micro-batches.

Buckets are launched strictly in index order on every rank (a ready bucket
waits for its predecessors), which keeps the collective sequence identical
across ranks whatever the autograd engine's scheduling. With ``overlap``
off (pipeline schedules run backward themselves), all buckets are reduced
after the schedule instead.

A DTensor parameter (tensor parallelism) takes part through its local
storage: its buffer view is wrapped back into a DTensor with the
parameter's placements. Frozen parameters take no part at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from giantmodel.config.train import OptimConfig
from giantmodel.core.optim import build_adamw
from giantmodel.core.tensors import local_tensor, unique_params
from giantmodel.parallel.collectives import all_gather_in_place, all_reduce_sum_, reduce_scatter_in_place
from giantmodel.parallel.flat_buffer import Bucket, FlatLayout, Slot
from giantmodel.parallel.grads import replication

# Zero 2 keeps at most this many idle scratch buffers (one bucket each)
# inside one backward: enough for the buckets that overlap there.
_SPARE_SCRATCH = 4


def _as_param_view(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a buffer view) in the form ``param`` takes: a DTensor with
    the parameter's mesh and placements, or the plain view."""
    if not hasattr(param, "placements"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


class _Flat:
    """One dtype's layout with its gradient, parameter and shard buffers."""

    def __init__(self, params: list[torch.Tensor], owners: int, rank: int, bucket_numel: int,
                 zero: int):
        self.layout = FlatLayout(params, owners=owners, bucket_numel=bucket_numel)
        self.rank = rank
        ref = local_tensor(params[0])
        self.dtype, self.device = ref.dtype, ref.device
        n = self.layout.numel
        self.grads = torch.zeros(n, dtype=self.dtype, device=self.device) if zero < 2 else None
        self.params: torch.Tensor | None = None
        # zero 2: the owner's chunks of every bucket, back to back.
        self.shard_offset: list[int] = []
        self.shard: torch.Tensor | None = None
        if zero == 2:
            offset = 0
            for b in self.layout.buckets:
                self.shard_offset.append(offset)
                offset += b.chunk
            self.shard = torch.zeros(offset, dtype=self.dtype, device=self.device)
        # zero 2: each bucket's scratch while it fills and reduces (a view of
        # a buffer of the largest bucket's size), and idle buffers to reuse.
        self.scratch: dict[int, torch.Tensor] = {}
        self.scratch_base: dict[int, torch.Tensor] = {}
        self.spare: list[torch.Tensor] = []
        self.scratch_numel = max((b.size for b in self.layout.buckets), default=0)

    def own(self, slot: Slot) -> bool:
        return slot.owner == self.rank

    def shard_view(self, slot: Slot) -> torch.Tensor:
        bucket = self.layout.buckets[slot.bucket]
        start = self.shard_offset[slot.bucket] + slot.offset - bucket.chunk_start(self.rank)
        return self.shard[start:start + slot.numel].view(local_tensor(slot.param).shape)


class OwnZero:
    """ZeRO 0/1/2 over the ``dp_cp`` group on flat buffers (module docstring)."""

    def __init__(self, dims, *, zero: int, group, bucket_bytes: int, overlap: bool = True,
                 select=None):
        """``select(param) -> bool``: the parameters this instance reduces
        (None: every trainable one); expert parallelism runs one instance
        for the experts over edp and one for the rest over dp x cp."""
        if zero not in (0, 1, 2):
            raise ValueError(f"OwnZero runs zero 0, 1 or 2, not {zero}")
        self.dims = dims
        self.zero = zero
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self.select = select
        self.flats: list[_Flat] = []
        self._params: list[torch.Tensor] = []
        self._armed = False
        self._pending: list[list[int]] = []
        self._next: list[int] = []
        self._inflight: list[tuple[object, _Flat, Bucket]] = []
        self.launched_in_backward = 0  # buckets the last step sent before backward ended

    # ------------------------------------------------------------- set-up
    def wrap(self, module, blocks, edge_units) -> None:
        return None

    def attach(self, parts: list[nn.Module]) -> None:
        self._params = [p for p in unique_params(parts)
                        if p.requires_grad and (self.select is None or self.select(p))]
        owners = self.world if self.zero >= 1 else 1
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self._params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, params in by_dtype.items():
            numel = max(1, self.bucket_bytes // torch.finfo(dtype).bits * 8)
            flat = _Flat(params, owners, self.rank if owners > 1 else 0, numel, self.zero)
            if self.zero >= 1:
                self._params_to_buffer(flat)
            self.flats.append(flat)
        self._point_grads()
        for flat_index, flat in enumerate(self.flats):
            for slot in flat.layout.slots:
                slot.param.register_post_accumulate_grad_hook(self._hook(flat_index, slot))
        self._reset_counts()

    @torch.no_grad()
    def _params_to_buffer(self, flat: _Flat) -> None:
        """Move parameter storage into one buffer laid out like the
        gradients, so the all-gather after the step writes in place."""
        flat.params = torch.zeros(flat.layout.numel, dtype=flat.dtype, device=flat.device)
        for slot in flat.layout.slots:
            view = flat.layout.view(flat.params, slot)
            storage = local_tensor(slot.param)
            view.copy_(storage)
            # DTensor parameters keep their storage in ``_local_tensor``.
            target = slot.param._local_tensor if hasattr(slot.param, "_local_tensor") else slot.param
            target.data = view

    def _point_grads(self) -> None:
        """Every gradient a view of its buffer (zero 0/1); zero 2 keeps none."""
        for flat in self.flats:
            for slot in flat.layout.slots:
                if flat.grads is None:
                    slot.param.grad = None
                else:
                    slot.param.grad = _as_param_view(slot.param, flat.layout.view(flat.grads, slot))

    # ----------------------------------------------------------- backward
    def before_backward(self, last_microbatch: bool) -> None:
        if self.zero == 2:
            # The previous micro-batch's buckets must land in the shard
            # before their scratch buffers are filled again.
            self._drain()
        # zero 2 reduces every micro-batch; zero 0/1 accumulate locally until the last.
        self._armed = self.overlap and (self.zero == 2 or last_microbatch)
        self._reset_counts()

    def _reset_counts(self) -> None:
        self._pending = [[len(b.slots) for b in f.layout.buckets] for f in self.flats]
        self._next = [0] * len(self.flats)

    def _hook(self, flat_index: int, slot: Slot):
        flat = self.flats[flat_index]

        def on_grad(param: torch.Tensor) -> None:
            self._take_grad(flat, slot)
            if not self._armed:
                return
            self._pending[flat_index][slot.bucket] -= 1
            buckets = flat.layout.buckets
            while (self._next[flat_index] < len(buckets)
                   and self._pending[flat_index][self._next[flat_index]] == 0):
                self._launch(flat, buckets[self._next[flat_index]])
                self._next[flat_index] += 1
        return on_grad

    @torch.no_grad()
    def _take_grad(self, flat: _Flat, slot: Slot) -> None:
        """Make sure the gradient sits in the buffer. Autograd adds into the
        view in place; a gradient it produced elsewhere (a DTensor that came
        back with other placements, or any gradient under zero 2) is moved in."""
        p = slot.param
        g = p.grad
        if flat.grads is not None:
            view = flat.layout.view(flat.grads, slot)
            if g is None or local_tensor(g).data_ptr() == view.data_ptr():
                return
            if hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
                g = g.redistribute(p.device_mesh, p.placements)
            view.copy_(local_tensor(g))
            p.grad = _as_param_view(p, view)
            return
        if g is None:
            return
        if hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
            g = g.redistribute(p.device_mesh, p.placements)
        bucket = flat.layout.buckets[slot.bucket]
        flat.layout.view(self._scratch(flat, bucket), slot, base=bucket.start).copy_(local_tensor(g))
        p.grad = None

    def _scratch(self, flat: _Flat, bucket: Bucket) -> torch.Tensor:
        """The bucket's zeroed scratch. Buffers of buckets whose reduce has
        finished are reused while backward still runs, so a backward maps
        about as many buffers as it has buckets in flight, not one per
        bucket (fresh pages fault on first touch, and on CPU that cost
        shows in the step)."""
        buf = flat.scratch.get(bucket.index)
        if buf is None:
            self._settle_finished()
            base = flat.spare.pop() if flat.spare else torch.empty(
                flat.scratch_numel, dtype=flat.dtype, device=flat.device)
            buf = base[:bucket.size].zero_()
            flat.scratch[bucket.index], flat.scratch_base[bucket.index] = buf, base
        return buf

    def _launch(self, flat: _Flat, bucket: Bucket) -> None:
        if self.zero == 2:
            buf = self._scratch(flat, bucket)
            work = reduce_scatter_in_place(buf, self.group, async_op=True)
        else:
            buf = flat.layout.bucket_view(flat.grads, bucket)
            reduce = all_reduce_sum_ if self.zero == 0 else reduce_scatter_in_place
            work = reduce(buf, self.group, async_op=True)
        self._inflight.append((work, flat, bucket))

    @torch.no_grad()
    def finish(self) -> None:
        """After the last micro-batch: launch what backward left (everything
        without overlap; buckets of unused parameters), wait, and leave each
        rank the gradients it owns."""
        self.launched_in_backward = sum(self._next) if self._armed else 0
        for i, flat in enumerate(self.flats):
            for bucket in flat.layout.buckets[self._next[i]:]:
                self._launch(flat, bucket)
            self._next[i] = len(flat.layout.buckets)
        self._drain()
        self._armed = False
        self._reset_counts()  # a runner without before_backward (pipelines) starts afresh
        if self.zero >= 1:
            self._keep_owned_grads()

    @torch.no_grad()
    def _drain(self) -> None:
        """Wait for every launched bucket and settle it."""
        for work, flat, bucket in self._inflight:
            self._settle(work, flat, bucket)
        self._inflight = []
        for flat in self.flats:
            # Between micro-batches and steps an idle buffer would only add
            # to the next forward's (or the optimizer step's) peak.
            flat.spare.clear()

    def _settle_finished(self) -> None:
        """Settle the launched buckets whose collective has finished, oldest
        first (settling in launch order keeps every rank's shard the same)."""
        while self._inflight and (self._inflight[0][0] is None
                                  or self._inflight[0][0].is_completed()):
            self._settle(*self._inflight.pop(0))

    @torch.no_grad()
    def _settle(self, work, flat: _Flat, bucket: Bucket) -> None:
        """Wait for one bucket; zero 2 adds its owner chunk to the shard and
        keeps the scratch buffer for reuse."""
        if work is not None:
            work.wait()
        if self.zero != 2:
            return
        chunk = flat.layout.chunk_view(flat.scratch.pop(bucket.index), bucket, self.rank,
                                       base=bucket.start)
        start = flat.shard_offset[bucket.index]
        flat.shard[start:start + bucket.chunk].add_(chunk)
        base = flat.scratch_base.pop(bucket.index)
        if len(flat.spare) < _SPARE_SCRATCH:
            flat.spare.append(base)

    def _keep_owned_grads(self) -> None:
        """Owned gradients point at their reduced values; the rest are
        dropped, so clipping, loss scaling and the optimizer see each
        gradient exactly once across data-parallel ranks."""
        for flat in self.flats:
            for slot in flat.layout.slots:
                if not flat.own(slot):
                    slot.param.grad = None
                elif self.zero == 2:
                    slot.param.grad = _as_param_view(slot.param, flat.shard_view(slot))

    # ---------------------------------------------------------- optimizer
    def owned_params(self) -> list[torch.Tensor]:
        if self.zero == 0:
            return list(self._params)
        return [s.param for f in self.flats for s in f.layout.slots if f.own(s)]

    def build_optimizer(self, optim_cfg: OptimConfig, device_type: str) -> torch.optim.Optimizer:
        # Keep registration order (stable param groups) among the owned ones.
        owned = {id(p) for p in self.owned_params()}
        return build_adamw([p for p in self._params if id(p) in owned], optim_cfg, device_type)

    @torch.no_grad()
    def after_step(self) -> None:
        """zero 1/2: one in-place all-gather per bucket of the parameter buffer."""
        if self.zero == 0:
            return
        works = [all_gather_in_place(flat.layout.bucket_view(flat.params, b), self.group,
                                     async_op=True)
                 for flat in self.flats for b in flat.layout.buckets]
        for w in works:
            if w is not None:
                w.wait()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        for flat in self.flats:
            if flat.grads is not None:
                flat.grads.zero_()
            if flat.shard is not None:
                flat.shard.zero_()
        self._point_grads()

    def norm_terms(self) -> list[tuple[torch.Tensor, int]]:
        terms = []
        for p in self._params:
            if p.grad is None:
                continue
            copies = replication(p.grad, self.dims)
            if self.zero >= 1:
                copies //= self.world  # reduced into exactly one owner of dp_cp
            terms.append((local_tensor(p.grad), max(1, copies)))
        return terms

    # ------------------------------------------------------------ reports
    def buffer_bytes(self) -> dict[str, int]:
        """Bytes held between steps, for memory accounting."""
        out = {"grads": 0, "params": 0}
        for f in self.flats:
            size = torch.finfo(f.dtype).bits // 8
            out["grads"] += size * (f.grads.numel() if f.grads is not None else f.shard.numel())
            out["params"] += size * (f.params.numel() if f.params is not None else 0)
        return out
