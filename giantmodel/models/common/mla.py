"""Multi-head latent attention (MLA, DeepSeek-V2/V3), a plain ``nn.Module``.

Per token, with H heads (Hugging Face ``DeepseekV3Attention`` names in brackets):

* query: ``wq`` [H*(n+r), hidden] (``q_proj``), or low-rank ``wq_a`` [q_rank,
  hidden] (``q_a_proj``), an RMSNorm ``q_norm`` (``q_a_layernorm``) and
  ``wq_b`` [H*(n+r), q_rank] (``q_b_proj``); each head is n unrotated then
  r rotated dimensions;
* ``wkv_a`` [kv_rank + r, hidden] (``kv_a_proj_with_mqa``) gives a latent of
  kv_rank, normalised by ``kv_norm`` (``kv_a_layernorm``), and one rotated
  key of r dimensions that every head shares;
* ``wkv_b`` [H*(n+v), kv_rank] (``kv_b_proj``) expands the latent into each
  head's n key and v value dimensions; ``wo`` [hidden, H*v] (``o_proj``).

Keys are computed in full (no latent cache trick): training runs the same
kernel (``CausalSDPA``, a value width of its own) as standard attention.
Heads are inferred from the projected tensors, as :class:`Attention` does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from giantmodel.config.model import ModelConfig
from giantmodel.models.common.layers import (
    CausalSDPA,
    RMSNorm,
    _LayerCache,
    apply_rope,
    cached_attention,
)

# HF's DeepseekV3RMSNorm default: the latent norms do not take rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLA(nn.Module):
    """Multi-head latent attention of one block; see the module docstring."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m, hidden, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_rank = m.kv_lora_rank
        self.interleave = m.rope_interleave
        q_out = heads * m.qk_head_dim
        if m.q_lora_rank is None:
            self.wq = nn.Linear(hidden, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(hidden, m.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(m.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(hidden, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim),
                               bias=False)
        self.wo = nn.Linear(heads * m.v_head_dim, hidden, bias=False)
        # The kernels scale by qk_head_dim ** -0.5; YaRN's softmax mscale
        # (DeepSeek's mscale_all_dim) is folded into q, as Attention does.
        mult = cfg.rope_scaling.softmax_mscale() if cfg.rope_scaling is not None else 1.0
        self.q_mult = None if math.isclose(mult, 1.0) else mult
        self.window = None
        self.core = CausalSDPA(0.0)

    def set_window(self, window: int | None) -> None:
        if window is not None:
            raise ValueError("multi-head latent attention has no sliding window")

    def _rotate(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        """RoPE over x [B, T, H, r]. DeepSeek's weights pair interleaved
        dimensions (0, 1), (2, 3), ...: gathering evens then odds makes them
        the half-split pairs apply_rope rotates, and HF's own interleaved
        rotation returns this same order, so q.k is unchanged."""
        if self.interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return x if rope is None else apply_rope(x, rope)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None,
                mask=None, cache: _LayerCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(B, T, -1, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(B, T, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = kv.shape[2]
        k_rot = self._rotate(k_rot.view(B, T, 1, self.rope_dim), rope)
        q = torch.cat([q_nope, self._rotate(q_rot, rope)], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(B, T, heads, self.rope_dim)], dim=-1)
        if self.q_mult is not None:
            q = q * self.q_mult
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            out = cached_attention(q, *cache.update(k, v))
        else:
            out = self._attend(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """The core on [B, H, T, D] tensors. Plain SDPA takes a value width
        of its own; the packed-sequence kernels (varlen reshapes v by q's
        width) and a replaced core (context parallelism) may not, so there v
        is zero-padded to the query/key width and the output cut back: the
        padded columns only ever produce zeros."""
        if mask is None and type(self.core) is CausalSDPA:
            return self.core(q, k, v)
        pad = q.shape[-1] - v.shape[-1]
        if pad > 0:
            v = torch.nn.functional.pad(v, (0, pad))
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask=mask)
        return out[..., :self.v_dim] if pad > 0 else out
