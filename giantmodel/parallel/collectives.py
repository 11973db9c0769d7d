"""Small named collectives; each takes its process group explicitly."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum_(t: torch.Tensor, group) -> torch.Tensor:
    """In-place sum of ``t`` over ``group`` (a no-op for a group of one)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max_(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def broadcast_from_(t: torch.Tensor, group_src: int, group) -> torch.Tensor:
    """Overwrite ``t`` on every rank of ``group`` with its value on group rank ``group_src``."""
    if dist.get_world_size(group) > 1:
        dist.broadcast(t, group=group, group_src=group_src)
    return t


def sum_scalar(value: float, group, device: torch.device) -> float:
    """Sum of a Python number over ``group``, in float64."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    return float(all_reduce_sum_(t, group).item())
