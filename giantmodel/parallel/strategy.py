"""Data-parallel strategies: how gradients are summed over data-parallel
ranks and how the optimizer and its states are split among them.

* :class:`NoDataParallel` -- one replica (dp x cp = 1): nothing to sync.
* :class:`giantmodel.parallel.zero.OwnZero` -- ZeRO stages 0, 1 and 2 on a
  flat gradient buffer (all-reduce; reduce-scatter into the owner's shard,
  then an all-gather of the updated parameters).
* :class:`giantmodel.parallel.fsdp.FSDP` -- ZeRO-3 and hybrid sharding
  (HSDP) through FSDP2, which syncs inside backward by itself; also zero 1
  and 2 where the flat buffers cannot share whole parameters out evenly, or
  (on GPUs) only in one bucket too large to overlap backward.

Gradients are *summed*, never averaged: the runner scales each micro-batch's
loss by 1/(global loss units), so the sum over ranks is the gradient of the
global mean. Context-parallel ranks see different tokens of the same
sequences, so the reduction group is ``dp_cp`` (dp x cp), not dp alone.

The engine calls, in order: ``wrap`` on each model part before its weights
exist, ``attach`` once they do, then per step ``before_backward`` before each
micro-batch's backward, ``finish`` after the last, the optimizer step and
``after_step``, and ``zero_grad``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from giantmodel.config.train import OptimConfig
from giantmodel.core.optim import build_adamw
from giantmodel.core.tensors import local_tensor, unique_params
from giantmodel.parallel.flat_buffer import MAX_FIRST_BUCKET, MAX_PADDING
from giantmodel.parallel.grads import replication


class DataParallelStrategy(Protocol):
    def wrap(self, module: nn.Module, blocks: list[nn.Module],
             edge_units: list[list[nn.Module]]) -> None: ...

    def attach(self, parts: list[nn.Module]) -> None: ...

    def before_backward(self, last_microbatch: bool) -> None: ...

    def finish(self) -> None: ...

    def build_optimizer(self, optim_cfg: OptimConfig, device_type: str) -> torch.optim.Optimizer: ...

    def after_step(self) -> None: ...

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...

    def norm_terms(self) -> list[tuple[torch.Tensor, int]]: ...


class NoDataParallel:
    """One data-parallel replica: plain autograd gradients, one optimizer
    over every trainable parameter. Also what tensor, context or pipeline
    parallel layouts without data parallelism use."""

    def __init__(self, dims):
        self.dims = dims
        self.parts: list[nn.Module] = []
        self._trained: list[nn.Parameter] = []

    def wrap(self, module, blocks, edge_units) -> None:
        return None

    def attach(self, parts: list[nn.Module]) -> None:
        self.parts = parts
        # What can hold a gradient, found once: a frozen base (LoRA) is most
        # of the model, and walking it every step costs a small model's step
        # a few percent.
        self._trained = [p for p in unique_params(parts) if p.requires_grad]

    def before_backward(self, last_microbatch: bool) -> None:
        return None

    def finish(self) -> None:
        align_grad_placements(self.parts, self._trained)

    def build_optimizer(self, optim_cfg: OptimConfig, device_type: str) -> torch.optim.Optimizer:
        return build_adamw(unique_params(self.parts), optim_cfg, device_type)

    def after_step(self) -> None:
        return None

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def norm_terms(self) -> list[tuple[torch.Tensor, int]]:
        return [(local_tensor(p.grad), replication(p.grad, self.dims))
                for p in self._trained if p.grad is not None]


def strategy_name(*, zero: int, dp_cp: int, hybrid: bool, pp: int, padding: float = 0.0,
                  first_bucket: float = 0.0, comm_overlaps: bool = False) -> str:
    """Which strategy a layout gets: "none" (dp x cp of one), "fsdp" (ZeRO-3,
    hybrid sharding, and ZeRO-2 under pipeline parallelism, whose schedules
    run backward themselves, so gradients cannot be reduced micro-batch by
    micro-batch) or "own" (zero 0/1/2 on flat buffers).

    ``padding`` and ``first_bucket``: what the flat buffers' whole-parameter
    ownership would add, and the share of the gradients in their first
    bucket (:func:`giantmodel.parallel.flat_buffer.padding_and_first_bucket`).
    Zero 1 and 2 go to FSDP2 too, whose dim-0 shards are even for any number
    of ranks and whose per-block units overlap compute, past
    :data:`~giantmodel.parallel.flat_buffer.MAX_PADDING`, and, where
    ``comm_overlaps`` (collectives run beside compute: NCCL on a GPU) and
    backward would overlap them (no pipeline), past
    :data:`~giantmodel.parallel.flat_buffer.MAX_FIRST_BUCKET`. On a CPU the
    ranks' own cores run the collectives, so the flat buffers' one bucket
    loses nothing there, and FSDP2's per-unit work costs more (2 emulated
    hosts x 2 ranks, benchmarks/results/peers-2026-11-27.md)."""
    if dp_cp == 1:
        return "none"
    if zero == 3 or (zero >= 2 and hybrid) or (zero == 2 and pp > 1):
        return "fsdp"
    if zero >= 1 and padding > MAX_PADDING:
        return "fsdp"
    if zero >= 1 and comm_overlaps and pp == 1 and first_bucket > MAX_FIRST_BUCKET:
        return "fsdp"
    return "own"


@torch.no_grad()
def align_grad_placements(parts: list[nn.Module],
                          params: list[nn.Parameter] | None = None) -> None:
    """Give every DTensor gradient its parameter's placements.

    Under sequence parallelism a replicated norm weight comes back from
    backward with a ``Partial`` gradient (each tp rank saw part of the
    sequence), and the vocab-parallel embedding with a ``Replicate`` one;
    this all-reduces the former over tp and slices the latter, so clipping,
    the optimizer and data-parallel reduction all see true local shards.
    ``params``: the parameters of ``parts`` that can hold gradients, when known."""
    for p in unique_params(parts) if params is None else params:
        g = p.grad
        if g is not None and hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
