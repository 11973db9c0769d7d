"""Text-to-image with classifier-free guidance, as diffusers' StableDiffusionPipeline does it.

For one seed the initial latents are ``torch.randn`` from a CPU generator
seeded with it, the unconditional (negative-prompt) and conditional
predictions come from one batched UNet call in that order, and the image is
``decode(latents / scaling_factor) / 2 + 0.5`` clamped to [0, 1]: the same
seed gives the same image here and in diffusers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from giantmodel.config.errors import UserInputError
from giantmodel.models.sd.schedule import SAMPLERS, NoiseSchedule


@torch.no_grad()
def generate_images(model, prompts: str | list[str], *, sampler: str = "ddim", steps: int = 30,
                    guidance_scale: float = 7.5, seed: int = 0, height: int | None = None,
                    width: int | None = None, negative_prompt: str = "",
                    tokenizer=None) -> torch.Tensor:
    """Images [N, 3, H, W] in [0, 1] for ``prompts`` from a :class:`StableDiffusion`."""
    if sampler not in SAMPLERS:
        raise UserInputError(f"unknown sampler {sampler!r}; use one of {', '.join(SAMPLERS)}")
    tokenizer = tokenizer or model.tokenizer
    if tokenizer is None:
        raise UserInputError("this model has no tokenizer; give one (a CLIP tokenizer directory)")
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    unet, vae = model.unet, model.vae
    # every part runs through model(task, ...): a sharded model gathers what it needs
    param = next(unet.parameters())
    device, dtype = param.device, param.dtype
    f = vae.cfg.downscale
    H = height or unet.cfg.sample_size * f
    W = width or unet.cfg.sample_size * f
    if H % f or W % f:
        raise UserInputError(f"height and width must be multiples of {f}, got {H}x{W}")
    n = len(prompts)
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn((n, unet.cfg.in_channels, H // f, W // f), generator=gen)
    latents = latents.to(device, dtype)
    cond = model("text", tokenizer(prompts).to(device))
    guided = guidance_scale > 1.0
    if guided:
        uncond = model("text", tokenizer([negative_prompt] * n).to(device))
        context = torch.cat([uncond, cond])

    def denoise(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        if not guided:
            return model("denoise", x, t, cond)
        u, c = model("denoise", torch.cat([x, x]), t, context).chunk(2)
        return u + guidance_scale * (c - u)

    schedule = NoiseSchedule(model.noise)
    z = SAMPLERS[sampler](schedule, denoise, latents, steps)
    images = model("decode", z / vae.cfg.scaling_factor)
    return (images.float() / 2 + 0.5).clamp(0, 1)


def to_pil(image: torch.Tensor):
    """One image [3, H, W] in [0, 1] as a PIL image (rounded like diffusers' numpy_to_pil)."""
    from PIL import Image

    arr = (image.permute(1, 2, 0).cpu().numpy() * 255).round().astype("uint8")
    return Image.fromarray(arr)


def save_png(image: torch.Tensor, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    to_pil(image).save(path)
    return path
