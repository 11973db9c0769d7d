"""Building blocks shared by the model zoo: norms, RoPE, attention, MLPs.

Plain ``nn.Module``s with no torch.distributed: tensor/sequence/context
parallelism is applied from outside (giantmodel.parallel). To make that work,
attention infers its local head counts from the projected tensors rather than
from the config, so a column-sharded ``wq`` simply yields fewer heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from giantmodel.config.model import ModelConfig, RopeScaling
from giantmodel.models.common.masks import masked_attention, sliding_attention, window_band


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability under bf16/fp16 autocast.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).type_as(x)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with Llama-3 scaling if asked.

    Llama 3.1 scaling: wavelengths above original_len/low_freq_factor are
    divided by ``factor``, those below original_len/high_freq_factor are kept,
    and the band between is interpolated smoothly.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv.float()
    wavelen = 2 * math.pi / inv
    low_wl = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wl = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv / scaling.factor + smooth * inv
    out = torch.where(wavelen > low_wl, inv / scaling.factor, inv)
    between = (wavelen <= low_wl) & (wavelen >= high_wl)
    out = torch.where(between, interpolated, out)
    return out.float()


def rope_table(head_dim: int, max_len: int, theta: float,
               scaling: RopeScaling | None, device=None) -> torch.Tensor:
    """``[max_len, head_dim]`` table: cos in the first half, sin in the second."""
    inv = rope_inv_freq(head_dim, theta, scaling).to(device)
    t = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)  # [max_len, head_dim/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, T, H, D] by ``table`` [T, D] (or [B, T, D]).

    Uses the half-split convention (pairs are (i, i + D/2)), which is the
    layout of Hugging Face Llama checkpoints, so their q/k weights load as-is.
    """
    half = x.shape[-1] // 2
    cos, sin = table[..., :half], table[..., half:]
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.type_as(x)


class CausalSDPA(nn.Module):
    """The attention core: softmax(QK^T/sqrt(d)) V with a causal mask, or a
    sliding window of ``window`` keys (each query's own and the window - 1
    before it) when set.

    A module of its own so that context parallelism can replace it and
    selective recompute can checkpoint exactly this part.
    Inputs are [B, H, T, D]; K/V may have fewer heads (GQA).
    """

    def __init__(self, dropout: float = 0.0, window: int | None = None):
        super().__init__()
        self.dropout = dropout
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask=None) -> torch.Tensor:
        """``mask``: None for plain causal attention, else a packed-sequence
        mask from :func:`giantmodel.models.common.masks.document_mask`."""
        dropout = self.dropout if self.training else 0.0
        if mask is not None:
            return masked_attention(q, k, v, mask, dropout, window=self.window)
        if self.window is not None and q.shape[2] > self.window:
            return sliding_attention(q, k, v, self.window, dropout)
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=gqa, dropout_p=dropout)


class KVCache:
    """Keys and values of the tokens already seen, per layer, for generation.

    Each layer's entry grows by the new tokens' K/V [B, Hkv, t, D] at every
    step (``torch.cat``: one copy per step, negligible next to the forward it
    replaces for the short contexts ``giantmodel generate`` serves). Training
    never passes one: its path is unchanged."""

    def __init__(self):
        self._kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.length = 0
        """Tokens cached so far (the next token's position)."""

    def layer(self, name: str) -> _LayerCache:
        return _LayerCache(self, name)

    def advance(self, tokens: int) -> None:
        self.length += tokens


class _LayerCache:
    def __init__(self, cache: KVCache, name: str):
        self.cache, self.name = cache, name

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's ``k``/``v`` [B, H, t, D]; all of them so far."""
        old = self.cache._kv.get(self.name)
        if old is not None:
            k, v = torch.cat([old[0], k], dim=2), torch.cat([old[1], v], dim=2)
        self.cache._kv[self.name] = (k, v)
        return k, v


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     window: int | None = None) -> torch.Tensor:
    """Causal attention of the last ``q.shape[2]`` positions over all of ``k``
    (the cached keys first): lower-right aligned, which SDPA's ``is_causal``
    is only when the two lengths are equal. One new token sees every key,
    or the last ``window`` of them."""
    rows, span = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if window is not None and span > window:
        mask = window_band(rows, span, window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if rows == span or rows == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=rows > 1, enable_gqa=gqa)
    mask = torch.ones(rows, span, dtype=torch.bool, device=q.device).tril(span - rows)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Attention(nn.Module):
    """Multi-head / grouped-query attention with the variants the families
    need: biases on all four projections (``bias``) or on q/k/v only
    (``qkv_bias``, Qwen2), an RMSNorm over each head of q and k before RoPE
    (``qk_norm_eps`` set, Qwen3; one weight [head_dim] shared by the heads,
    so tensor parallelism shards heads and replicates it) and a sliding
    window (``window``, Mistral)."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 bias: bool = False, dropout: float = 0.0, *, qkv_bias: bool | None = None,
                 qk_norm_eps: float | None = None, window: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.wq = nn.Linear(hidden, n_heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * head_dim, hidden, bias=bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.window = window
        self.core = CausalSDPA(dropout, window)

    @classmethod
    def from_config(cls, cfg: ModelConfig, dropout: float = 0.0) -> Attention:
        """The attention a llama-style block of ``cfg`` has."""
        return cls(cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head,
                   bias=cfg.attn_bias, dropout=dropout, qkv_bias=cfg.has_qkv_bias,
                   qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None,
                   window=cfg.sliding_window)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None,
                mask=None, cache: _LayerCache | None = None) -> torch.Tensor:
        """``cache`` (generation only): this layer's :class:`KVCache` entry;
        ``x`` then holds only the new tokens and ``rope`` their positions."""
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism the projections are column shards.
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if hasattr(self, "q_norm"):  # per head: [B, T, H, D] normalised over D
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            out = cached_attention(q, *cache.update(k, v), window=self.window)
            return self.wo(out.transpose(1, 2).reshape(B, T, -1))
        # The mask goes only where there is one, so a replaced core (context
        # parallelism) keeps its three-argument signature.
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask=mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """LLaMA MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeluMLP(nn.Module):
    """GPT MLP: w2(gelu(w1 x)), with biases (tanh GELU, as GPT-2 used)."""

    def __init__(self, hidden: int, ffn: int, dropout: float = 0.0):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn)
        self.w2 = nn.Linear(ffn, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.gelu(self.w1(x), approximate="tanh")))
