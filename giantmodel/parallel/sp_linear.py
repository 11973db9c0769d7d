"""Column-parallel projections that save their input sharded.

Megatron-Core's sequence-parallel linears keep the sequence shard of their
input for backward and all-gather it again there, overlapped with the
input-gradient GEMM; DTensor's plan (``PrepareModuleInput`` + colwise
linears) saves the gathered input instead, ``tp`` times larger. This module
is the former, for the block's fused projections (q|k|v and gate|up, see
:mod:`giantmodel.models.common.fused`): :func:`install_projector` gives an
attention or MLP module a projector that takes the block input as tensor
parallelism leaves it (a sequence-sharded DTensor under sp, the whole local
tensor without), and returns the local column shards the linears' colwise
plan would have returned.

Backward, per projection: the all-gather of the saved shard (sp) is started,
the input gradient needs only the output gradient and the weight, so it runs
while the gather is in flight; the input gradient's reduce-scatter (sp) or
all-reduce is then started and the weight gradient runs under it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from giantmodel.models.common.fused import cast_weight, compute_dtype, plain
from giantmodel.parallel.collectives import (
    all_gather_into,
    all_reduce_sum_,
    group_size,
    reduce_scatter_into,
)


def _gather_seq(x: torch.Tensor, group, async_op: bool = False):
    """[B, t, h] shards -> [B, size * t, h] (and the Work when async)."""
    n = group_size(group)
    rows = x.transpose(0, 1).contiguous()   # the sequence first: collectives split dim 0
    out = rows.new_empty(n * rows.shape[0], *rows.shape[1:])
    work = all_gather_into(out, rows, group, async_op=async_op)
    return out.transpose(0, 1), work


def _scatter_seq(g: torch.Tensor, group, async_op: bool = False):
    """[B, T, h] partial sums -> this rank's summed [B, T / size, h]."""
    n = group_size(group)
    rows = g.transpose(0, 1).contiguous()
    out = rows.new_empty(rows.shape[0] // n, *rows.shape[1:])
    work = reduce_scatter_into(out, rows, group, async_op=async_op)
    return out.transpose(0, 1), work


class _ColumnProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner, group, sp, n, *params):
        weights, biases = list(params[:n]), params[n:]
        dtype = compute_dtype(x)
        xc = x.to(dtype)
        full = _gather_seq(xc, group)[0] if sp else xc
        w = cast_weight(owner, weights, dtype)
        b = torch.cat([bb.to(dtype) for bb in biases]) if biases else None
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(full, w, b)
        ctx.save_for_backward(xc, *weights)
        ctx.owner, ctx.group, ctx.sp, ctx.n = owner, group, sp, n
        ctx.dtype, ctx.x_dtype, ctx.has_bias = dtype, x.dtype, bool(biases)
        return y

    @staticmethod
    def backward(ctx, gy):
        xc, *weights = ctx.saved_tensors
        gy = gy.to(ctx.dtype)
        full, gather = (_gather_seq(xc, ctx.group, async_op=True) if ctx.sp else (xc, None))
        w = cast_weight(ctx.owner, weights, ctx.dtype)
        gx = gy @ w   # needs no input: overlaps the gather
        if ctx.sp:
            gx, reduce = _scatter_seq(gx, ctx.group, async_op=True)
        else:
            reduce = all_reduce_sum_(gx, ctx.group, async_op=True)
        if gather is not None:
            gather.wait()
        sizes = [t.shape[0] for t in weights]
        g2 = gy.reshape(-1, gy.shape[-1])
        gw = g2.t() @ full.reshape(-1, full.shape[-1])   # overlaps the reduction
        gws = [g.to(t.dtype) for g, t in zip(gw.split(sizes), weights)]
        gbs = ([g.to(t.dtype) for g, t in zip(g2.sum(0).split(sizes), weights)]
               if ctx.has_bias else [])
        if reduce is not None:
            reduce.wait()
        return (gx.to(ctx.x_dtype), None, None, None, None, *gws, *gbs)


class SequenceParallelProjector:
    """A module's projector (see :func:`giantmodel.models.common.fused.project`)
    under tensor parallelism over ``mesh``: the fused column-parallel GEMM on
    each rank's weight shards, the input gathered along the sequence when
    ``sp``. Linears that are not plain (LoRA, fp8) take the input as the
    colwise plan expects it, a replicated DTensor, and run their own
    forward."""

    def __init__(self, mesh, sp: bool):
        self.mesh, self.sp = mesh, sp

    def __deepcopy__(self, memo):   # a model copy shares the mesh
        return self

    def __call__(self, x: torch.Tensor, owner: nn.Module, linears) -> list[torch.Tensor]:
        if not plain(linears):
            x = self._replicated(x)
            return [m(x) for m in linears]
        local = x.to_local() if isinstance(x, DTensor) else x
        weights = [m.weight.to_local() for m in linears]
        biases = [m.bias.to_local() for m in linears if m.bias is not None]
        y = _ColumnProjection.apply(local, owner, self.mesh.get_group(), self.sp,
                                    len(weights), *weights, *biases)
        return list(y.split([w.shape[0] for w in weights], dim=-1))

    def _replicated(self, x: torch.Tensor) -> DTensor:
        if isinstance(x, DTensor):
            return x.redistribute(self.mesh, [Replicate()])
        return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)


def install_projector(module: nn.Module, mesh, sp: bool) -> None:
    """Route ``module``'s projections (attention's q|k|v, the MLP's gate|up)
    through :class:`SequenceParallelProjector`."""
    module.projector = SequenceParallelProjector(mesh, sp)
