"""The engine: one model replica built, sharded and stepped under a layout.

The trainer talks only to an :class:`Engine`; every parallel dimension lives
behind it. There is one implementation, :class:`TrainEngine`, composed of
three pieces:

* the **model parts** this rank holds -- the whole model, or its pipeline
  stages -- built by the objective and parallelized from outside
  (:func:`giantmodel.parallel.parallelize.parallelize`);
* a **data-parallel strategy** (:mod:`giantmodel.parallel.strategy`): none,
  own ZeRO-0/1/2 on a flat gradient buffer, or FSDP2 for ZeRO-3 and HSDP;
* a **step runner**: SPMD (:mod:`giantmodel.parallel.spmd`; one process is
  its degree-1 case) or a pipeline schedule (:mod:`giantmodel.parallel.pipeline`).

A new parallel dimension is a strategy or a runner here; a new model is an
objective (:mod:`giantmodel.parallel.objective`); neither adds a branch to
the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from giantmodel.config.parallel import ParallelConfig
from giantmodel.config.train import OffloadConfig, OptimConfig
from giantmodel.core.hostmem import keep_freed_host_memory
from giantmodel.core.precision import Precision
from giantmodel.core.tensors import local_tensor, unique_params
from giantmodel.models.common.fused import keep_casts, weights_changed
from giantmodel.parallel.accel import Accelerations
from giantmodel.parallel.collectives import any_true, max_scalar
from giantmodel.parallel.expert import ExpertDataParallel
from giantmodel.parallel.flat_buffer import MAX_PADDING, padding_and_first_bucket
from giantmodel.parallel.fsdp import FSDP
from giantmodel.parallel.grads import clip_coefficient, clip_grads_
from giantmodel.parallel.objective import Objective
from giantmodel.parallel.parallelize import parallelize
from giantmodel.parallel.pipeline import PipelineRunner
from giantmodel.parallel.spmd import SPMDRunner
from giantmodel.parallel.strategy import DataParallelStrategy, NoDataParallel, strategy_name
from giantmodel.parallel.zero import OwnZero

log = logging.getLogger(__name__)


class Engine(Protocol):
    """The contract the trainer relies on.

    * ``parts``: the model chunks this rank holds (one, or pipeline stages).
    * ``forward_backward(microbatches, precision)``: forward and backward over
      one optimizer step's micro-batches; gradients end up as the gradient of
      the *global-batch mean* loss, reduced over every data-parallel rank.
      Returns that loss (a float, identical on all ranks).
    * ``clip_grad_norm_(max_norm)``: the global gradient norm across all ranks
      and dimensions, clipping in place when ``max_norm > 0``.
    * ``eval_loss(batches, precision)``: the global mean loss, no grad.
    * ``build_optimizer(optim_cfg)``: the optimizer over this rank's share.
    * ``optimizer_step(optimizer)`` / ``zero_grad(optimizer)``: one update and
      the reset after it (ZeRO re-gathers parameters in the first).
    * ``data_rank`` / ``data_world``: which slice of the global batch this rank
      feeds (ranks that differ only in tp/cp/pp get the same slice).
    """

    parts: list[nn.Module]

    def forward_backward(self, microbatches: list[dict], precision: Precision) -> float: ...

    def eval_loss(self, batches, precision: Precision) -> float: ...

    def clip_grad_norm_(self, max_norm: float) -> float: ...

    def any_rank(self, flag: bool) -> bool: ...

    def build_optimizer(self, optim_cfg: OptimConfig) -> torch.optim.Optimizer: ...

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    @property
    def data_rank(self) -> int: ...

    @property
    def data_world(self) -> int: ...


class TrainEngine:
    """Model parts + data-parallel strategy + step runner (module docstring)."""

    def __init__(self, objective: Objective, dims, device: torch.device, *,
                 parallel: ParallelConfig, recompute: str, offload: OffloadConfig,
                 compile: bool, precision: str, bucket_mb: float,
                 recompute_layers: list[str] | None = None,
                 strategy: DataParallelStrategy | None = None,
                 accel: Accelerations | None = None, weight_cast: str = "step"):
        self.objective = objective
        self.dims = dims
        self.device = device
        if device.type == "cpu":
            keep_freed_host_memory()
        runner_cls = PipelineRunner if dims.pp > 1 else SPMDRunner
        self.runner = runner_cls(objective, dims, device, strategy)
        # The layout's strategy depends on this rank's local parameter shapes
        # (strategy_name's padding), known once the parts are built and
        # tensor-parallel: their wrapping waits until then, before any weight
        # exists. ``strategy`` replaces it (benchmarks compare strategies).
        pending = _PendingWrap() if strategy is None else None
        self.parts: list[nn.Module] = []
        for spec in self.runner.stage_specs():
            module = objective.build(spec)
            parallelize(module, objective, dims, pending or strategy, sp=parallel.sp,
                        recompute=recompute, recompute_layers=recompute_layers,
                        offload=offload, compile=compile, accel=accel)
            keep_casts(module, weight_cast == "step")
            self.parts.append(module)
        if pending is not None:
            bucket_bytes = int(bucket_mb * 2**20)
            pad = first = 0.0
            if parallel.zero in (1, 2):
                pad, first = own_padding(self.parts, dims, bucket_bytes)
            if parallel.zero in (1, 2) and dims.world_size > 1:
                # One strategy on every rank: the stages holding a tied weight's
                # two copies sum its gradients shard against shard.
                pad = max_scalar(pad, dist.group.WORLD, device)
                first = max_scalar(first, dist.group.WORLD, device)
            strategy = build_strategy(
                # fp8 keeps bf16 around its fp8 linears: FSDP casts to bf16.
                dims, zero=parallel.zero, precision="bf16" if precision == "fp8" else precision,
                bucket_bytes=bucket_bytes,
                keep_gathered_numel=parallel.keep_gathered_numel, padding=pad,
                first_bucket=first, comm_overlaps=device.type == "cuda")
            pending.replay(strategy)
        self.strategy = strategy
        self.runner.strategy = self.strategy
        for module in self.parts:
            objective.init_weights(module, device)
        self.strategy.attach(self.parts)
        self.runner.attach(self.parts)

    # ------------------------------------------------------------- training
    def forward_backward(self, microbatches: list[dict], precision: Precision) -> float:
        return self.runner.forward_backward(microbatches, precision)

    def eval_loss(self, batches, precision: Precision) -> float:
        return self.runner.eval_loss(batches, precision)

    def clip_grad_norm_(self, max_norm: float) -> float:
        terms = self.runner.norm_filter(self.strategy.norm_terms())
        norm = clip_grads_(terms, self.dims.world_size, max_norm, self.device)
        self.runner.after_clip(clip_coefficient(norm, max_norm))
        return norm

    def any_rank(self, flag: bool) -> bool:
        """True when ``flag`` is true on any rank (fp16 overflow checks)."""
        return any_true(flag, dist.group.WORLD if self.dims.world_size > 1 else None, self.device)

    # ------------------------------------------------------------ optimizer
    def build_optimizer(self, optim_cfg: OptimConfig) -> torch.optim.Optimizer:
        return self.strategy.build_optimizer(optim_cfg, self.device.type)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        self.strategy.after_step()
        weights_changed()   # the next forward casts the new weights

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.strategy.zero_grad(optimizer)

    def parameters(self) -> Iterator[nn.Parameter]:
        # A generator: the fp32/bf16 step passes it to a check that never
        # iterates it, so the module walk is paid only by fp16 runs.
        yield from unique_params(self.parts)

    @property
    def data_rank(self) -> int:
        return self.dims.coordinate("dp")

    @property
    def data_world(self) -> int:
        return self.dims.dp

    @property
    def full_model(self) -> nn.Module | None:
        """The whole, unsharded model when this rank has it (for sampling)."""
        return self.parts[0] if self.dims.world_size == 1 else None


class _PendingWrap:
    """Stands in for the strategy while the parts are parallelized: records
    each ``wrap`` for the strategy chosen afterwards."""

    def __init__(self):
        self.calls: list[tuple] = []

    def wrap(self, module, blocks, edge_units) -> None:
        self.calls.append((module, blocks, edge_units))

    def replay(self, strategy: DataParallelStrategy) -> None:
        for call in self.calls:
            strategy.wrap(*call)


def own_padding(parts: list[nn.Module], dims, bucket_bytes: int) -> tuple[float, float]:
    """What the flat buffers of zero 1/2 would pad this rank's trainable
    parameters by, and the share of them in the first bucket
    (:func:`giantmodel.parallel.flat_buffer.padding_and_first_bucket`). A
    model with a frozen base (LoRA) trains adapters alone, whose padding costs
    little and whose reduction is small; it keeps the flat buffers, which
    leave the base (4-bit or not) unwrapped: (0, 0)."""
    everything = unique_params(parts)
    params = [p for p in everything if p.requires_grad]
    if not params or len(params) < len(everything):
        return 0.0, 0.0
    sizes = [local_tensor(p).numel() for p in params]
    numel = max(1, bucket_bytes // params[0].element_size())
    return padding_and_first_bucket(sizes, owners=dims.dp * dims.cp, bucket_numel=numel)


def build_strategy(dims, *, zero: int, precision: str, bucket_bytes: int,
                   keep_gathered_numel: int = 0, padding: float = 0.0, first_bucket: float = 0.0,
                   comm_overlaps: bool = False) -> DataParallelStrategy:
    """The data-parallel strategy for a layout (see :func:`strategy_name`)."""
    n = dims.dp * dims.cp
    name = strategy_name(zero=zero, dp_cp=n, hybrid=dims.dp_replicate > 1, pp=dims.pp,
                         padding=padding, first_bucket=first_bucket, comm_overlaps=comm_overlaps)
    if name == "none":
        return NoDataParallel(dims)
    if name == "fsdp":
        if zero in (1, 2) and padding > MAX_PADDING:
            log.info("parallel.zero=%d: owning whole parameters would pad the flat buffers by "
                     "%.0f%% on %d ranks; sharding through FSDP2 instead", zero, 100 * padding, n)
        elif zero in (1, 2) and first_bucket > 0:
            log.info("parallel.zero=%d: owning whole parameters, the first gradient bucket would "
                     "hold %.0f%% of the gradients on %d ranks, so little of their reduction "
                     "could overlap backward; sharding through FSDP2 instead", zero,
                     100 * first_bucket, n)
        return FSDP(dims, reshard_after_forward=zero == 3, precision=precision,
                    keep_gathered_numel=keep_gathered_numel,
                    sync_every_microbatch=zero != 1)
    if dims.ep > 1:  # experts reduce over edp, the rest over dp x cp
        return ExpertDataParallel(dims, zero=zero, bucket_bytes=bucket_bytes,
                                  overlap=dims.pp == 1)
    return OwnZero(dims, zero=zero, group=dims.group("dp_cp"), bucket_bytes=bucket_bytes,
                   overlap=dims.pp == 1)
