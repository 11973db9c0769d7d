"""Mixture-of-Experts feed-forward: router, routed experts, shared experts.

Plain modules with no torch.distributed. Expert parallelism is applied from
outside later, like tensor parallelism: the routed experts' weights are
stacked 3-D parameters ``[E, in, out]`` whose dim 0 a plan can shard, and
the dispatch below is the single-rank case of an all-to-all dispatch.

Semantics follow Hugging Face's ``MixtralSparseMoeBlock`` (softmax, top-k,
renormalise), ``Qwen3MoeSparseMoeBlock`` (``norm_topk_prob``),
``Qwen2MoeSparseMoeBlock`` (sigmoid-gated shared expert) and
``DeepseekV3MoE`` (sigmoid scores, a correction bias used for choosing
only, group-limited top-k, ``routed_scaling_factor``, shared experts).

What training reads besides the output, per MoE layer:

* the auxiliary losses of the last forward (``take_aux_loss``), already
  weighted by their coefficients, for the objective to add to the loss; on
  a pipeline stage, where the loss exists only on the last stage, each
  forward instead attaches its auxiliary loss to the layer's output
  (:class:`AuxLossScaler`, set up by :func:`set_aux_loss_units`), so it
  back-propagates with that stage's own backward;
* ``stats``: expert loads, dropped assignments and the raw auxiliary losses,
  summed over the forwards of one optimizer step, for metrics and for the
  auxiliary-loss-free bias update (:func:`update_expert_bias`) after it.

Neither is recorded when activation recompute re-runs the forward inside
backward: the step would count its tokens twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from giantmodel.config.moe import MoEConfig
from giantmodel.core import compat
from giantmodel.models.common.fused import compute_dtype
from giantmodel.models.common.layers import SwiGLU

# Layout of MoE.stats after the E per-expert loads.
STAT_DROPPED, STAT_AUX, STAT_SEQ_AUX, STAT_Z, STAT_FORWARDS = range(5)
NUM_EXTRA_STATS = 5


@dataclass
class Routing:
    """One forward's routing of N tokens to k of E experts."""

    weights: torch.Tensor
    """[N, k] fp32 gate weights of the chosen experts (after renormalising and scaling)."""
    experts: torch.Tensor
    """[N, k] int64 chosen expert ids."""
    probs: torch.Tensor
    """[N, E] fp32 routing probabilities for the balance losses (softmax, or
    sigmoid scores normalised per token)."""
    logits: torch.Tensor
    """[N, E] fp32 router logits (for the z-loss)."""


class Router(nn.Module):
    """Token-choice top-k router, computed in fp32 whatever the training precision.

    ``gate.weight`` is ``[E, hidden]`` (HF's ``gate.weight``); ``expert_bias``
    (HF DeepSeek-V3's ``e_score_correction_bias``) is a persistent buffer,
    added to the scores to choose experts but never to weight them."""

    def __init__(self, hidden: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=False)
        if cfg.uses_bias:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> Routing:
        """``x`` [N, hidden] -> the routing of its N tokens."""
        c = self.cfg
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())            # [N, E]
        if c.router == "softmax":
            scores = probs = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if c.n_group > 1:
            choice = _limit_to_groups(choice, c.n_group, c.topk_group)
        experts = choice.topk(c.top_k, dim=-1).indices                        # [N, k]
        weights = scores.gather(1, experts)
        if c.norm_topk_prob:
            # DeepSeek's 1e-20 guards all-zero sigmoid scores; on a softmax sum
            # (Mixtral, Qwen) it is below fp32 resolution and changes nothing.
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if c.routed_scaling_factor != 1.0:
            weights = weights * c.routed_scaling_factor
        return Routing(weights, experts, probs, logits)


def _limit_to_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: keep the ``topk_group`` groups of
    experts whose two best scores sum highest; the others get -inf."""
    n, e = choice.shape
    grouped = choice.view(n, n_group, e // n_group)
    group_scores = grouped.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)   # [N, G]
    best = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)
    return choice.masked_fill(~keep, float("-inf"))


class GroupedExperts(nn.Module):
    """E SwiGLU experts, ``w2(silu(x w1) * x w3)``, stored stacked:
    ``w1``/``w3`` [E, hidden, ffn] and ``w2`` [E, ffn, hidden] ([E, in, out])."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, impl: str = "auto"):
        super().__init__()
        self.impl = impl
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                weights: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """``x`` [M, hidden]: rows sorted by expert, ``counts[e]`` rows for
        expert e (``counts`` may hold one more entry: trailing rows that no
        expert computes, whose output is undefined) -> [M, hidden].
        ``weights``: (w1, w3, w2) to compute with instead of the parameters
        (an expert-parallel plan passes its rank's experts, plain tensors)."""
        w1, w3, w2 = weights or (self.w1, self.w3, self.w2)
        dtype = compute_dtype(x)
        # The fused kernel's TMA loads need 16-byte row strides: widths a
        # multiple of 8 in bf16 (forced, an unaligned width errors in torch).
        aligned = all(d * dtype.itemsize % 16 == 0 for d in w1.shape[1:])
        grouped = self.impl == "grouped_mm" or (
            self.impl == "auto" and aligned and compat.grouped_mm_fused(x.device, dtype))
        if grouped:
            return self._grouped(x, counts, dtype, w1, w3, w2)
        return self._loop(x, counts.tolist(), w1, w3, w2)

    @staticmethod
    def _loop(x: torch.Tensor, counts: list[int], w1, w3, w2) -> torch.Tensor:
        """One matmul per expert (the CPU path): the counts must be on the
        host. Run in the compute dtype (autocast's for its matmuls), by
        :class:`_ExpertLoop`."""
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            return _ExpertLoop.apply(x.to(dtype), counts, *(w.to(dtype) for w in (w1, w3, w2)))

    @staticmethod
    def _grouped(x: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype,
                 w1, w3, w2) -> torch.Tensor:
        """Three ``torch._grouped_mm`` calls, no host sync. Each expert's rows
        start at a multiple of 16 bytes' worth of rows (TMA alignment on the
        token dimension, which the weight gradient contracts over), so rows
        are scattered into a zero-padded buffer and gathered back. The last
        group runs to the buffer's end: every output row is then computed
        (torch leaves rows past the last offset uninitialised, in forward and
        backward), so the trailing undefined rows hold finite values and
        their zero gradients stay zero. An expert with no rows still gets
        one aligned block of zero rows: on sm100 torch's kernel writes
        garbage into the weight gradient of an empty group (pytorch#172439);
        zero rows add nothing to it."""
        num_experts = w1.shape[0]
        align = 16 // dtype.itemsize
        counts = counts.to(torch.int64)
        padded = torch.where(counts == 0, align, (counts + align - 1) // align * align)
        # starts of each group (and of the trailing undefined rows) before and after padding
        start = torch.cumsum(counts, 0) - counts
        padded_start = torch.cumsum(padded, 0) - padded
        group = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts,
                                        output_size=x.shape[0])
        dest = torch.arange(x.shape[0], device=x.device) + (padded_start - start)[group]
        rows = x.shape[0] + len(counts) * align
        xp = x.new_zeros(rows, x.shape[1], dtype=dtype).index_copy(0, dest, x.to(dtype))
        offs = torch.cumsum(padded[:num_experts], 0).to(torch.int32)
        offs = torch.cat([offs[:-1], offs.new_full((1,), rows)])
        w1, w3, w2 = (w.to(dtype) for w in (w1, w3, w2))
        with torch.autocast(x.device.type, enabled=False):
            h = F.silu(torch._grouped_mm(xp, w1, offs=offs)) * torch._grouped_mm(xp, w3, offs=offs)
            y = torch._grouped_mm(h, w2, offs=offs)
        return y[dest]


class _ExpertLoop(torch.autograd.Function):
    """``x`` [M, in] sorted by expert, ``counts`` (host ints, maybe one
    trailing group no expert runs: zeros out) -> [M, out], each expert's rows
    through its SwiGLU ``w2(silu(x w1) * x w3)``; the stacked weights stay
    [E, in, out].

    The same matmuls and element-wise kernels as autograd would run, one
    expert at a time, with fewer fresh buffers: each expert's output and
    each weight gradient is written in place into one [M, *] or [E, in, out]
    tensor (no cat of E outputs, no stack of E weight gradients), and the
    backward's element-wise steps reuse two scratch buffers of the largest
    expert's rows. Saved tensors are never modified, so a second backward
    (zero-bubble pipelines split the input and weight gradients) gives the
    same result. Saved, as autograd would save them: each expert's rows'
    ``x w1``, ``x w3`` (plain matmul outputs, which selective recompute
    keeps), ``silu(x w1)`` and the gated product."""

    @staticmethod
    def forward(ctx, x, counts: list[int], w1, w3, w2):
        spans = _spans(counts, w1.shape[0])
        out = x.new_empty(x.shape[0], w2.shape[2])
        saved = []
        for e, s, n in spans:
            xe = x[s:s + n]
            # plain mm (not out=): selective recompute keeps matmul outputs
            # by op, and would re-run an out= variant in backward
            a, b = torch.mm(xe, w1[e]), torch.mm(xe, w3[e])
            sa = F.silu(a)
            h = sa * b
            torch.mm(h, w2[e], out=out[s:s + n])
            saved += [a, b, sa, h]
        routed = sum(counts[:w1.shape[0]])
        out[routed:].zero_()  # dropped rows: never read
        ctx.spans, ctx.routed = spans, routed
        ctx.save_for_backward(x, w1, w3, w2, *saved)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w1, w3, w2, *saved = ctx.saved_tensors
        need_x, _, need_w1, need_w3, need_w2 = ctx.needs_input_grad
        spans, routed = ctx.spans, ctx.routed
        grad_out = grad_out.contiguous()
        gw = [_expert_grad(w, spans) if need else None
              for w, need in ((w1, need_w1), (w3, need_w3), (w2, need_w2))]
        gx = None
        if need_x:
            gx = x.new_empty(x.shape)
            gx[routed:].zero_()  # the experts' rows run from 0, dropped rows after
        # In 2-byte dtypes the CPU's GEMM runs a transposed left operand at
        # 0.6-0.8x its rate; one contiguous copy of an expert's rows serves both.
        copy_xt = x.device.type == "cpu" and x.dtype.itemsize == 2
        # two scratch buffers of the largest expert's rows: d h (then d (x w1)), d (x w3)
        scratch = x.new_empty(2, max((n for _, _, n in spans), default=0), w1.shape[2])
        for i, (e, s, n) in enumerate(spans):
            a, b, sa, h = saved[4 * i:4 * i + 4]
            xe, ge = x[s:s + n], grad_out[s:s + n]
            if need_w2:
                torch.mm(h.t(), ge, out=gw[2][e])
            gh = torch.mm(ge, w2[e].t(), out=scratch[0, :n])                        # d h
            g_b = torch.mul(sa, gh, out=scratch[1, :n])                              # d (x w3)
            g_a = torch.ops.aten.silu_backward.grad_input(gh.mul_(b), a, grad_input=gh)  # d (x w1)
            if need_x:
                torch.mm(g_a, w1[e].t(), out=gx[s:s + n]).addmm_(g_b, w3[e].t())
            if need_w1 or need_w3:
                xt = xe.t().contiguous() if copy_xt else xe.t()
                if need_w1:
                    torch.mm(xt, g_a, out=gw[0][e])
                if need_w3:
                    torch.mm(xt, g_b, out=gw[1][e])
        return gx, None, *gw


def _spans(counts: list[int], num_experts: int) -> list[tuple[int, int, int]]:
    """(expert, first row, rows) of each expert that receives rows."""
    spans, start = [], 0
    for e, n in enumerate(counts[:num_experts]):
        if n:
            spans.append((e, start, n))
        start += n
    return spans


def _expert_grad(w: torch.Tensor, spans) -> torch.Tensor:
    """An uninitialised gradient for stacked weights ``w``, zero for the
    experts that received no rows (the others are written whole)."""
    g = w.new_empty(w.shape)
    ran = {e for e, _, _ in spans}
    for e in range(w.shape[0]):
        if e not in ran:
            g[e].zero_()
    return g


class _GatherRows(torch.autograd.Function):
    """``x[index]`` where ``index`` takes every row of ``x`` exactly
    ``copies`` times and ``inverse`` is the permutation that puts the
    gathered rows back in row-major order of (row of x, copy): the backward
    is then a gather and a sum over the copies, where autograd's is a serial
    scatter-add (``index_put_`` with accumulate) into zeros."""

    @staticmethod
    def forward(ctx, x, index, inverse, copies: int):
        ctx.save_for_backward(inverse)
        ctx.copies = copies
        return x.index_select(0, index)  # on the CPU 2-3x faster than x[index]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        g = grad.index_select(0, inverse)
        if ctx.copies == 2:
            # the same one rounding of the exact sum as sum(dim=1), whose
            # reduction over a middle dim of 2 is 5x slower on the CPU in bf16
            g = g.view(-1, 2, g.shape[-1])
            g = g[:, 0] + g[:, 1]
        elif ctx.copies > 2:
            g = g.view(-1, ctx.copies, g.shape[-1]).sum(dim=1)
        return g, None, None, None


class _Combine(torch.autograd.Function):
    """``y`` [N, k, H], ``weights`` [N, k] -> sum_j weights[:, j] * y[:, j]
    [N, H], as k fused multiply-adds over rows (on the CPU a third of
    ``bmm``'s time for k = 2, whose N 1 x k products each pay a call)."""

    @staticmethod
    def forward(ctx, y, weights):
        ctx.save_for_backward(y, weights)
        out = y[:, 0] * weights[:, :1]
        for j in range(1, y.shape[1]):
            out.addcmul_(y[:, j], weights[:, j:j + 1])
        return out

    @staticmethod
    def backward(ctx, grad):
        y, weights = ctx.saved_tensors
        g_y = g_w = None
        if ctx.needs_input_grad[0]:
            g_y = grad.unsqueeze(1) * weights.unsqueeze(-1)
        if ctx.needs_input_grad[1]:
            g_w = torch.bmm(y, grad.unsqueeze(-1)).squeeze(-1)
        return g_y, g_w


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor,
                copies: int = 1) -> torch.Tensor:
    """``x[index]`` for an ``index`` that repeats each row ``copies`` times
    (a permutation when 1), ``inverse`` its inverse (see :class:`_GatherRows`)."""
    return _GatherRows.apply(x, index, inverse, copies)


class MoE(nn.Module):
    """The MoE feed-forward of one block: ``[B, T, hidden] -> [B, T, hidden]``."""

    def __init__(self, hidden: int, ffn_hidden_size: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        e = cfg.num_experts
        self.router = Router(hidden, cfg)
        self.experts = GroupedExperts(hidden, cfg.expert_width(ffn_hidden_size), e,
                                      cfg.experts_impl)
        self.shared_experts: nn.Module | None = None
        self.shared_experts_gate: nn.Module | None = None
        if cfg.num_shared_experts:
            self.shared_experts = SwiGLU(hidden, cfg.shared_width(ffn_hidden_size))
            if cfg.shared_expert_gate:
                self.shared_experts_gate = nn.Linear(hidden, 1, bias=False)
        # Per optimizer step (see the module docstring): loads [E], then the
        # STAT_* entries. Not checkpointed: a step never spans a save.
        self.register_buffer("stats", torch.zeros(e + NUM_EXTRA_STATS), persistent=False)
        self._aux: torch.Tensor | None = None
        # Pipeline stages (see set_aux_loss_units / set_aux_loss_factor).
        self._aux_units: torch.Tensor | None = None
        self._aux_factor = 1.0
        # Set by a context-parallel plan: sums a tensor over the ranks that
        # hold the other parts of the same sequences, with autograd, so the
        # balance losses cover whole sequences (see balance_losses).
        self.reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._bias_set = False
        if self.router.expert_bias is not None:
            self.register_load_state_dict_pre_hook(_note_loaded_bias)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Zero the step statistics, and the routing bias the first time only
        (a meta-built model's buffers hold garbage). A bias loaded through
        ``load_state_dict`` (checkpoints, DCP) or :meth:`set_expert_bias`
        before this call is kept; so is one that training moved."""
        self.stats = torch.zeros(self.stats.shape, device=device or self.stats.device)
        if self.router.expert_bias is not None and not self._bias_set:
            self.router.expert_bias.zero_()
            self._bias_set = True

    def set_expert_bias(self, values: torch.Tensor) -> None:
        """Load the routing bias (e.g. HF's ``e_score_correction_bias``)."""
        with torch.no_grad():
            self.router.expert_bias.copy_(values)
        self._bias_set = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, hidden = x.shape
        flat = x.reshape(-1, hidden)
        route = self.router(flat)
        keep = None
        if self.cfg.capacity_factor is not None:
            keep = _within_capacity(route, self.cfg.num_experts, self.cfg.capacity_factor)
        out = self._routed(flat, route, keep)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_experts_gate is not None:
                shared = torch.sigmoid(self.shared_experts_gate(flat)) * shared
            out = out + shared
        if self.training:
            aux = self._record(route, keep, b, t)
            if aux is not None and self._aux_units is not None:
                out = AuxLossScaler.apply(out, aux, self._aux_units * self._aux_factor)
        return out.view(b, t, hidden)

    def _routed(self, flat: torch.Tensor, route: Routing, keep: torch.Tensor | None) -> torch.Tensor:
        """Sort the N*k (token, expert) assignments by expert, run the experts
        on contiguous rows, and combine each token's k outputs by its weights."""
        n, k = route.experts.shape
        num_experts = self.cfg.num_experts
        assigned = route.experts.reshape(-1)                                  # [N*k]
        if keep is not None:  # dropped assignments sort last, into a group no expert runs
            assigned = torch.where(keep.reshape(-1), assigned, num_experts)
        order = torch.argsort(assigned, stable=True)                          # [N*k]
        counts = torch.zeros(num_experts + (keep is not None), dtype=torch.int64,
                             device=flat.device).scatter_add_(0, assigned, torch.ones_like(assigned))
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(
            order.numel(), device=order.device))
        y_sorted = self.experts(gather_rows(flat, order // k, inverse, k), counts)  # [N*k, H]
        y = gather_rows(y_sorted, inverse, order).view(n, k, -1)              # token-major again
        weights = route.weights
        if keep is not None:
            y = torch.where(keep.unsqueeze(-1), y, 0.0)  # undefined rows, not NaN * 0
            weights = weights * keep
        # a weighted sum over the k experts, in the experts' dtype
        return _Combine.apply(y, weights.to(y.dtype)).to(flat.dtype)

    @torch.compiler.disable
    def _record(self, route: Routing, keep: torch.Tensor | None, b: int,
                t: int) -> torch.Tensor | None:
        """Add this forward's statistics and return its weighted auxiliary
        loss (None when none is on), also kept for :meth:`take_aux_loss`
        outside a pipeline stage."""
        c, e = self.cfg, self.cfg.num_experts
        loads = torch.zeros(e, device=route.experts.device).scatter_add_(
            0, route.experts.reshape(-1), torch.ones(route.experts.numel(), device=route.experts.device))
        # Computed on a recompute too: checkpointing checks that the re-run
        # saves the same tensors for backward as the forward did (and under
        # cp every rank re-runs the same blocks in the same order, so the
        # collective of reduce_stats matches up). loads stay this rank's own.
        raw = balance_losses(route, loads, b, t, c, self.reduce_stats)
        terms = [coeff * raw[name] for name, coeff in c.aux_coeffs.items()]
        aux = torch.stack(terms).sum() if terms else None
        if torch._C._current_graph_task_id() != -1:
            return aux  # inside backward: a recompute of a forward already counted
        if self._aux_units is None:
            self._aux = aux
        with torch.no_grad():
            extra = torch.zeros(NUM_EXTRA_STATS, device=loads.device)
            if keep is not None:
                extra[STAT_DROPPED] = (~keep).sum()
            for slot, key in ((STAT_AUX, "aux_loss"), (STAT_SEQ_AUX, "seq_aux_loss"),
                              (STAT_Z, "z_loss")):
                if key in raw:
                    extra[slot] = raw[key].detach()
            extra[STAT_FORWARDS] = 1
            self.stats.add_(torch.cat([loads, extra]))
        return aux

    def take_aux_loss(self) -> torch.Tensor | None:
        """The coefficient-weighted auxiliary losses of the last training
        forward (a scalar with grad), once; None when none are on."""
        aux, self._aux = self._aux, None
        return aux


class AuxLossScaler(torch.autograd.Function):
    """``output`` unchanged in forward; in backward, ``aux`` (a scalar) gets
    the gradient ``scale`` beside ``output``'s own (Megatron-Core's
    MoEAuxLossAutoScaler). A pipeline stage's auxiliary losses so reach
    its router through its own backward, with no extra value sent between
    stages. ``scale`` is the gradient the engine gives one unit of the loss
    sum (loss scale / the global batch's loss units) times this
    micro-batch's loss units: what ``with_aux_losses`` gives on one process.
    Nothing is saved for backward, so activation recompute sees the same
    saved tensors in its re-run."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor):
        ctx.scale = scale.detach()
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, ctx.scale.to(torch.float32), None


def set_aux_loss_units(module: nn.Module, units: torch.Tensor | None) -> None:
    """Before each forward of a pipeline stage: the loss units (label
    tokens) of the micro-batch it runs, as a 0-dim tensor. While set, the
    MoE layers of ``module`` back-propagate their auxiliary losses
    themselves (:class:`AuxLossScaler`) instead of keeping them for
    :meth:`MoE.take_aux_loss`; None restores that."""
    for layer in moe_layers(module):
        layer._aux_units = units


def set_aux_loss_factor(module: nn.Module, factor: float) -> None:
    """Once per step, by the pipeline runner: the gradient each loss unit
    gets (the loss scale over the global batch's loss units)."""
    for layer in moe_layers(module):
        layer._aux_factor = factor


def _note_loaded_bias(module: MoE, state_dict, prefix, *args) -> None:
    if prefix + "router.expert_bias" in state_dict:
        module._bias_set = True


def _within_capacity(route: Routing, num_experts: int, factor: float) -> torch.Tensor:
    """[N, k] bool: the assignments each expert takes, at most
    ceil(factor * N * k / E) per expert, the highest-weighted first (Megatron's
    "probs" drop policy)."""
    n, k = route.experts.shape
    capacity = math.ceil(factor * n * k / num_experts)
    flat_e, flat_w = route.experts.reshape(-1), route.weights.reshape(-1)
    by_weight = torch.argsort(flat_w, descending=True, stable=True)
    order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]  # by expert, then weight
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_e.device).scatter_add_(
        0, flat_e, torch.ones_like(flat_e))
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=order.device) - start[flat_e[order]]
    keep = torch.empty_like(flat_e, dtype=torch.bool).scatter_(0, order, rank < capacity)
    return keep.view(n, k)


def balance_losses(route: Routing, loads: torch.Tensor, b: int, t: int, cfg: MoEConfig,
                   reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   ) -> dict[str, torch.Tensor]:
    """The raw (unweighted) balance losses that ``cfg`` turns on, over this
    forward's ``b`` x ``t`` tokens; ``loads`` [E] counts each expert's
    assignments. Switch and sequence-wise losses are 1 when perfectly balanced.

    * aux_loss (Switch/GShard, normalised as Megatron-Core):
      E * sum_i f_i * P_i, f_i = loads_i / (N k), P_i = mean probability of i;
    * seq_aux_loss (DeepSeek-V3): the same within each sequence, averaged;
    * z_loss (ST-MoE): mean over tokens of logsumexp(logits)^2.

    Each is built from sums: [tokens, loads E, prob sums E, per-sequence
    counts b x E, per-sequence prob sums b x E, sum of logsumexp^2], only
    the parts whose loss is on. ``reduce`` (context parallelism: these are
    ``t`` tokens of each of ``b`` sequences whose other tokens sit on other
    ranks, sequence i the same one on every rank) sums them over those
    ranks in one call, differentiably: the losses are then those of the
    whole sequences, the same value on every such rank. Each rank weights
    that loss by its own share of the tokens; the reduce's backward sums
    those weights back, so the data-parallel gradient sum over these ranks
    gives the one-process gradient."""
    e, k = cfg.num_experts, cfg.top_k
    probs = route.probs
    parts: dict[str, torch.Tensor] = {}
    if cfg.aux_loss_coeff > 0:
        parts["loads"] = loads.float()
        parts["probs"] = probs.sum(dim=0)
    if cfg.seq_aux_loss_coeff > 0:
        parts["seq_loads"] = torch.zeros(b, e, device=loads.device).scatter_add_(
            1, route.experts.view(b, t * k), torch.ones(b, t * k, device=loads.device)).view(-1)
        parts["seq_probs"] = probs.view(b, t, e).sum(dim=1).view(-1)
    if cfg.z_loss_coeff > 0:
        parts["z"] = torch.logsumexp(route.logits, dim=-1).square().sum().view(1)
    if not parts:
        return {}
    summed = torch.cat([torch.full((1,), float(b * t), device=probs.device), *parts.values()])
    if reduce is not None:
        summed = reduce(summed)
    n, got = summed[0], dict(zip(parts, summed[1:].split([p.numel() for p in parts.values()]),
                                 strict=True))
    out = {}
    if "loads" in got:
        out["aux_loss"] = e * (got["loads"] / (n * k) * (got["probs"] / n)).sum()
    if "seq_loads" in got:
        seq_len = n / b
        f = got["seq_loads"].view(b, e) * e / (k * seq_len)
        out["seq_aux_loss"] = (f * got["seq_probs"].view(b, e) / seq_len).sum(dim=-1).mean()
    if "z" in got:
        out["z_loss"] = got["z"][0] / n
    return out


def update_expert_bias(bias: torch.Tensor, loads: torch.Tensor, rate: float) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): move each expert's bias by
    ``rate`` up when it took fewer than the mean of ``loads`` (one step's
    tokens per expert, summed over the data-parallel ranks), down when more.
    The update is centred so the bias keeps mean zero (choices depend only
    on differences between experts)."""
    with torch.no_grad():
        delta = rate * torch.sign(loads.mean() - loads.float())
        bias.add_(delta - delta.mean())


def moe_layers(module: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of a model (or pipeline stage), in module order."""
    return [m for m in module.modules() if isinstance(m, MoE)]
