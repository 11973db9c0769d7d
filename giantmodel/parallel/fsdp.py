"""ZeRO-3 and hybrid sharding (HSDP) through FSDP2 (``fully_shard``).

One FSDP unit per repeated block of the model, one per group of edge
modules the objective names (embeddings, final norm and head), and the root.
zero 3 reshards parameters after forward, except for the blocks that
``parallel.keep_gathered_numel`` keeps (:func:`kept_gathered`); zero 2 with
hybrid sharding (and zero 2 under pipeline parallelism, whose schedules run
backward themselves) keeps them gathered from forward to backward
(``reshard_after_forward=False``).
A 2-D ``dp_replicate x dp_shard`` mesh gives HSDP. Expert-parallel experts
(``parallel.ep``) are units of their own, sharded over ``edp``.

Zero 1 and 2 come here too when the flat buffers' whole-parameter ownership
would pad them (``parallel.strategy.strategy_name``), with parameters kept
gathered from forward to backward. Zero 1 then keeps its meaning: gradients
accumulate unsharded (in fp32) over the micro-batches, parameters stay
gathered between them, and each unit reduce-scatters once, inside the last
micro-batch's backward (``sync_every_microbatch=False``). Under pipeline
parallelism torch's schedules already run FSDP2 units that way
(``PipelineStage.backward_maybe_with_nosync``, then ``perform_reduce_grad``
after the last micro-batch), whatever the stage.

FSDP2 reduces gradients inside backward; its divide factor is 1 because the
runner already scaled the loss by 1/(global loss units), and reductions are
forced to plain SUM, which gloo supports (it has neither AVG nor PREMUL_SUM).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from giantmodel.config.train import OptimConfig
from giantmodel.core.optim import build_adamw
from giantmodel.core.precision import DTYPES
from giantmodel.core.tensors import local_tensor, unique_params
from giantmodel.parallel.expert import expert_modules
from giantmodel.parallel.grads import replication
from giantmodel.parallel.strategy import align_grad_placements


def kept_gathered(block_numels: list[int], edge_numel: int, limit: int) -> tuple[list[bool], bool]:
    """Which zero 3 units skip resharding after forward: (per block, the edge units).

    DeepSpeed's rule (``stage3_max_reuse_distance``): a parameter stays
    gathered when it is used again within ``limit`` parameters. A block's
    forward and backward are separated by the forward and backward of
    everything after it: twice those parameters. The edge units (embedding,
    head) are counted as after every block -- the head is, the embedding is
    not, so this keeps a little less than the rule allows -- and are kept
    only when everything is."""
    keep, later = [], edge_numel
    for n in reversed(block_numels):
        keep.append(2 * later < limit)
        later += n
    return keep[::-1], 2 * later < limit


class FSDP:
    def __init__(self, dims, *, reshard_after_forward: bool, precision: str,
                 keep_gathered_numel: int = 0, sync_every_microbatch: bool = True):
        self.dims = dims
        self.reshard = reshard_after_forward
        self.sync_every = sync_every_microbatch
        self.keep_numel = keep_gathered_numel
        self.precision = precision
        self.parts: list[nn.Module] = []

    def wrap(self, module: nn.Module, blocks: list[nn.Module],
             edge_units: list[list[nn.Module]]) -> None:
        kw = {"mesh": fsdp_mesh(self.dims), "mp_policy": _mixed_precision(self.precision)}
        keep, keep_edges = [False] * len(blocks), False
        # pipeline schedules run other micro-batches between a forward and its backward
        if self.reshard and self.keep_numel and self.dims.pp == 1:
            numels = [_local_numel(b) for b in blocks]
            keep, keep_edges = kept_gathered(numels, _local_numel(module) - sum(numels),
                                             self.keep_numel)
        if self.dims.ep > 1:
            # Expert-parallel experts first, as units of their own: their ep
            # shards are sharded again over edp (the ranks holding the same
            # experts) and reduced there, not over dp x cp.
            expert_kw = {**kw, "mesh": self.dims["edp"]}
            for experts in expert_modules(module):
                fully_shard(experts, reshard_after_forward=self.reshard, **expert_kw)
        for block, kept in zip(blocks, keep):
            fully_shard(block, reshard_after_forward=self.reshard and not kept, **kw)
        for unit in edge_units:
            if unit:
                fully_shard(unit, reshard_after_forward=self.reshard and not keep_edges, **kw)
        fully_shard(module, reshard_after_forward=self.reshard, **kw)
        for m in module.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)

    def attach(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def before_backward(self, last_microbatch: bool) -> None:
        if self.sync_every:
            return
        for part in self.parts:
            # recurse=True (the default) sets every unit under the root
            part.set_requires_gradient_sync(last_microbatch)
            part.set_reshard_after_backward(last_microbatch)

    def finish(self) -> None:
        align_grad_placements(self.parts)

    def build_optimizer(self, optim_cfg: OptimConfig, device_type: str) -> torch.optim.Optimizer:
        return build_adamw(unique_params(self.parts), optim_cfg, device_type)

    def after_step(self) -> None:
        return None

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def norm_terms(self) -> list[tuple[torch.Tensor, int]]:
        return [(local_tensor(p.grad), replication(p.grad, self.dims))
                for p in unique_params(self.parts) if p.grad is not None]


def _local_numel(module: nn.Module) -> int:
    """Elements of ``module``'s parameters on this rank (tensor-parallel shards)."""
    return sum(local_tensor(p).numel() for p in unique_params([module]))


def fsdp_mesh(dims):
    """1-D shard mesh, or 2-D (replicate, shard) for HSDP."""
    shard = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
    if dims.dp_replicate > 1:
        return dims.mesh["dp_replicate", shard]
    return dims[shard]


def _mixed_precision(precision: str) -> MixedPrecisionPolicy:
    if precision == "fp32":
        return MixedPrecisionPolicy()
    # Gradients are reduced in fp32: summing many low-precision shards loses bits.
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
