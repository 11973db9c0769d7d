"""The SPMD step runner: every layout without pipeline stages, one process
included (the degree-1 case of the same code).

Every rank holds one model chunk (the whole model, sharded by tp/cp/FSDP).
One optimizer step: count the global batch's loss units over dp, run each
micro-batch with its loss sum scaled by 1/units and backward, then let the
data-parallel strategy finish the gradient sum over dp x cp. The returned
loss is the global mean, identical on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from giantmodel.core.precision import Precision
from giantmodel.parallel.collectives import all_reduce_sum_, sum_scalar
from giantmodel.parallel.objective import Objective, StageSpec


class SPMDRunner:
    def __init__(self, objective: Objective, dims, device: torch.device, strategy):
        self.objective = objective
        self.dims = dims
        self.device = device
        self.strategy = strategy
        self.dp_group = dims.group_or_none("dp")
        self.dp_cp_group = dims.group_or_none("dp_cp")
        self.parts: list[nn.Module] = []

    def stage_specs(self) -> list[StageSpec]:
        return [StageSpec()]

    def attach(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def global_units(self, microbatches: list[dict]) -> float:
        """Loss units of the whole global batch. Every cp rank sees whole
        sequences, so dp alone holds distinct ones."""
        local = sum(self.objective.loss_units(mb) for mb in microbatches)
        return max(sum_scalar(local, self.dp_group, self.device), 1.0)

    def forward_backward(self, microbatches: list[dict], precision: Precision) -> float:
        model = self.parts[0]
        if not model.training:   # eval_loss leaves it training; skip the module walk
            model.train()
        units = self.global_units(microbatches)
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for i, mb in enumerate(microbatches):
            self.strategy.before_backward(i == len(microbatches) - 1)
            with self.objective.loss_context():
                with precision.autocast():
                    loss_sum, _ = self.objective.loss(model, mb)
                precision.scale_loss(loss_sum / units).backward()
            total += loss_sum.detach().double()
        self.strategy.finish()
        return float(all_reduce_sum_(total, self.dp_cp_group)) / units

    @torch.no_grad()
    def eval_loss(self, batches, precision: Precision) -> float:
        model = self.parts[0]
        model.eval()
        batches = list(batches)  # may be a one-shot iterator; counted, then run
        units = self.global_units(batches)
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for mb in batches:
            with self.objective.loss_context(), precision.autocast():
                loss_sum, _ = self.objective.loss(model, mb)
            total += loss_sum.double()
        model.train()
        return float(all_reduce_sum_(total, self.dp_cp_group)) / units

    def norm_filter(self, terms: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
        return terms

    def after_clip(self, coefficient: float) -> None:
        return None
