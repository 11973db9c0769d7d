"""The global gradient norm, across every parallel dimension.

Each rank sums the squares of the gradient storage it holds. A tensor held in
identical copies by R ranks (replicated across dp after reduction, across tp
for unsharded weights, across the Replicate dims of a DTensor mesh) is
counted with weight 1/R, so one all-reduce over the whole world, pipeline
stages included, yields the exact global sum of squares. The data-parallel
strategy says which gradients a rank holds and how many copies of each
exist (:meth:`norm_terms`): after a ZeRO reduce-scatter only the owner
holds a parameter's gradient.
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


def global_grad_norm(terms: list[tuple[torch.Tensor, int]], world_size: int,
                     device: torch.device | None = None) -> torch.Tensor:
    """L2 norm over all ranks of the gradients in ``terms`` (local storage,
    copies), as a float64 scalar."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t, copies in terms:
        groups.setdefault((copies, t.device, t.dtype), []).append(t.detach())
    for (copies, _, _), tensors in groups.items():
        # One fused kernel per group (as torch's clip_grad_norm_ does), each
        # tensor's norm in fp32 at least; the squares summed in fp64 so that
        # many tensors lose no precision.
        dtype = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
        norms = torch._foreach_norm(tensors, 2.0, dtype=dtype)
        total = total + torch.stack(norms).double().square().sum().to(total.device) / copies
    if world_size > 1 and dist.is_initialized():
        total = all_reduce_sum_(total.reshape(1), dist.group.WORLD).reshape(())
    return total.sqrt()


@torch.no_grad()
def clip_grads_(terms: list[tuple[torch.Tensor, int]], world_size: int, max_norm: float,
                device: torch.device | None = None) -> float:
    """Scale the gradients in ``terms`` in place to a global norm of at most
    ``max_norm`` (when > 0); return the norm before clipping."""
    norm = float(global_grad_norm(terms, world_size, device))
    coef = clip_coefficient(norm, max_norm)
    if coef < 1.0 and terms:
        torch._foreach_mul_([t for t, _ in terms], coef)
    return norm


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor clipping applies to every gradient (1.0: none)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
