"""Stable Diffusion: UNet2DCondition, AutoencoderKL and the CLIP text encoder
as plain nn.Modules, the noise schedule and samplers, and diffusers interop."""

from giantmodel.models.sd.model import StableDiffusion, build_sd, init_sd_weights

__all__ = ["StableDiffusion", "build_sd", "init_sd_weights"]
