"""Data parallelism and ZeRO.

* zero 0: parameters replicated; gradients are summed over the
  data-parallel group in flat buckets of ``parallel.bucket_mb`` MiB, each
  launched from inside backward as soon as it is complete
  (:mod:`giantmodel.parallel.grad_buckets`).
* zero 1: as zero 0, but each dp rank owns whole parameters (balanced by
  size) and keeps AdamW state only for those; after its update an owner
  broadcasts its parameters. The optimizer is a plain ``torch.optim.AdamW``
  over the owned parameters, so DCP's ``get_state_dict`` sees ordinary model
  parameters and saves each state once, under its canonical name.
* zero 2 / 3: FSDP2 (``fully_shard``) per transformer block, plus one unit
  for the embeddings and one for the final norm and head; zero 2 keeps
  parameters gathered from forward to backward (``reshard_after_forward=False``).
  A 2-D ``dp_replicate x dp_shard`` mesh gives hybrid sharding (HSDP).

Gradients are *summed*, never averaged: the engine scales each micro-batch's
loss by 1/(global token count), so the sum over ranks is the gradient of the
global token-mean loss. FSDP2's divide factor is set to 1 for that reason.
Context-parallel ranks see different tokens of the same sequences, so the
reduction group is ``dp_cp`` (dp x cp), not dp alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from giantmodel.core.optim import build_adamw
from giantmodel.core.tensors import local_tensor, unique_params
from giantmodel.parallel.collectives import all_reduce_sum_, broadcast_from_


@torch.no_grad()
def align_grad_placements(parts: list[nn.Module]) -> None:
    """Give every DTensor gradient its parameter's placements.

    Under sequence parallelism a replicated norm weight comes back from
    backward with a ``Partial`` gradient (each tp rank saw part of the
    sequence), and the vocab-parallel embedding with a ``Replicate`` one;
    this all-reduces the former over tp and slices the latter, so clipping,
    the optimizer and data-parallel reduction all see true local shards."""
    for p in unique_params(parts):
        g = p.grad
        if g is not None and hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


def make_buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Group tensor indices into runs of at most ``bucket_bytes`` (one tensor
    larger than that gets a bucket of its own), same dtype per bucket."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if buckets and dtype == t.dtype and size + nbytes <= bucket_bytes:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size, dtype = nbytes, t.dtype
    return buckets


def all_reduce_bucketed_(tensors: list[torch.Tensor], group, bucket_bytes: int) -> None:
    """Sum each tensor over ``group`` in place, packed into flat buckets."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    for bucket in make_buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in bucket]
        flat = torch.cat([t.reshape(-1) for t in members])
        all_reduce_sum_(flat, group)
        offset = 0
        for t in members:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


def assign_owners(params: list[torch.Tensor], world: int) -> list[int]:
    """ZeRO-1 ownership: largest parameters first, each to the least-loaded rank."""
    load = [0] * world
    owner = [0] * len(params)
    order = sorted(range(len(params)), key=lambda i: (-local_tensor(params[i]).numel(), i))
    for i in order:
        r = min(range(world), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += local_tensor(params[i]).numel()
    return owner


class DataParallel:
    """Gradient reduction and optimizer sharding for one ZeRO stage.

    Works on any list of model chunks (a whole model or pipeline stages)."""

    def __init__(self, dims, cfg):
        self.dims = dims
        self.zero = cfg.parallel.zero
        self.bucket_bytes = int(cfg.parallel.bucket_mb * 2**20)
        self.mesh = dims["dp_cp"]
        self.group = self.mesh.get_group()
        self.owned: list[torch.Tensor] = []
        self._owners: list[tuple[torch.Tensor, int]] = []
        self._reducer = None

    @property
    def uses_fsdp(self) -> bool:
        return self.zero >= 2

    def prepare_backward(self, parts: list[nn.Module], last_microbatch: bool) -> None:
        """Optional, before each micro-batch's backward: on the last one,
        zero 0/1 buckets are all-reduced as backward fills them."""
        if self.uses_fsdp or self.mesh.size() == 1:
            return
        if self._reducer is None:
            from giantmodel.parallel.grad_buckets import OverlappedReducer

            self._reducer = OverlappedReducer(unique_params(parts), self.group, self.bucket_bytes)
        self._reducer.arm(last_microbatch)

    def reduce_gradients(self, parts: list[nn.Module]) -> None:
        """zero 0/1: sum gradients over dp x cp (finishing the overlapped
        buckets when :meth:`prepare_backward` armed them). FSDP2 reduces in
        its own hooks."""
        if self.uses_fsdp:
            return
        if self._reducer is not None and self._reducer.armed:
            self._reducer.finish()
        else:
            grads = [local_tensor(p.grad) for p in unique_params(parts) if p.grad is not None]
            all_reduce_bucketed_(grads, self.group, self.bucket_bytes)
        # After the dp sum, which commutes with the tp partial sums it resolves.
        align_grad_placements(parts)

    def build_optimizer(self, parts: list[nn.Module], optim_cfg, device_type: str):
        if self.zero != 1:
            return build_adamw(unique_params(parts), optim_cfg, device_type)
        params = unique_params(parts)
        owners = assign_owners(params, self.mesh.size())
        me = self.mesh.get_local_rank()
        self._owners = list(zip(params, owners))
        self.owned = [p for p, o in self._owners if o == me]
        return build_adamw(self.owned, optim_cfg, device_type)

    @torch.no_grad()
    def after_step(self) -> None:
        """zero 1: every owner broadcasts its freshly updated parameters."""
        if self.zero != 1 or self.mesh.size() == 1:
            return
        for owner in range(self.mesh.size()):
            mine = [local_tensor(p) for p, o in self._owners if o == owner]
            for bucket in make_buckets(mine, self.bucket_bytes):
                members = [mine[i] for i in bucket]
                flat = torch.cat([t.reshape(-1) for t in members])
                broadcast_from_(flat, owner, self.group)
                offset = 0
                for t in members:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()


def apply_fsdp(model: nn.Module, dims, cfg) -> None:
    """FSDP2 over the dp (x cp) ranks: one unit per block, one for the
    embeddings, one for the final norm and head, and the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = fsdp_mesh(dims)
    mp = _mixed_precision(cfg.precision)
    reshard = cfg.parallel.zero == 3
    kw = {"mesh": mesh, "reshard_after_forward": reshard, "mp_policy": mp or MixedPrecisionPolicy()}
    for block in model.layers.values():
        fully_shard(block, **kw)
    tied = cfg.model.tie_embeddings
    emb = [m for m in (getattr(model, "tok_embeddings", None),
                       getattr(model, "pos_embeddings", None)) if m is not None]
    head = [m for m in (getattr(model, "norm", None), getattr(model, "output", None))
            if m is not None]
    if not tied:
        # A shared embedding/head weight must live in a single unit: the root.
        if emb:
            fully_shard(emb, **kw)
        if head:
            fully_shard(head, **kw)
    fully_shard(model, **kw)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            # Plain SUM collectives: the loss is already scaled by 1/tokens,
            # and gloo has neither AVG nor PREMUL_SUM.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def fsdp_mesh(dims):
    """1-D shard mesh, or 2-D (replicate, shard) for HSDP."""
    shard = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
    if dims.dp_replicate > 1:
        if dims.cp > 1:
            return dims.mesh["dp_replicate", "dp_shard_cp"]
        return dims.mesh["dp_replicate", "dp_shard"]
    return dims[shard]


def _mixed_precision(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    # Gradients are reduced in fp32: summing many low-precision shards loses bits.
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
