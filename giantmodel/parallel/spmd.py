"""The engine for every layout without pipeline stages: dp / ZeRO / HSDP,
tensor + sequence parallel and context parallel, in any combination.

Every rank holds one model chunk (the whole model, sharded). One optimizer
step: count the global batch's tokens over dp, run each micro-batch (cut to
this rank's context-parallel chunks) with its loss sum scaled by 1/tokens,
then sum gradients over dp x cp (FSDP2 does it inside backward for zero 2/3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.models import build_model, init_weights
from giantmodel.parallel.apply import loss_context, loss_fn, parallelize_chunk
from giantmodel.parallel.collectives import all_reduce_max_, all_reduce_sum_, sum_scalar
from giantmodel.parallel.context import balanced_positions, shard_sequence
from giantmodel.core.tensors import unique_params
from giantmodel.parallel.data import DataParallel
from giantmodel.parallel.engine import Engine
from giantmodel.parallel.grads import clip_grads_
from giantmodel.core.loss import IGNORE_INDEX
from giantmodel.core.precision import Precision


class SPMDEngine(Engine):
    def __init__(self, cfg, dims: ParallelDims, device: torch.device):
        self.cfg = cfg
        self.dims = dims
        self.device = device
        model = build_model(cfg.model, device="meta")
        model = parallelize_chunk(model, dims, cfg)
        init_weights(model, cfg.model, cfg.train.seed, device=device)
        self.parts: list[nn.Module] = [model]
        self.data_parallel = DataParallel(dims, cfg)
        self._dp_group = dims.group("dp")
        self._dp_cp_group = dims.group("dp_cp")

    # ---------------------------------------------------------------- inputs
    def _local_inputs(self, mb: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ids = mb["input_ids"].to(self.device)
        labels = mb["labels"].to(self.device)
        if self.dims.cp == 1:
            return ids, labels, None
        cp, rank = self.dims.cp, self.dims.coordinate("cp")
        positions = balanced_positions(ids.shape[1], cp, rank, self.device)
        return shard_sequence(ids, cp, rank), shard_sequence(labels, cp, rank), positions

    def _global_tokens(self, microbatches: list[dict]) -> float:
        # Every cp rank sees whole sequences here, so dp alone holds distinct ones.
        local = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in microbatches)
        return sum_scalar(local, self._dp_group, self.device)

    # ------------------------------------------------------------- training
    def forward_backward(self, microbatches: list[dict], precision: Precision) -> float:
        model = self.parts[0]
        model.train()
        tokens = self._global_tokens(microbatches)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, mb in enumerate(microbatches):
            ids, labels, positions = self._local_inputs(mb)
            self.data_parallel.prepare_backward(self.parts, i == len(microbatches) - 1)
            with loss_context(self.dims):
                with precision.autocast():
                    logits = model(ids, positions)
                loss_sum, _ = loss_fn(logits, labels)
                precision.scale_loss(loss_sum / max(tokens, 1.0)).backward()
            total += loss_sum.detach().double()
        self.data_parallel.reduce_gradients(self.parts)
        return float(all_reduce_sum_(total.reshape(1), self._dp_cp_group)) / max(tokens, 1.0)

    @torch.no_grad()
    def eval_loss(self, batches, precision: Precision) -> float:
        model = self.parts[0]
        model.eval()
        batches = list(batches)  # may be a one-shot iterator; counted, then run
        tokens = self._global_tokens(batches)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb in batches:
            ids, labels, positions = self._local_inputs(mb)
            with loss_context(self.dims):
                with precision.autocast():
                    logits = model(ids, positions)
                loss_sum, _ = loss_fn(logits, labels)
            total += loss_sum.double()
        model.train()
        return float(all_reduce_sum_(total.reshape(1), self._dp_cp_group)) / max(tokens, 1.0)

    def clip_grad_norm_(self, max_norm: float) -> float:
        return clip_grads_(list(self.parameters()), self.dims, max_norm)

    def any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        return bool(all_reduce_max_(t, dist.group.WORLD).item())

    # ------------------------------------------------------------ optimizer
    def build_optimizer(self, optim_cfg) -> torch.optim.Optimizer:
        return self.data_parallel.build_optimizer(self.parts, optim_cfg, self.device.type)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        self.data_parallel.after_step()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        # ZeRO-1's optimizer holds only owned parameters: clear every gradient.
        optimizer.zero_grad(set_to_none=True)
        for p in unique_params(self.parts):
            p.grad = None

    @property
    def data_rank(self) -> int:
        return self.dims.coordinate("dp")

    @property
    def full_model(self) -> nn.Module | None:
        return None
