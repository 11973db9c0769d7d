"""Context parallelism: causal attention over a sequence split across ranks.

Causal load balancing: the sequence is cut into ``2*cp`` equal chunks and cp
rank ``i`` keeps chunks ``i`` and ``2*cp-1-i``, so every rank holds the same
amount of the causal triangle's work. Each rank projects Q/K/V for its own
tokens; K and V are all-gathered across the cp group (the backward is a
reduce-scatter of their gradients) and every local query attends to the
gathered keys at positions not after its own.

``torch.distributed.tensor.experimental.context_parallel`` targets the CUDA
flash/efficient SDPA kernels, so this module implements the all-gather form
directly; it runs on gloo and NCCL alike.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


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


def all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-gather of [B, H, t, D] along t (backward: reduce-scatter)."""
    # torch >= 2.13 names it all_gather_single_autograd; older ones, ..._tensor_...
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    # The collective concatenates along dim 0: put t there, gather, move back.
    stacked = gather(x.movedim(2, 0).contiguous(), 0, group)
    return stacked.movedim(0, 2)  # [B, H, world*t, D], rank-major blocks


class ContextParallelSDPA(nn.Module):
    """Drop-in for ``CausalSDPA`` on a cp rank holding balanced chunks."""

    def __init__(self, inner: nn.Module, cp_mesh):
        super().__init__()
        self.dropout = getattr(inner, "dropout", 0.0)
        self.cp_mesh = cp_mesh

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = self.cp_mesh.get_group()
        cp, rank = self.cp_mesh.size(), self.cp_mesh.get_local_rank()
        t_local = q.shape[2]
        seq = t_local * cp
        k_all, v_all = all_gather_seq(k, group), all_gather_seq(v, group)
        q_pos = balanced_positions(seq, cp, rank, q.device)
        # Gathered keys sit in rank order, each rank's block being its two chunks.
        k_pos = torch.cat([balanced_positions(seq, cp, r, q.device) for r in range(cp)])
        mask = k_pos[None, :] <= q_pos[:, None]
        return F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1],
            dropout_p=self.dropout if self.training else 0.0)


def apply_context_parallel(blocks: list[nn.Module], cp_mesh) -> None:
    """Replace each block's attention core with the context-parallel one."""
    for block in blocks:
        inner = _unwrap(block).attention
        inner.core = ContextParallelSDPA(inner.core, cp_mesh)


def _unwrap(module: nn.Module) -> nn.Module:
    return getattr(module, "_checkpoint_wrapped_module", module)
