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
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from giantmodel.models.common.fused import (
    cast_weight,
    compute_dtype,
    input_grad,
    param_grads,
    plain,
)
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
        # the input serves only the weights' gradients (none for a frozen group)
        ctx.train_w = any(ctx.needs_input_grad[5:5 + n])
        ctx.save_for_backward(xc if ctx.train_w else None, *weights)
        ctx.owner, ctx.group, ctx.sp, ctx.n = owner, group, sp, n
        ctx.dtype, ctx.x_dtype, ctx.has_bias = dtype, x.dtype, bool(biases)
        return y

    @staticmethod
    def backward(ctx, gy):
        xc, *weights = ctx.saved_tensors
        gy = gy.to(ctx.dtype)
        full, gather = xc, None
        if ctx.sp and ctx.train_w:
            full, gather = _gather_seq(xc, ctx.group, async_op=True)
        gx = input_grad(gy, ctx.owner, weights, ctx.dtype)   # needs no input: overlaps the gather
        if ctx.sp:
            gx, reduce = _scatter_seq(gx, ctx.group, async_op=True)
        else:
            reduce = all_reduce_sum_(gx, ctx.group, async_op=True)
        if gather is not None:
            gather.wait()
        gws, gbs = param_grads(gy, full, weights, ctx.has_bias)   # overlaps the reduction
        if reduce is not None:
            reduce.wait()
        return (gx.to(ctx.x_dtype), None, None, None, None, *gws, *gbs)


# torch 2.13 names it reduce_scatter_single; 2.11 reduce_scatter_tensor
_funcol_reduce_scatter = (getattr(funcol, "reduce_scatter_single", None)
                          or funcol.reduce_scatter_tensor)


def _partial_scattered(x: torch.Tensor, w: torch.Tensor, group) -> torch.Tensor:
    """x @ w^T summed over ``group`` and scattered along the sequence.

    Under selective recompute (giantmodel.parallel.recompute) this is what a
    block keeps of its row-parallel linears: the policy keeps mm outputs
    and reduce-scatter results, and these partial sums are full-length, tp
    times the scattered result. So the GEMM is a bmm, which the policy
    re-runs in backward, and the reduce-scatter a functional collective,
    whose result it keeps."""
    lead = x.shape[:-1]
    x3 = x.reshape(-1 if x.dim() < 3 else lead[0], lead[-1], x.shape[-1])
    y = torch.bmm(x3, w.t().unsqueeze(0).expand(x3.shape[0], -1, -1))
    rows = _funcol_reduce_scatter(y.transpose(0, 1).contiguous(), "sum", 0, group)
    rows = funcol.wait_tensor(rows)
    return rows.transpose(0, 1).reshape(*lead[:-1], lead[-1] // group_size(group), -1)


class _RowProjection(torch.autograd.Function):
    """x (local columns) @ W_local^T, summed over the group: reduce-scattered
    along the sequence under sp, all-reduced without. Saves x only (the
    attention output or the MLP's product, already kept by their makers)."""

    @staticmethod
    def forward(ctx, x, owner, group, sp, weight):
        dtype = compute_dtype(x)
        xc = x.to(dtype)
        w = cast_weight(owner, [weight], dtype)
        with torch.autocast(x.device.type, enabled=False):
            if sp:
                y = _partial_scattered(xc, w, group)
            else:
                y = F.linear(xc, w)
                all_reduce_sum_(y, group)
        ctx.train_w = ctx.needs_input_grad[4]
        ctx.save_for_backward(xc if ctx.train_w else None, weight)
        ctx.owner, ctx.group, ctx.sp, ctx.dtype, ctx.x_dtype = owner, group, sp, dtype, x.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        xc, weight = ctx.saved_tensors
        gy = gy.to(ctx.dtype)
        if ctx.sp:
            gy = _gather_seq(gy, ctx.group)[0]
        gx = input_grad(gy, ctx.owner, [weight], ctx.dtype)
        (gw,), _ = param_grads(gy, xc, [weight], has_bias=False)
        return gx.to(ctx.x_dtype), None, None, None, gw


class RowProjector:
    """A row-parallel linear's projector (attention's wo, the MLP's w2): the
    GEMM on the local weight shard with the weight cast once per step, its
    partial sums reduce-scattered along the sequence (sp) or all-reduced.
    Returns what the linear's RowwiseParallel style returns: the
    sequence-sharded DTensor under sp, the whole local tensor without. A
    linear that is not plain runs its own forward under that style."""

    def __init__(self, mesh, sp: bool):
        self.mesh, self.sp = mesh, sp

    def __deepcopy__(self, memo):
        return self

    def __call__(self, x: torch.Tensor, owner: nn.Module, linears) -> list[torch.Tensor]:
        (m,) = linears
        if not plain(linears):
            return [m(x)]
        local = x.to_local() if isinstance(x, DTensor) else x
        y = _RowProjection.apply(local, owner, self.mesh.get_group(), self.sp,
                                 m.weight.to_local())
        if m.bias is not None:
            # under sp each rank adds the bias to its own rows: its gradient
            # is this rank's part of the sum
            grad = [Partial()] if self.sp else [Replicate()]
            y = y + m.bias.to_local(grad_placements=grad).to(y.dtype)
        if self.sp:
            return [DTensor.from_local(y, self.mesh, [Shard(1)], run_check=False)]
        return [y]


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


def install_projector(module: nn.Module, out_linear: nn.Module, mesh, sp: bool) -> None:
    """Route ``module``'s projections (attention's q|k|v, the MLP's gate|up)
    through :class:`SequenceParallelProjector`, and its row-parallel output
    linear (wo, w2) through :class:`RowProjector`."""
    module.projector = SequenceParallelProjector(mesh, sp)
    out_linear.projector = RowProjector(mesh, sp)
