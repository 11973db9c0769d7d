"""Small named collectives; each takes its process group explicitly.

A group of ``None`` (a single process) or of one rank makes every one of
them a no-op, so code written for many ranks runs unchanged on one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from giantmodel.comm import all_reduce_inline

# torch 2.13 names the single-tensor forms *_single; older releases *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_sum_(t: torch.Tensor, group, async_op: bool = False):
    """In-place sum of ``t`` over ``group``; with ``async_op`` returns the Work (or None)."""
    if group_size(group) > 1:
        if async_op:
            return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)
        # the blocking form takes the giant core's direct path where it can
        all_reduce_inline(t, group, dist.ReduceOp.SUM)
    return None if async_op else t


def all_reduce_max_(t: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) > 1:
        all_reduce_inline(t, group, dist.ReduceOp.MAX)
    return t


def reduce_scatter_in_place(buffer: torch.Tensor, group, async_op: bool = False):
    """Sum ``buffer`` over ``group``; afterwards rank r's r-th of ``size`` equal
    chunks holds the sum of everyone's r-th chunk (the others are stale).
    The output aliases its chunk of the input, which NCCL, gloo and the
    giant backend all allow."""
    n = group_size(group)
    if n == 1:
        return None
    chunk = buffer.numel() // n
    rank = dist.get_rank(group)
    out = buffer[rank * chunk:(rank + 1) * chunk]
    return _reduce_scatter(out, buffer, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather_in_place(buffer: torch.Tensor, group, async_op: bool = False):
    """Give every rank of ``group`` every rank's chunk of ``buffer`` (rank r
    contributes its r-th of ``size`` equal chunks, in place)."""
    n = group_size(group)
    if n == 1:
        return None
    chunk = buffer.numel() // n
    rank = dist.get_rank(group)
    return _all_gather(buffer, buffer[rank * chunk:(rank + 1) * chunk], group=group,
                       async_op=async_op)


def sum_scalar(value: float, group, device: torch.device) -> float:
    """Sum of a Python number over ``group``, in float64."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    return float(all_reduce_sum_(t, group).item())


def max_scalar(value: float, group, device: torch.device) -> float:
    """Largest value of a Python number over ``group``, in float64."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    return float(all_reduce_max_(t, group).item())


def any_true(flag: bool, group, device: torch.device) -> bool:
    """True when ``flag`` is true on any rank of ``group``."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    return bool(all_reduce_max_(t, group).item())


def all_to_all_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Exchange equal blocks: ``counts`` [n, m] holds, in row r, what this
    rank sends to rank r of ``group``; the result's row r is what rank r sent
    here. Used to tell each rank how many rows the uneven exchange brings."""
    if group_size(group) == 1:
        return counts.clone()
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The reverse exchange: each row's gradient goes back to where the row came from.
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group) -> torch.Tensor:
    """Uneven all-to-all of the rows of ``x`` over ``group``, with autograd:
    the first ``in_splits[0]`` rows go to rank 0, the next ``in_splits[1]``
    to rank 1, ...; the result holds ``out_splits[r]`` rows from each rank r,
    in rank order. Backward is the same exchange reversed."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group`` in forward and, for the gradient, in backward: every
    rank's result feeds its own loss, so each input's gradient is the sum of
    all ranks' output gradients. Functional ops, waited on before returning
    (no collective in flight once autograd holds a tensor, as in context.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _functional_sum(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _functional_sum(grad, ctx.group), None


def _functional_sum(x: torch.Tensor, group) -> torch.Tensor:
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(x.contiguous(), "sum", group.group_name))


def all_reduce_sum_autograd(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group`` (a new tensor), differentiable: the
    backward sums the gradient over ``group`` too (what
    ``torch.distributed.nn.functional.all_reduce`` does, deprecated in 2.13)."""
    if group_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    """``out`` (``size`` times ``x``'s rows) gets every rank's ``x``, in rank order."""
    return _all_gather(out, x, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    """``out`` gets the sum over ranks of this rank's share of ``x``'s rows."""
    return _reduce_scatter(out, x, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
