"""The global gradient norm, across every parallel dimension.

Each rank sums the squares of the gradient storage it holds. A tensor held in
identical copies by R ranks (replicated across dp after reduction, across tp
for unsharded weights, across the Replicate dims of a DTensor mesh) is
counted with weight 1/R, so one all-reduce over the whole world, pipeline
stages included, yields the exact global sum of squares. Pipeline engines
reuse :func:`global_grad_norm` unchanged: parameters on different stages are
disjoint, so their copies never overlap.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from giantmodel.parallel.collectives import all_reduce_sum_


def replication(t: torch.Tensor, dims) -> int:
    """How many ranks hold an identical copy of ``t``'s local storage."""
    per_stage = dims.world_size // dims.pp
    if not hasattr(t, "placements"):
        return per_stage
    sharded = 1
    for size, placement in zip(t.device_mesh.shape, t.placements):
        # Shard and FSDP2's _StridedShard (which is not a Shard subclass).
        if not placement.is_replicate() and not placement.is_partial():
            sharded *= size
    return per_stage // sharded


def global_grad_norm(params, dims, device: torch.device | None = None) -> torch.Tensor:
    """L2 norm of all gradients of ``params`` (this rank's) over all ranks, float64 scalar."""
    groups: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        local = g.to_local() if hasattr(g, "to_local") else g
        groups.setdefault(replication(g, dims), []).append(local)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for r, tensors in groups.items():
        sq = sum(t.detach().double().pow(2).sum() for t in tensors)
        total = total + sq / r
    if dist.is_initialized() and dims.world_size > 1:
        total = total.reshape(1)
        all_reduce_sum_(total, dist.group.WORLD)
        total = total.reshape(())
    return total.sqrt()


@torch.no_grad()
def clip_grads_(params, dims, max_norm: float) -> float:
    """Clip in place to ``max_norm`` (when > 0) and return the global norm."""
    params = [p for p in params if p.grad is not None]
    norm = float(global_grad_norm(params, dims, params[0].grad.device if params else None))
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                g = p.grad
                (g.to_local() if hasattr(g, "to_local") else g).mul_(coef)
    return norm
