"""Layers shared by the UNet and the VAE: resnets, attention, transformers, resampling.

Module and parameter names follow diffusers (``resnets.0.norm1``,
``attentions.0.transformer_blocks.0.attn1.to_q``) so that a diffusers
state dict loads key for key; the math is written here, on
``scaled_dot_product_attention``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def timestep_embedding(timesteps: torch.Tensor, dim: int, flip_sin_to_cos: bool = True,
                       freq_shift: float = 0.0, max_period: int = 10000) -> torch.Tensor:
    """Sinusoidal embedding [N, dim] of (possibly fractional) timesteps [N]."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32,
                                                    device=timesteps.device)
    freqs = torch.exp(exponent / (half - freq_shift))
    args = timesteps[:, None].float() * freqs[None, :]
    emb = torch.cat([args.sin(), args.cos()], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class TimestepEmbedding(nn.Module):
    """linear -> SiLU -> linear: the timestep MLP whose output feeds every resnet."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class ResnetBlock2D(nn.Module):
    """GroupNorm-SiLU-conv twice, the (SiLU'd, projected) time embedding added
    between; a 1x1 conv shortcut when the width changes."""

    def __init__(self, in_ch: int, out_ch: int, temb_ch: int | None, groups: int, eps: float,
                 dropout: float = 0.0):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch, eps=eps)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb_ch, out_ch) if temb_ch is not None else None
        self.norm2 = nn.GroupNorm(groups, out_ch, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        if self.time_emb_proj is not None and temb is not None:
            h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return x + h


class Downsample2D(nn.Module):
    """Stride-2 3x3 conv. ``pad_right`` (the VAE's variant) pads only right and
    bottom by one instead of one on every side."""

    def __init__(self, ch: int, pad_right: bool = False):
        super().__init__()
        self.pad_right = pad_right
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=0 if pad_right else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_right:
            x = F.pad(x, (0, 1, 0, 1))
        return self.conv(x)


class Upsample2D(nn.Module):
    """Nearest-neighbour 2x (or to ``size``, when the skip connection is odd-sized), then a 3x3 conv."""

    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.bfloat16:  # nearest upsampling has no bf16 kernel on some backends
            x = x.float()
        if size is None:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        else:
            x = F.interpolate(x, size=size, mode="nearest")
        return self.conv(x.to(dtype))


class Attention(nn.Module):
    """Multi-head attention over [B, L, C] with SDPA. Self-attention when
    ``context`` is None, cross-attention on ``context`` [B, S, context_dim]
    otherwise. Head count is inferred from ``head_dim`` and the projected
    width, so a column-sharded projection simply yields fewer heads."""

    def __init__(self, dim: int, heads: int, head_dim: int, context_dim: int | None = None,
                 qkv_bias: bool = False, upcast: bool = False):
        super().__init__()
        inner = heads * head_dim
        self.head_dim = head_dim
        self.upcast = upcast
        self.to_q = nn.Linear(dim, inner, bias=qkv_bias)
        self.to_k = nn.Linear(context_dim or dim, inner, bias=qkv_bias)
        self.to_v = nn.Linear(context_dim or dim, inner, bias=qkv_bias)
        # ModuleList (not one Linear) so the weights are named to_out.0.*, as in diffusers
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        B, L, _ = x.shape
        ctx = x if context is None else context
        q = self.to_q(x).view(B, L, -1, self.head_dim).transpose(1, 2)
        k = self.to_k(ctx).view(B, ctx.shape[1], -1, self.head_dim).transpose(1, 2)
        v = self.to_v(ctx).view(B, ctx.shape[1], -1, self.head_dim).transpose(1, 2)
        dtype = q.dtype
        if self.upcast and dtype != torch.float32:
            with torch.autocast(x.device.type, enabled=False):
                out = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out[0](out.transpose(1, 2).reshape(B, L, -1))


class GEGLU(nn.Module):
    """proj to 2x width, split into value and gate, value * GELU(gate)."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, inner * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.proj(x).chunk(2, dim=-1)
        return value * F.gelu(gate)


class FeedForward(nn.Module):
    """GEGLU -> dropout -> linear, named ``net.0`` / ``net.2`` as in diffusers."""

    def __init__(self, dim: int, mult: int = 4, dropout: float = 0.0):
        super().__init__()
        inner = dim * mult
        self.net = nn.ModuleList([GEGLU(dim, inner), nn.Dropout(dropout), nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class BasicTransformerBlock(nn.Module):
    """Pre-LayerNorm self-attention, cross-attention on the text, GEGLU feed-forward."""

    def __init__(self, dim: int, heads: int, head_dim: int, context_dim: int,
                 dropout: float = 0.0, upcast: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim, upcast=upcast)
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = Attention(dim, heads, head_dim, context_dim, upcast=upcast)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, dropout=dropout)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class Transformer2D(nn.Module):
    """Image features [B, C, H, W] through transformer blocks over the H*W
    positions, with a residual around the whole. Projections in and out are
    1x1 convs (SD 1.x) or linears (SD 2.x, ``linear_projection``)."""

    def __init__(self, ch: int, heads: int, context_dim: int, groups: int, layers: int = 1,
                 linear_projection: bool = False, dropout: float = 0.0, upcast: bool = False):
        super().__init__()
        self.linear_projection = linear_projection
        self.norm = nn.GroupNorm(groups, ch, eps=1e-6)
        proj = (lambda: nn.Linear(ch, ch)) if linear_projection else (lambda: nn.Conv2d(ch, ch, 1))
        self.proj_in = proj()
        self.transformer_blocks = nn.ModuleList(
            [BasicTransformerBlock(ch, heads, ch // heads, context_dim, dropout, upcast)
             for _ in range(layers)])
        self.proj_out = proj()

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        h = self.norm(x)
        if not self.linear_projection:
            h = self.proj_in(h)
        h = h.permute(0, 2, 3, 1).reshape(B, H * W, C)
        if self.linear_projection:
            h = self.proj_in(h)
        for block in self.transformer_blocks:
            h = block(h, context)
        if self.linear_projection:
            h = self.proj_out(h)
        h = h.reshape(B, H, W, C).permute(0, 3, 1, 2).contiguous()
        if not self.linear_projection:
            h = self.proj_out(h)
        return h + x


class SpatialSelfAttention(nn.Module):
    """The VAE's single-head self-attention over H*W positions: GroupNorm,
    biased q/k/v projections, residual. Named like diffusers' Attention with
    ``group_norm`` (to_q, to_k, to_v, to_out.0, group_norm)."""

    def __init__(self, ch: int, groups: int, eps: float = 1e-6):
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, ch, eps=eps)
        self.to_q = nn.Linear(ch, ch)
        self.to_k = nn.Linear(ch, ch)
        self.to_v = nn.Linear(ch, ch)
        self.to_out = nn.ModuleList([nn.Linear(ch, ch)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        h = self.group_norm(x).view(B, C, H * W).transpose(1, 2)  # [B, HW, C]
        q, k, v = (proj(h).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1)
        out = self.to_out[0](out)
        return out.transpose(1, 2).reshape(B, C, H, W) + x
