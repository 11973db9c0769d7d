"""ZeRO-3 and hybrid sharding (HSDP) through FSDP2 (``fully_shard``).

One FSDP unit per repeated block of the model, one per group of edge
modules the objective names (embeddings, final norm and head), and the root.
zero 3 reshards parameters after forward; zero 2 with hybrid sharding (and
zero 2 under pipeline parallelism, whose schedules run backward themselves)
keeps them gathered from forward to backward (``reshard_after_forward=False``).
A 2-D ``dp_replicate x dp_shard`` mesh gives HSDP.

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
from giantmodel.parallel.grads import replication
from giantmodel.parallel.strategy import align_grad_placements


class FSDP:
    def __init__(self, dims, *, reshard_after_forward: bool, precision: str):
        self.dims = dims
        self.reshard = reshard_after_forward
        self.precision = precision
        self.parts: list[nn.Module] = []

    def wrap(self, module: nn.Module, blocks: list[nn.Module],
             edge_units: list[list[nn.Module]]) -> None:
        kw = {"mesh": fsdp_mesh(self.dims), "reshard_after_forward": self.reshard,
              "mp_policy": _mixed_precision(self.precision)}
        for block in blocks:
            fully_shard(block, **kw)
        for unit in edge_units:
            if unit:
                fully_shard(unit, **kw)
        fully_shard(module, **kw)
        for m in module.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)

    def attach(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def before_backward(self, last_microbatch: bool) -> None:
        return None

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
