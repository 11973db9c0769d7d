"""The three Stable Diffusion models in one module, built on the meta device
and initialised layout-independently.

``StableDiffusion`` is a plain container: ``unet``, ``vae`` and
``text_encoder`` are called directly (the diffusion objective decides which
run and which train). Its parameter names are ``unet.*``, ``vae.*`` and
``text_encoder.*`` plus diffusers' / transformers' own names below them.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from giantmodel.config.sd import NoiseConfig, TextEncoderConfig, UNetConfig, VAEConfig
from giantmodel.models.registry import canonical_name, copy_full_into
from giantmodel.models.sd.clip import CLIPTextModel
from giantmodel.models.sd.schedule import NoiseSchedule
from giantmodel.models.sd.unet import UNet2DCondition
from giantmodel.models.sd.vae import AutoencoderKL, DiagonalGaussian


class StableDiffusion(nn.Module):
    """UNet + VAE + CLIP text encoder, with the settings sampling needs.

    ``noise`` is the forward process (schedule, prediction type) the UNet was
    trained with; ``tokenizer`` the text tokenizer, when one is attached.
    """

    def __init__(self, unet: UNetConfig, vae: VAEConfig, text_encoder: TextEncoderConfig,
                 noise: NoiseConfig | None = None):
        super().__init__()
        self.unet = UNet2DCondition(unet)
        self.vae = AutoencoderKL(vae)
        self.text_encoder = CLIPTextModel(text_encoder)
        self.noise = noise or NoiseConfig()
        self.schedule = NoiseSchedule(self.noise)
        self.tokenizer = None

    @property
    def scaling_factor(self) -> float:
        return self.vae.cfg.scaling_factor

    def forward(self, task: str, *args, **kwargs):
        """The one entry point, so that a sharded model gathers the weights of
        whatever runs: ``task`` "train" (:meth:`training_forward`), "text"
        (text encoder on ids), "denoise" (UNet on latents, timesteps,
        conditions), "moments" (VAE posterior moments of images) or "decode"
        (VAE decoder on unscaled latents)."""
        if task == "train":
            return self.training_forward(*args, **kwargs)
        if task == "text":
            return self.text_encoder(*args, **kwargs)
        if task == "denoise":
            return self.unet(*args, **kwargs)
        if task == "moments":
            return self.vae.moments(*args, **kwargs)
        if task == "decode":
            return self.vae.decode(*args, **kwargs)
        raise ValueError(f"unknown task {task!r}")

    def training_forward(self, timesteps: torch.Tensor, noise: torch.Tensor, *,
                         pixel_values: torch.Tensor | None = None,
                         latent_moments: torch.Tensor | None = None,
                         posterior_noise: torch.Tensor | None = None,
                         input_ids: torch.Tensor | None = None,
                         encoder_hidden_states: torch.Tensor | None = None,
                         input_noise: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The training forward, given all its randomness: (prediction, target).

        The clean latent is sampled from the posterior of ``pixel_values``
        [B, 3, H, W] (or of cached ``latent_moments``) with
        ``posterior_noise``, scaled by the VAE's scaling factor, and noised
        to ``timesteps`` [B] with ``input_noise`` (default ``noise``); the
        target is ``noise`` or the velocity. The text conditions are
        ``encoder_hidden_states`` or the text encoder's output on ``input_ids``.
        """
        with torch.no_grad():  # the VAE is always frozen
            if latent_moments is None:
                latent_moments = self.vae.moments(pixel_values)
            posterior = DiagonalGaussian(latent_moments.to(noise.dtype))
            latents = posterior.sample(posterior_noise) * self.scaling_factor
        if encoder_hidden_states is None:
            trainable = any(p.requires_grad for p in self.text_encoder.parameters())
            with torch.set_grad_enabled(trainable and torch.is_grad_enabled()):
                encoder_hidden_states = self.text_encoder(input_ids)
        noisy = self.schedule.add_noise(latents, noise if input_noise is None else input_noise,
                                        timesteps)
        target = self.schedule.target(latents, noise, timesteps)
        return self.unet(noisy, timesteps, encoder_hidden_states), target


def build_sd(unet: UNetConfig, vae: VAEConfig, text_encoder: TextEncoderConfig,
             noise: NoiseConfig | None = None, device: str | torch.device = "meta"
             ) -> StableDiffusion:
    """The container, without allocating (``device='meta'``) or on ``device``."""
    with torch.device(device):
        return StableDiffusion(unet, vae, text_encoder, noise)


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def full_init_tensor(module: nn.Module, leaf: str, name: str, shape: torch.Size,
                     seed: int) -> torch.Tensor:
    """The full initial value of parameter ``name`` (``module.<leaf>``), in
    fp32: PyTorch's default scheme (uniform within 1/sqrt(fan_in) for conv
    and linear weights and biases, which diffusers keeps), unit/zero norms,
    N(0, 0.02) embeddings (CLIP's), drawn from a generator seeded by the name."""
    shape = tuple(shape)
    if isinstance(module, (nn.GroupNorm, nn.LayerNorm)):
        return torch.full(shape, 1.0 if leaf == "weight" else 0.0)
    gen = _generator(seed, name)
    if isinstance(module, nn.Embedding):
        return torch.empty(shape).normal_(0.0, 0.02, generator=gen)
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        w = module.weight.shape  # global shape, also under FSDP / tensor parallelism
        fan_in = w[1] * (w[2] * w[3] if len(w) == 4 else 1)
        bound = fan_in ** -0.5
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    raise TypeError(f"no init rule for {type(module).__name__} parameter {name}")


def init_sd_weights(model: nn.Module, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """Materialise a meta-device (possibly sharded) SD model on ``device`` and
    draw every parameter at full shape from a generator seeded by its
    canonical name, keeping this rank's shard: every layout starts from the
    weights of a single-process run."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    for mod_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            name = canonical_name(f"{mod_name}.{leaf}" if mod_name else leaf)
            copy_full_into(p, full_init_tensor(module, leaf, name, p.shape, seed))
    return model


def freeze(module: nn.Module) -> None:
    """Mark every parameter of ``module`` frozen (no gradient, no optimizer state)."""
    for p in module.parameters():
        p.requires_grad_(False)
