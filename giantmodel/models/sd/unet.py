"""The Stable Diffusion denoiser: a UNet conditioned on a timestep and text.

Same structure and parameter names as diffusers' ``UNet2DConditionModel``
for SD 1.x and 2.x: ``conv_in``, ``time_embedding``, ``down_blocks.{i}``
(resnets, optional cross-attention transformers, a stride-2 downsampler),
``mid_block`` (resnet, transformer, resnet), ``up_blocks.{i}`` (one more
resnet than down, each fed a skip connection; nearest upsampler) and the
GroupNorm-SiLU-conv head. Every block is a unit for recompute and FSDP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from giantmodel.config.sd import UNetConfig
from giantmodel.models.sd.blocks import (
    Downsample2D,
    ResnetBlock2D,
    TimestepEmbedding,
    Transformer2D,
    Upsample2D,
    timestep_embedding,
)


def _transformer(cfg: UNetConfig, ch: int, heads: int) -> Transformer2D:
    return Transformer2D(ch, heads, cfg.cross_attention_dim, cfg.norm_num_groups,
                         cfg.transformer_layers_per_block, cfg.use_linear_projection,
                         cfg.dropout, cfg.upcast_attention)


class DownBlock(nn.Module):
    """CrossAttnDownBlock2D (``attentions`` set) or DownBlock2D."""

    def __init__(self, cfg: UNetConfig, in_ch: int, out_ch: int, temb_ch: int, heads: int,
                 cross_attn: bool, downsample: bool):
        super().__init__()
        g, eps, n = cfg.norm_num_groups, cfg.norm_eps, cfg.layers_per_block
        self.resnets = nn.ModuleList([ResnetBlock2D(in_ch if i == 0 else out_ch, out_ch, temb_ch,
                                                    g, eps, cfg.dropout) for i in range(n)])
        self.attentions = (nn.ModuleList([_transformer(cfg, out_ch, heads) for _ in range(n)])
                           if cross_attn else None)
        self.downsamplers = nn.ModuleList([Downsample2D(out_ch)]) if downsample else None

    def forward(self, h: torch.Tensor, temb: torch.Tensor, context: torch.Tensor
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        skips = []
        for i, resnet in enumerate(self.resnets):
            h = resnet(h, temb)
            if self.attentions is not None:
                h = self.attentions[i](h, context)
            skips.append(h)
        if self.downsamplers is not None:
            h = self.downsamplers[0](h)
            skips.append(h)
        return h, skips


class UpBlock(nn.Module):
    """CrossAttnUpBlock2D (``attentions`` set) or UpBlock2D: each resnet reads
    the running features concatenated with one skip connection."""

    def __init__(self, cfg: UNetConfig, in_ch: int, prev_ch: int, out_ch: int, temb_ch: int,
                 heads: int, cross_attn: bool, upsample: bool):
        super().__init__()
        g, eps, n = cfg.norm_num_groups, cfg.norm_eps, cfg.layers_per_block + 1
        resnets = []
        for i in range(n):
            skip_ch = in_ch if i == n - 1 else out_ch
            res_in = prev_ch if i == 0 else out_ch
            resnets.append(ResnetBlock2D(res_in + skip_ch, out_ch, temb_ch, g, eps, cfg.dropout))
        self.resnets = nn.ModuleList(resnets)
        self.attentions = (nn.ModuleList([_transformer(cfg, out_ch, heads) for _ in range(n)])
                           if cross_attn else None)
        self.upsamplers = nn.ModuleList([Upsample2D(out_ch)]) if upsample else None

    def forward(self, h: torch.Tensor, skips: list[torch.Tensor], temb: torch.Tensor,
                context: torch.Tensor, size: tuple[int, int] | None) -> torch.Tensor:
        # skips are read, never popped: a recomputed forward sees the same list
        for i, resnet in enumerate(self.resnets):
            h = resnet(torch.cat([h, skips[-1 - i]], dim=1), temb)
            if self.attentions is not None:
                h = self.attentions[i](h, context)
        if self.upsamplers is not None:
            h = self.upsamplers[0](h, size)
        return h


class MidBlock(nn.Module):
    """UNetMidBlock2DCrossAttn: resnet, transformer, resnet at the deepest level."""

    def __init__(self, cfg: UNetConfig, ch: int, temb_ch: int, heads: int):
        super().__init__()
        g, eps = cfg.norm_num_groups, cfg.norm_eps
        self.resnets = nn.ModuleList([ResnetBlock2D(ch, ch, temb_ch, g, eps, cfg.dropout)
                                      for _ in range(2)])
        self.attentions = nn.ModuleList([_transformer(cfg, ch, heads)])

    def forward(self, h: torch.Tensor, temb: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        h = self.resnets[0](h, temb)
        h = self.attentions[0](h, context)
        return self.resnets[1](h, temb)


class UNet2DCondition(nn.Module):
    def __init__(self, cfg: UNetConfig):
        super().__init__()
        self.cfg = cfg
        chs, heads = cfg.block_out_channels, cfg.heads()
        temb_ch = chs[0] * 4
        self.conv_in = nn.Conv2d(cfg.in_channels, chs[0], 3, padding=1)
        self.time_embedding = TimestepEmbedding(chs[0], temb_ch)
        n = len(chs)
        self.down_blocks = nn.ModuleList(
            [DownBlock(cfg, chs[max(i - 1, 0)], chs[i], temb_ch, heads[i],
                       cfg.down_block_types[i] == "CrossAttnDownBlock2D", i < n - 1)
             for i in range(n)])
        self.mid_block = MidBlock(cfg, chs[-1], temb_ch, heads[-1])
        rch, rheads = chs[::-1], heads[::-1]
        ups = []
        for i in range(n):
            ups.append(UpBlock(cfg, rch[min(i + 1, n - 1)], rch[max(i - 1, 0)], rch[i], temb_ch,
                               rheads[i], cfg.up_block_types[i] == "CrossAttnUpBlock2D", i < n - 1))
        self.up_blocks = nn.ModuleList(ups)
        self.conv_norm_out = nn.GroupNorm(cfg.norm_num_groups, chs[0], eps=cfg.norm_eps)
        self.conv_out = nn.Conv2d(chs[0], cfg.out_channels, 3, padding=1)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor | float,
                encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """``sample`` [B, C, h, w] noisy latents, ``timestep`` a scalar or [B],
        ``encoder_hidden_states`` [B, S, cross_attention_dim] -> prediction [B, C, h, w]."""
        B = sample.shape[0]
        t = torch.as_tensor(timestep, device=sample.device)
        t = t.reshape(-1).expand(B) if t.numel() == 1 else t
        t_emb = timestep_embedding(t, self.cfg.block_out_channels[0], self.cfg.flip_sin_to_cos,
                                   self.cfg.freq_shift).to(sample.dtype)
        temb = self.time_embedding(t_emb)
        h = self.conv_in(sample)
        skips = [h]
        for block in self.down_blocks:
            h, s = block(h, temb, encoder_hidden_states)
            skips.extend(s)
        h = self.mid_block(h, temb, encoder_hidden_states)
        for block in self.up_blocks:
            mine = skips[-len(block.resnets):]
            del skips[-len(block.resnets):]
            # Upsample to the next skip's size: equals 2x unless the input was odd-sized.
            size = tuple(skips[-1].shape[2:]) if skips else None
            h = block(h, mine, temb, encoder_hidden_states, size)
        return self.conv_out(F.silu(self.conv_norm_out(h)))

    def block_names(self) -> list[str]:
        """The repeated units (recompute, FSDP): every down, mid and up block."""
        return ([f"down_blocks.{i}" for i in range(len(self.down_blocks))] + ["mid_block"]
                + [f"up_blocks.{i}" for i in range(len(self.up_blocks))])
