"""FLOPs of Stable Diffusion training per image, counted on the meta device.

The models run once on meta tensors under ``torch.utils.flop_counter``: no
memory, no compute, and exact for whatever shapes the config has (the
published 6N rule of transformers does not apply to convolutional UNets).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from giantmodel.config.loader import to_dict
from giantmodel.config.sd import TextEncoderConfig, UNetConfig, VAEConfig
from giantmodel.models.sd.model import build_sd


def count_flops(unet_cfg: UNetConfig, vae_cfg: VAEConfig, text_cfg: TextEncoderConfig,
                resolution: int) -> dict[str, float]:
    """Per image: UNet forward and backward, text encoder forward, VAE encoder forward."""

    model = build_sd(unet_cfg, vae_cfg, text_cfg)
    f = vae_cfg.downscale
    with torch.device("meta"):
        ids = torch.zeros(1, text_cfg.max_position_embeddings, dtype=torch.long)
        with FlopCounterMode(display=False) as text, torch.no_grad():
            ctx = model.text_encoder(ids)
        x = torch.randn(1, unet_cfg.in_channels, resolution // f, resolution // f)
        with FlopCounterMode(display=False) as fwd:
            out = model.unet(x, torch.tensor([1]), ctx)
        with FlopCounterMode(display=False) as bwd:
            out.sum().backward()
        with FlopCounterMode(display=False) as vae, torch.no_grad():
            model.vae.moments(torch.randn(1, vae_cfg.in_channels, resolution, resolution))
    return {"unet_forward": float(fwd.get_total_flops()), "unet_backward": float(bwd.get_total_flops()),
            "text_forward": float(text.get_total_flops()), "vae_encode": float(vae.get_total_flops())}


_CACHE: dict[str, dict[str, float]] = {}


def train_flops_per_image(unet_cfg: UNetConfig, vae_cfg: VAEConfig, text_cfg: TextEncoderConfig,
                          resolution: int, train_text_encoder: bool, cached_latents: bool) -> float:
    """Model FLOPs of one training image (no recompute counted, as MFU conventions do)."""
    key = repr((to_dict(unet_cfg), to_dict(vae_cfg), to_dict(text_cfg), resolution))
    if key not in _CACHE:
        _CACHE[key] = count_flops(unet_cfg, vae_cfg, text_cfg, resolution)
    c = _CACHE[key]
    total = c["unet_forward"] + c["unet_backward"]
    total += c["text_forward"] * (3 if train_text_encoder else 1)
    return total + (0.0 if cached_latents else c["vae_encode"])
