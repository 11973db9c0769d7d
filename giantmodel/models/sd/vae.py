"""The Stable Diffusion autoencoder: diffusers' ``AutoencoderKL``.

The encoder maps an image in [-1, 1] to the moments (mean, log-variance) of
a diagonal Gaussian over latents; the decoder maps a latent back to an
image. Parameter names follow diffusers (``encoder.down_blocks.0.resnets.0``,
``quant_conv``, ``decoder.up_blocks.0.upsamplers.0.conv``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from giantmodel.config.sd import VAEConfig
from giantmodel.models.sd.blocks import Downsample2D, ResnetBlock2D, SpatialSelfAttention, Upsample2D

_EPS = 1e-6  # diffusers' resnet_eps for every VAE norm


class DiagonalGaussian:
    """The posterior q(z | x): per-element mean and variance (log-variance clamped as in diffusers)."""

    def __init__(self, moments: torch.Tensor):
        self.mean, logvar = moments.chunk(2, dim=1)
        self.logvar = logvar.clamp(-30.0, 20.0)
        self.std = torch.exp(0.5 * self.logvar)

    def sample(self, noise: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        if noise is None:
            noise = torch.randn(self.mean.shape, generator=generator, device=self.mean.device,
                                dtype=self.mean.dtype)
        return self.mean + self.std * noise

    def kl(self) -> torch.Tensor:
        """KL(q || N(0, I)) summed over each example's latent elements: [B]."""
        return 0.5 * (self.mean.pow(2) + self.logvar.exp() - 1.0 - self.logvar).sum(dim=(1, 2, 3))


class MidBlock(nn.Module):
    """UNetMidBlock2D without a time embedding: resnet, self-attention, resnet."""

    def __init__(self, ch: int, groups: int, attention: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock2D(ch, ch, None, groups, _EPS) for _ in range(2)])
        self.attentions = nn.ModuleList([SpatialSelfAttention(ch, groups)]) if attention else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.resnets[0](h)
        if self.attentions is not None:
            h = self.attentions[0](h)
        return self.resnets[1](h)


class EncoderBlock(nn.Module):
    """DownEncoderBlock2D: resnets, then a right/bottom-padded stride-2 conv."""

    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, downsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock2D(in_ch if i == 0 else out_ch, out_ch, None,
                                                    groups, _EPS) for i in range(layers)])
        self.downsamplers = (nn.ModuleList([Downsample2D(out_ch, pad_right=True)])
                             if downsample else None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            h = resnet(h)
        if self.downsamplers is not None:
            h = self.downsamplers[0](h)
        return h


class DecoderBlock(nn.Module):
    """UpDecoderBlock2D: resnets, then nearest 2x and a conv."""

    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, upsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock2D(in_ch if i == 0 else out_ch, out_ch, None,
                                                    groups, _EPS) for i in range(layers)])
        self.upsamplers = nn.ModuleList([Upsample2D(out_ch)]) if upsample else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            h = resnet(h)
        if self.upsamplers is not None:
            h = self.upsamplers[0](h)
        return h


class Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        chs, g, n = cfg.block_out_channels, cfg.norm_num_groups, len(cfg.block_out_channels)
        self.conv_in = nn.Conv2d(cfg.in_channels, chs[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            [EncoderBlock(chs[max(i - 1, 0)], chs[i], cfg.layers_per_block, g, i < n - 1)
             for i in range(n)])
        self.mid_block = MidBlock(chs[-1], g, cfg.mid_block_add_attention)
        self.conv_norm_out = nn.GroupNorm(g, chs[-1], eps=_EPS)
        self.conv_out = nn.Conv2d(chs[-1], 2 * cfg.latent_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for block in self.down_blocks:
            h = block(h)
        h = self.mid_block(h)
        return self.conv_out(F.silu(self.conv_norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        rch, g, n = cfg.block_out_channels[::-1], cfg.norm_num_groups, len(cfg.block_out_channels)
        self.conv_in = nn.Conv2d(cfg.latent_channels, rch[0], 3, padding=1)
        self.mid_block = MidBlock(rch[0], g, cfg.mid_block_add_attention)
        self.up_blocks = nn.ModuleList(
            [DecoderBlock(rch[max(i - 1, 0)], rch[i], cfg.layers_per_block + 1, g, i < n - 1)
             for i in range(n)])
        self.conv_norm_out = nn.GroupNorm(g, rch[-1], eps=_EPS)
        self.conv_out = nn.Conv2d(rch[-1], cfg.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            h = block(h)
        return self.conv_out(F.silu(self.conv_norm_out(h)))


class AutoencoderKL(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        c = cfg.latent_channels
        self.quant_conv = nn.Conv2d(2 * c, 2 * c, 1)
        self.post_quant_conv = nn.Conv2d(c, c, 1)

    def posterior(self, images: torch.Tensor) -> DiagonalGaussian:
        """q(z | images) for ``images`` [B, 3, H, W] in [-1, 1]."""
        return DiagonalGaussian(self.moments(images))

    def moments(self, images: torch.Tensor) -> torch.Tensor:
        """The posterior's [mean | log-variance] stacked on channels: [B, 2C, h, w]."""
        return self.quant_conv(self.encoder(images))

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """The posterior mean (diffusers: ``vae.encode(x).latent_dist.mean``); unscaled."""
        return self.posterior(images).mean

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in about [-1, 1] from unscaled latents (diffusers: ``vae.decode(z).sample``)."""
        return self.decoder(self.post_quant_conv(latents))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(images))
