"""Context parallelism: causal attention over a sequence split across ranks.

Causal load balancing: the sequence is cut into ``2*cp`` equal chunks and cp
rank ``i`` keeps chunks ``i`` and ``2*cp-1-i``, so every rank holds the same
amount of the causal triangle's work. Each rank projects Q/K/V for its own
tokens; K and V, stacked, are all-gathered across the cp group in one
collective (the backward is one reduce-scatter of their gradients). The
gathered keys are put in position order, and each of a rank's two chunks
attends to the keys up to its own end: a rank computes (2cp + 1) / (4cp) of
its queries x all keys, not all of it. Chunks are aligned with the causal
mask, so each chunk's keys are a fully visible part (the chunks before it)
and its own diagonal block (square causal); the two run as fused kernels
with no mask tensor and are merged by their log-sum-exps.

Each collective is waited on before its result leaves the autograd
function. The earlier form, ``all_gather_single_autograd`` (an
AsyncCollectiveTensor whose wait is deferred to first use, under autograd),
aborted a rank about once per 15 000 CP attention steps on gloo with heap
corruption (``malloc(): unaligned tcache chunk detected``; a gloo worker
thread then crashed inside ``tcache_get``). Raw functional all-gathers with
four in flight at once ran 20 000 steps clean, so the deferred-wait autograd
path, not gloo's concurrency, is what the fix removes.

``torch.distributed.tensor.experimental.context_parallel`` targets the CUDA
flash/efficient SDPA kernels, so this module implements the all-gather form
directly; it runs on gloo and NCCL alike, and on the CPU through the CPU
flash kernel. Attention dropout keeps the older masked call.

MoE layers compute their balance losses from statistics summed over the cp
ranks (``MoE.reduce_stats``), so they equal the one-process losses.

A sliding window (Mistral) restricts each chunk to the keys from its first
query's window on: chunks wholly outside are never read, and the rest run
:func:`giantmodel.models.common.masks.sliding_attention` (no T x T mask).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from giantmodel.models.common.masks import sliding_attention
from giantmodel.models.common.moe import moe_layers
from giantmodel.parallel.collectives import all_reduce_sum_autograd


def balanced_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Absolute positions [seq_len / cp] held by cp rank ``rank``."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last_idx = 2 * cp - 1 - rank
    second = torch.arange(last_idx * chunk, (last_idx + 1) * chunk, device=device)
    return torch.cat([first, second])


def shard_sequence(t: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's two load-balanced chunks of ``t`` [B, T, ...] along dim 1."""
    chunks = t.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)


class _GatherKV(torch.autograd.Function):
    """All-gather of stacked K and V along the sequence; backward: reduce-scatter.

    ``kv`` is [2, B, H, t, D]; the result is [2, B, H, world*t, D] with the
    ranks' blocks in rank order. Both directions wait for their collective
    before returning, so no collective is in flight once autograd sees a tensor.
    """

    @staticmethod
    def forward(ctx, kv: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        # Collectives concatenate along dim 0: put t there.
        return _gather_dim0(kv.movedim(3, 0).contiguous(), group).movedim(0, 3)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_dim0(grad.movedim(3, 0).contiguous(), ctx.group).movedim(0, 3), None


def _gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    # The functional op (not dist.all_gather_into_tensor) so that selective
    # recompute can cache its result instead of running the collective twice.
    ops = torch.ops._c10d_functional
    out = ops.all_gather_into_tensor(x, dist.get_world_size(group), group.group_name)
    return ops.wait_tensor(out)


def _reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    ops = torch.ops._c10d_functional
    out = ops.reduce_scatter_tensor(x, "sum", dist.get_world_size(group), group.group_name)
    return ops.wait_tensor(out)


def all_gather_kv(k: torch.Tensor, v: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [B, H, t, D] gathered along t over ``group`` in one collective:
    [B, H, world*t, D] each, rank-major blocks (collective: every cp rank calls it)."""
    k_all, v_all = _GatherKV.apply(torch.stack([k, v]), group).unbind(0)
    return k_all, v_all


class ContextParallelSDPA(nn.Module):
    """Drop-in for ``CausalSDPA`` on a cp rank holding balanced chunks."""

    def __init__(self, inner: nn.Module, cp_mesh):
        super().__init__()
        self.dropout = getattr(inner, "dropout", 0.0)
        self.window = getattr(inner, "window", None)
        self.cp_mesh = cp_mesh

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = self.cp_mesh.get_group()
        cp, rank = self.cp_mesh.size(), self.cp_mesh.get_local_rank()
        chunk = q.shape[2] // 2
        seq = 2 * chunk * cp
        k_all, v_all = all_gather_kv(k, v, group)
        # Gathered keys sit in rank order, each rank's block being its two
        # chunks; put them in position order, so that each local chunk reads
        # only the keys up to its own end: (2cp + 1) / (4cp) of the work of
        # every local query against every key (5/8 at cp 2, toward 1/2).
        k_pos = torch.cat([balanced_positions(seq, cp, r, q.device) for r in range(cp)])
        order = torch.argsort(k_pos)
        k_all, v_all = k_all.index_select(2, order), v_all.index_select(2, order)
        outs = []
        for i, index in enumerate((rank, 2 * cp - 1 - rank)):
            end = (index + 1) * chunk
            q_i = q[:, :, i * chunk:(i + 1) * chunk]
            if self.window is not None and end > self.window:
                # A sliding window: only the keys from the chunk's first
                # query's window on are visible, whatever chunks lie before.
                start = max(0, index * chunk - self.window + 1)
                outs.append(sliding_attention(q_i, k_all[:, :, start:end], v_all[:, :, start:end],
                                              self.window, self.dropout if self.training else 0.0))
                continue
            outs.append(self._attend(q_i, k_all[:, :, :end], v_all[:, :, :end]))
        return torch.cat(outs, dim=2)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the last ``q.shape[2]`` positions of ``k``'s span.

        Chunk-aligned, the span splits into keys every query sees (all before
        the chunk) and the chunk's own keys under a square causal mask (the
        diagonal block); keys after the chunk were never taken. Each part
        runs a fused kernel with no mask tensor, and the two are merged by
        their log-sum-exps (:class:`_SplitCausalAttention`). An explicit
        [rows, span] boolean mask would send SDPA to its math path, which
        with GQA also repeats K/V and holds the scores: quadratic memory
        exactly where context parallelism is used."""
        rows, span = q.shape[2], k.shape[2]
        gqa = q.shape[1] != k.shape[1]
        dropout = self.dropout if self.training else 0.0
        if rows == span:  # the first chunk: its diagonal block only
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa,
                                                  dropout_p=dropout)
        if not dropout and _lse_kernel(q) is not None:
            return _SplitCausalAttention.apply(q, k, v, span - rows)
        # Attention dropout: the merged kernels would need each part's RNG
        # replayed in backward; this (rare: GPT configs with dropout) keeps
        # the masked call, lower-right causal: query j sits at key j + span - rows.
        mask = torch.ones(rows, span, dtype=torch.bool, device=q.device).tril(span - rows)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa,
                                              dropout_p=dropout)


# ---------------------------------------------------------------- fused parts
# SDPA's public function returns no log-sum-exp, so the parts call the aten
# kernels behind it, which do (the same ones torch's own ring attention in
# torch.distributed.tensor.experimental calls; present, with these
# signatures, in torch 2.11 and 2.13). Backward calls each kernel's backward
# with the *merged* output and log-sum-exp: that is exactly the part's share
# of dq, dk and dv (the softmax rows are recomputed against the global
# normaliser), as in ring flash attention.
_aten = torch.ops.aten


def _lse_kernel(q: torch.Tensor) -> str | None:
    """Which aten kernel serves ``q``'s device and dtype: "cpu" (the CPU
    flash kernel), "flash" (CUDA sm80+, half precision, head dim a multiple
    of 8 up to 256), "efficient" (CUDA otherwise), None (elsewhere)."""
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type != "cuda":
        return None
    d = q.shape[-1]
    # FlashAttention-2 needs Ampere or later; older GPUs take the efficient kernel.
    ampere = torch.cuda.get_device_capability(q.device)[0] >= 8
    if ampere and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256:
        return "flash"
    return "efficient"


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _part_forward(kind: str, q, k, v, causal: bool):
    """(out, lse [B, H, T] fp32-able, state for the backward) of one part.
    The CPU and CUDA flash kernels take K/V with fewer heads (GQA) as they
    are; the efficient kernel needs them repeated."""
    if kind == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse, ()
    if kind == "flash":
        out, lse, cq, ck, mq, mk, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal)
        return out, lse, (cq, ck, mq, mk, seed, offset)
    heads = q.shape[1]
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
        q, _repeat_kv(k, heads), _repeat_kv(v, heads), None, True, 0.0, causal)
    # its log-sum-exp is padded along T to a multiple of 32
    return out, lse[..., :q.shape[2]], (seed, offset, lse.shape[-1])


def _part_backward(kind: str, dout, q, k, v, out, lse, causal: bool, state):
    if kind == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal)
    if kind == "flash":
        cq, ck, mq, mk, seed, offset = state
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset)
    seed, offset, padded = state
    heads, kv_heads = q.shape[1], k.shape[1]
    lse = F.pad(lse, (0, padded - lse.shape[-1])).contiguous()
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, _repeat_kv(k, heads), _repeat_kv(v, heads), None, out, lse, seed, offset,
        0.0, [True, True, True, False], causal)
    if kv_heads != heads:  # sum each group's gradients back onto its shared head
        B, _, S, D = dk.shape
        dk = dk.view(B, kv_heads, heads // kv_heads, S, D).sum(2)
        dv = dv.view(B, kv_heads, heads // kv_heads, S, D).sum(2)
    return dq, dk, dv


class _SplitCausalAttention(torch.autograd.Function):
    """Attention of query chunk ``q`` [B, H, c, D] over ``k``/``v`` [B, Hkv,
    split + c, D]: keys [0, split) fully visible, the last c keys causal
    (the chunk's diagonal block). Two fused calls merged by log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, split: int):
        kind = _lse_kernel(q)
        parts = ((k[:, :, :split], v[:, :, :split], False),
                 (k[:, :, split:], v[:, :, split:], True))
        results = [_part_forward(kind, q, pk, pv, causal) for pk, pv, causal in parts]
        (o1, l1, s1), (o2, l2, s2) = results
        l1, l2 = l1.float(), l2.float()
        lse = torch.logaddexp(l1, l2)
        out = (o1.float() * torch.exp(l1 - lse).unsqueeze(-1)
               + o2.float() * torch.exp(l2 - lse).unsqueeze(-1)).to(q.dtype)
        lse = lse.to(results[0][1].dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kind, ctx.split, ctx.states = kind, split, (s1, s2)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        split, dout = ctx.split, dout.contiguous()
        grads = [_part_backward(ctx.kind, dout, q, k[:, :, sl], v[:, :, sl], out, lse, causal,
                                state)
                 for sl, causal, state in ((slice(0, split), False, ctx.states[0]),
                                           (slice(split, None), True, ctx.states[1]))]
        (dq1, dk1, dv1), (dq2, dk2, dv2) = grads
        return dq1 + dq2, torch.cat([dk1, dk2], dim=2), torch.cat([dv1, dv2], dim=2), None


def apply_context_parallel(blocks: list[nn.Module], cp_mesh) -> None:
    """Replace each block's attention core with the context-parallel one, and
    have its MoE feed-forward, if any, compute the balance losses over whole
    sequences (one small all-reduce over cp per MoE layer and forward)."""
    reduce = _SumOverCP(cp_mesh)
    for block in blocks:
        inner = _unwrap(block).attention
        inner.core = ContextParallelSDPA(inner.core, cp_mesh)
        for layer in moe_layers(block):
            layer.reduce_stats = reduce


class _SumOverCP:
    """An MoE layer's ``reduce_stats``: a differentiable sum over the cp
    ranks, which hold the other chunks of the same sequences."""

    def __init__(self, cp_mesh):
        self.cp_mesh = cp_mesh

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum_autograd(t, self.cp_mesh.get_group())


def _unwrap(module: nn.Module) -> nn.Module:
    return getattr(module, "_checkpoint_wrapped_module", module)
