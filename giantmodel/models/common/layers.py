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
from giantmodel.models.common.fused import gated, project, rms_norm
from giantmodel.models.common.masks import (
    masked_attention,
    sliding_attention,
    softcap_attention,
    window_band,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 for stability under bf16/fp16; backward keeps
        # x as it came and one fp32 rstd per row (see fused.rms_norm).
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None,
                  long: bool = False) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings over ``head_dim`` rotated
    dimensions, scaled as ``scaling.type`` says.

    Llama 3.1 scaling: wavelengths above original_len/low_freq_factor are
    divided by ``factor``, those below original_len/high_freq_factor are kept,
    and the band between is interpolated smoothly. Linear: every frequency
    divided by ``factor``. LongRoPE: each frequency divided by its own
    factor, from ``long_factor`` when ``long`` else ``short_factor``.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv.float()
    if scaling.type == "linear":
        return (inv / scaling.factor).float()
    if scaling.type == "longrope":
        ext = scaling.long_factor if long else scaling.short_factor
        return (inv / torch.tensor(ext, dtype=torch.float64)).float()
    if scaling.type == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
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
               scaling: RopeScaling | None, device=None, long: bool = False) -> torch.Tensor:
    """``[max_len, head_dim]`` table: cos in the first half, sin in the second
    (``head_dim``: the rotated dimensions). LongRoPE scales both by its
    attention factor, as transformers does (so q.k scales by its square)."""
    inv = rope_inv_freq(head_dim, theta, scaling, long).to(device)
    t = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)  # [max_len, head_dim/2]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    if scaling is not None and scaling.type == "longrope":
        table = table * scaling.longrope_attention_factor()
    if scaling is not None and scaling.type == "yarn":
        table = table * scaling.yarn_attention_factor()
    return table


def yarn_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN (Peng et al. 2023) inverse frequencies over ``dim`` rotated
    dimensions, as transformers computes them (fp32, truncated correction
    range): frequencies that turn more than ``beta_fast`` times over the
    original context are kept, fewer than ``beta_slow`` divided by
    ``factor``, with a linear ramp over the dimensions between."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(scaling.original_max_seq_len / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low)
            / (high - low if high != low else 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    return (1.0 / (scaling.factor * pos)) * (1 - keep) + (1.0 / pos) * keep


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, T, H, D] by ``table`` [T, R] (or [B, T, R]).

    Uses the half-split convention (pairs are (i, i + R/2)), which is the
    layout of Hugging Face Llama checkpoints, so their q/k weights load as-is.
    A table narrower than the head (R < D: partial rotary, Phi-4-mini)
    rotates the first R dimensions and passes the rest through.
    """
    rot = table.shape[-1]
    half = rot // 2
    cos, sin = table[..., :half], table[..., half:]
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:rot]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rot < x.shape[-1]:
        parts.append(xf[..., rot:])
    return torch.cat(parts, dim=-1).type_as(x)


class CausalSDPA(nn.Module):
    """The attention core: softmax(QK^T/sqrt(d)) V with a causal mask, or a
    sliding window of ``window`` keys (each query's own and the window - 1
    before it) when set, and the scores soft-capped (``softcap``, Gemma 2)
    when set: that takes :func:`softcap_attention`'s kernels, never SDPA.

    A module of its own so that context parallelism can replace it and
    selective recompute can checkpoint exactly this part.
    Inputs are [B, H, T, D]; K/V may have fewer heads (GQA).
    """

    def __init__(self, dropout: float = 0.0, window: int | None = None,
                 softcap: float | None = None):
        super().__init__()
        self.dropout = dropout
        self.window = window
        self.softcap = softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask=None) -> torch.Tensor:
        """``mask``: None for plain causal attention, else a packed-sequence
        mask from :func:`giantmodel.models.common.masks.document_mask`."""
        dropout = self.dropout if self.training else 0.0
        if self.softcap is not None:
            return softcap_attention(q, k, v, self.softcap, self.window, mask, dropout)
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
                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the last ``q.shape[2]`` positions over all of ``k``
    (the cached keys first): lower-right aligned, which SDPA's ``is_causal``
    is only when the two lengths are equal. One new token sees every key,
    or the last ``window`` of them."""
    if softcap is not None:  # lower-right aligned too
        # The math path: flex is compiled for fixed shapes, and decoding
        # changes the key length every token (a recompile each).
        return softcap_attention(q, k, v, softcap, window, flex=False)
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
    so tensor parallelism shards heads and replicates it), a sliding
    window (``window``, Mistral; per layer, Gemma), a softmax scale of
    its own (``scale``, Gemma), soft-capped scores (``softcap``, Gemma 2)
    and an RMSNorm on its output (``out_norm_eps``, Gemma's post-attention
    norm)."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 bias: bool = False, dropout: float = 0.0, *, qkv_bias: bool | None = None,
                 qk_norm_eps: float | None = None, window: int | None = None,
                 scale: float | None = None, out_norm_eps: float | None = None,
                 softcap: float | None = None):
        super().__init__()
        self.head_dim = head_dim
        # Every kernel (SDPA, flash varlen, flex, context parallelism's split
        # parts) scales by head_dim ** -0.5; another scale is folded into q.
        self.q_mult = None if scale is None else scale * math.sqrt(head_dim)
        if out_norm_eps is not None:
            self.out_norm = RMSNorm(hidden, out_norm_eps)
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.wq = nn.Linear(hidden, n_heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * head_dim, hidden, bias=bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.window = window
        self.softcap = softcap
        self.core = CausalSDPA(dropout, window, softcap)

    @classmethod
    def from_config(cls, cfg: ModelConfig, dropout: float = 0.0) -> Attention:
        """The attention a llama-style block of ``cfg`` has (the window of
        a per-layer pattern is set by :func:`configure_block`)."""
        return cls(cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head,
                   bias=cfg.attn_bias, dropout=dropout, qkv_bias=cfg.has_qkv_bias,
                   qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None,
                   window=cfg.sliding_window, scale=cfg.attn_scale,
                   out_norm_eps=cfg.norm_eps if cfg.post_norms else None,
                   softcap=cfg.attn_softcap)

    def set_window(self, window: int | None) -> None:
        self.window = window
        self.core.window = window

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None,
                mask=None, cache: _LayerCache | None = None) -> torch.Tensor:
        """``cache`` (generation only): this layer's :class:`KVCache` entry;
        ``x`` then holds only the new tokens and ``rope`` their positions."""
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism the projections are column
        # shards. One GEMM and one saved input for the three (fused.project).
        q, k, v = (t.view(B, T, -1, self.head_dim)
                   for t in project(self, x, (self.wq, self.wk, self.wv)))
        if hasattr(self, "q_norm"):  # per head: [B, T, H, D] normalised over D
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
            if not hasattr(self, "q_norm"):
                # q and k are tensors of their own now; v, a view, would keep
                # the whole fused q|k|v output alive for backward.
                v = v.contiguous()
        if self.q_mult is not None:
            q = q * self.q_mult
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            out = cached_attention(q, *cache.update(k, v), window=self.window,
                                   softcap=self.softcap)
        else:
            # The mask goes only where there is one, so a replaced core
            # (context parallelism) keeps its three-argument signature.
            out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask=mask)
        out = project(self.wo, out.transpose(1, 2).reshape(B, T, -1), (self.wo,))[0]
        return self.out_norm(out) if hasattr(self, "out_norm") else out


class SoftcapLinear(nn.Linear):
    """The output head of a model with ``final_softcap`` (Gemma 2): logits
    -> tanh(logits / cap) * cap. A Linear still (tensor parallelism shards
    it alike: the cap is elementwise), but the fused losses, which take the
    bare weight, see ``softcap`` and run the plain loss."""

    def __init__(self, in_features: int, out_features: int, softcap: float):
        super().__init__(in_features, out_features, bias=False)
        self.softcap = softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x) / self.softcap) * self.softcap


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


class SwiGLU(nn.Module):
    """LLaMA's gated MLP: w2(act(w1 x) * w3 x), act SiLU (SwiGLU) or the
    tanh GELU (GeGLU, Gemma); ``out_norm_eps``: an RMSNorm on its output
    (Gemma's post-feed-forward norm)."""

    def __init__(self, hidden: int, ffn: int, activation: str = "silu",
                 out_norm_eps: float | None = None):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.act = ACTIVATIONS[activation]
        if out_norm_eps is not None:
            self.out_norm = RMSNorm(hidden, out_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self, x, (self.w1, self.w3))
        out = project(self.w2, gated(self.act, gate, up), (self.w2,))[0]
        return self.out_norm(out) if hasattr(self, "out_norm") else out


def configure_block(block: nn.Module, cfg: ModelConfig, index: int) -> None:
    """Give a llama-style block what depends on its global layer ``index``
    (the window of a local/global pattern) or on fields its constructor
    does not read (the MLP's activation and output norm). Keyed by the
    global index, so a pipeline stage holding layers 3..5 windows the
    same layers as one process."""
    block.attention.set_window(cfg.window_of(index))
    ff = getattr(block, "feed_forward", None)
    if isinstance(ff, SwiGLU) and (cfg.mlp_activation != "silu" or cfg.post_norms):
        with torch.device(ff.w1.weight.device):
            block.feed_forward = SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size, cfg.mlp_activation,
                                        cfg.norm_eps if cfg.post_norms else None)


class GeluMLP(nn.Module):
    """GPT MLP: w2(gelu(w1 x)), with biases (tanh GELU, as GPT-2 used)."""

    def __init__(self, hidden: int, ffn: int, dropout: float = 0.0):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn)
        self.w2 = nn.Linear(ffn, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.gelu(self.w1(x), approximate="tanh")))
