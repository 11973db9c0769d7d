"""The DPO reference under pipeline parallelism: a forward-only walk of the
pipeline, stage after stage, with no grad.

The pipeline schedule runs the policy; the reference (LoRA: the same stages
with their adapters off; full fine-tuning: each stage's frozen twin) runs in
a second, forward-only pass over the same micro-batch before it, with plain
send/recv between the stages as the engine's evaluation does. The last stage
ends up with the reference log-probs, which then travel to its loss inside
the micro-batch's target (:func:`pack_reference`), so that the schedule's
own cut into micro-batches keeps every pair row with its reference values.
``dpo.precompute_ref`` uses the same walk for its one pass at setup, and
training then runs none.

The walk is sequential (stage 1 waits for stage 0): the reference forward
costs its compute times the pipeline depth in wall time; precomputing the
table removes it from every step.

The objective does not see the engine's pipeline group, so the ranks of one
pipeline find each other once (:meth:`StageWalk.discover`): every rank
announces its data-parallel and tensor-parallel coordinates and the stages
it holds, and the ranks that share both coordinates form one pipeline (the
same ranks as the engine's pp group, whatever the placement).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from giantmodel.parallel.pipeline import recv_activation, send_activation

StageForward = Callable[[nn.Module, torch.Tensor, dict], torch.Tensor]


class StageWalk:
    """This rank's stages (global stage id -> module) and the global rank
    holding every stage of its pipeline."""

    def __init__(self, stages: dict[int, nn.Module], num_stages: int, owners: dict[int, int],
                 mesh_by_names: Callable[[tuple[str, ...]], object] | None = None):
        self.stages = stages
        self.num_stages = num_stages
        self.owners = owners
        self.rank = dist.get_rank()
        self.mesh_by_names = mesh_by_names or _no_mesh

    @classmethod
    def discover(cls, stages: dict[int, nn.Module], num_stages: int, key: tuple[int, ...],
                 mesh_by_names=None) -> StageWalk:
        """Collective over every rank: ``key`` is what this rank's pipeline
        peers share (its dp and tp coordinates)."""
        mine = (tuple(key), sorted(stages))
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        owners: dict[int, int] = {}
        for rank, (k, ids) in enumerate(every):
            if k != mine[0]:
                continue
            for sid in ids:
                if sid in owners:
                    raise RuntimeError(f"dpo under pipeline parallelism: stage {sid} is held by "
                                       f"ranks {owners[sid]} and {rank} of one pipeline")
                owners[sid] = rank
        missing = sorted(set(range(num_stages)) - set(owners))
        if missing:
            raise RuntimeError(f"dpo under pipeline parallelism: no rank of this pipeline "
                               f"holds stages {missing}")
        return cls(stages, num_stages, owners, mesh_by_names)

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stages

    def forward(self, ids: torch.Tensor, kwargs: dict, forward: StageForward,
                device: torch.device) -> torch.Tensor | None:
        """Every local stage in global stage order, ``forward(stage, h,
        kwargs)`` each (no grad); the last stage's output on the rank that
        holds it, else None. Collective over the pipeline."""
        h = None
        with torch.no_grad():
            for sid in sorted(self.stages):
                inputs = ids
                if sid > 0:
                    if self.owners[sid - 1] != self.rank:
                        h = recv_activation(self.owners[sid - 1], None, device, self.mesh_by_names)
                    inputs = h
                h = forward(self.stages[sid], inputs, kwargs)
                if sid == self.num_stages - 1:
                    return h
                if self.owners[sid + 1] != self.rank:
                    send_activation(h, self.owners[sid + 1], None)
        return None


def _no_mesh(names):
    raise RuntimeError(f"dpo reference walk: a DTensor activation on mesh {names} without a "
                       "tensor-parallel mesh to rebuild it on")


# ------------------------------------------------------- the target's channel
def pack_reference(reference: torch.Tensor, rows: int, T: int) -> torch.Tensor:
    """``[2, pairs * D]`` reference sums (slot order of :func:`sequence_logps`)
    -> int64 ``[rows, T]``: row 2j holds pair row j's chosen sums in its first
    D columns, row 2j+1 its rejected ones, as float64 bit patterns (exact,
    and one int64 target tensor that the schedule splits by rows)."""
    pairs = rows // 2
    D = reference.shape[1] // max(pairs, 1)
    per_row = reference.double().reshape(2, pairs, D).permute(1, 0, 2).reshape(rows, D)
    out = torch.zeros(rows, T, dtype=torch.float64, device=reference.device)
    out[:, :D] = per_row
    return out.view(torch.int64)


def unpack_reference(channel: torch.Tensor, D: int) -> torch.Tensor:
    """Inverse of :func:`pack_reference` for a micro-batch's rows: fp32
    ``[2, pairs * D]``, D the micro-batch's own pairs per row (fewer than or
    as many as the packed batch's; the columns past a row's pairs are 0)."""
    rows = channel.shape[0]
    values = channel.contiguous().view(torch.float64)[:, :D].float()
    return values.reshape(rows // 2, 2, D).permute(1, 0, 2).reshape(2, -1)
