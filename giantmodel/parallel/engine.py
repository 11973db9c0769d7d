"""The engine: how one model replica is built, sharded and stepped under a layout.

The trainer only talks to an :class:`Engine`; every parallel dimension lives
behind it. Contract:

* ``parts``: the model chunks this rank holds (one, or several pipeline stages).
* ``forward_backward(microbatches, precision)``: forward and backward over one
  optimizer step's micro-batches; gradients end up as the gradient of the
  *global-batch token-mean* loss, reduced over every data-parallel rank.
  Returns that loss (a float, identical on all ranks) for logging.
* ``clip_grad_norm_(max_norm)``: the global gradient norm across all ranks and
  dimensions, clipping in place when ``max_norm > 0``.
* ``eval_loss(batches, precision)``: global token-mean loss, no grad.
* ``build_optimizer(cfg)``: the optimizer over this rank's parameters.
* ``optimizer_step(optimizer)`` / ``zero_grad(optimizer)``: one update and the
  reset after it (ZeRO-1 shards the update and re-gathers parameters here).
* ``data_rank`` / ``data_world``: which slice of the global batch this rank
  feeds (ranks that differ only in tp/cp/pp get the same slice).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.models import build_model, init_weights
from giantmodel.core.loss import cross_entropy_sum
from giantmodel.core.optim import build_adamw
from giantmodel.core.precision import Precision


class Engine:
    def __init__(self, cfg, dims: ParallelDims, device: torch.device):
        self.cfg = cfg
        self.dims = dims
        self.device = device
        if dims.world_size != 1:
            raise NotImplementedError("multi-rank layouts are built by giantmodel.parallel")
        from giantmodel.parallel.apply import parallelize_chunk

        model = build_model(cfg.model, device="meta")
        # One process: only recompute and activation offload apply.
        model = parallelize_chunk(model, dims, cfg)
        init_weights(model, cfg.model, cfg.train.seed, device=device)
        self.parts: list[nn.Module] = [model]

    # ------------------------------------------------------------- training
    def forward_backward(self, microbatches: list[dict], precision: Precision) -> float:
        model = self.parts[0]
        model.train()
        tokens = sum(int((mb["labels"] != -100).sum()) for mb in microbatches)
        total = torch.zeros((), device=self.device)
        for mb in microbatches:
            with precision.autocast():
                logits = model(mb["input_ids"].to(self.device))
            loss_sum, _ = cross_entropy_sum(logits, mb["labels"].to(self.device))
            precision.scale_loss(loss_sum / tokens).backward()
            total += loss_sum.detach()
        return float(total) / tokens

    @torch.no_grad()
    def eval_loss(self, batches, precision: Precision) -> float:
        model = self.parts[0]
        model.eval()
        loss, tokens = torch.zeros((), dtype=torch.float64), 0
        for mb in batches:
            with precision.autocast():
                logits = model(mb["input_ids"].to(self.device))
            s, n = cross_entropy_sum(logits, mb["labels"].to(self.device))
            loss += s.double().cpu()
            tokens += int(n)
        model.train()
        return float(loss) / max(1, tokens)

    def clip_grad_norm_(self, max_norm: float) -> float:
        params = [p for part in self.parts for p in part.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return float(norm)

    def any_rank(self, flag: bool) -> bool:
        """True when ``flag`` is true on any rank (fp16 overflow checks)."""
        if not dist.is_initialized():
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def build_optimizer(self, optim_cfg) -> torch.optim.Optimizer:
        return build_adamw(self.parameters(), optim_cfg, self.device.type)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    @property
    def data_rank(self) -> int:
        return self.dims.coordinate("dp") if self.dims.world_size > 1 else 0

    @property
    def data_world(self) -> int:
        return self.dims.dp

    def parameters(self):
        seen = set()
        for part in self.parts:
            for p in part.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    @property
    def full_model(self) -> nn.Module | None:
        """The whole, unsharded model when this rank has it (for sampling)."""
        return self.parts[0] if self.dims.world_size == 1 else None


def build_engine(cfg, dims: ParallelDims, device: torch.device) -> Engine:
    """The engine for a layout: single process, SPMD (dp/zero/tp/sp/cp), or pipeline."""
    if dims.world_size == 1:
        return Engine(cfg, dims, device)
    if dims.pp > 1:
        from giantmodel.parallel.pipeline import PipelineEngine

        return PipelineEngine(cfg, dims, device)
    from giantmodel.parallel.spmd import SPMDEngine

    return SPMDEngine(cfg, dims, device)
