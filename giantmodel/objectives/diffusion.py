"""The diffusion objective: Stable Diffusion text-to-image training and DreamBooth.

The model is :class:`giantmodel.models.sd.StableDiffusion` (UNet, VAE, CLIP
text encoder). The VAE is always frozen, the text encoder unless
``sd.train_text_encoder``; the engine gives frozen weights no gradients, no
optimizer state and no gradient sync. A micro-batch's loss is the
per-image noise (or velocity) prediction error summed over its images; the
engine divides by the global image count. Parallelism is data parallelism
with ZeRO-1/2/3 or HSDP, like every peer's SD trainer: the UNet's blocks
are the units of recompute and of FSDP, the VAE and the text encoder are
one FSDP unit each (or, when trained, one per text layer).

Around training it builds the image loaders (with the latent cache and
DreamBooth's class images, which need the initialised model, built on the
loader's first batch), keeps the EMA of the UNet (checkpointed through
:meth:`state`), and writes samples after training.
"""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path

import torch
from torch import nn

from giantmodel.checkpoint import load_model_weights
from giantmodel.config.errors import ConfigError, UserInputError
from giantmodel.config.sd import NoiseConfig, SDConfig, TextEncoderConfig, UNetConfig, VAEConfig
from giantmodel.models.registry import canonical_name, copy_full_into
from giantmodel.models.sd.diffusers_io import diffusers_to_native, read_pipeline_configs, read_weights
from giantmodel.models.sd.flops import train_flops_per_image
from giantmodel.models.sd.model import StableDiffusion, build_sd, freeze, init_sd_weights
from giantmodel.models.sd.tokenizer import CLIPTokenizer, build_word_tokenizer
from giantmodel.objectives.diffusion_data import open_training_data, write_samples
from giantmodel.objectives.diffusion_loss import (
    draw_noise,
    latent_shape_of,
    model_inputs,
    per_image_loss,
    reduce_loss,
)
from giantmodel.objectives.diffusion_vae import cached_vae, read_cached_vae
from giantmodel.objectives.ema import EMA
from giantmodel.parallel.objective import BaseObjective, StageSpec


def resolve_shapes(sd: SDConfig) -> tuple[UNetConfig, VAEConfig, TextEncoderConfig, NoiseConfig]:
    if sd.pretrained:
        try:
            return read_pipeline_configs(Path(sd.pretrained))
        except UserInputError as e:
            raise ConfigError(str(e), "sd.pretrained") from None
    return sd.unet, sd.vae, sd.text_encoder, sd.noise


def resolve_tokenizer(sd: SDConfig, captions: list[str], max_length: int) -> CLIPTokenizer:
    """sd.tokenizer, else the pretrained pipeline's, else one whose vocabulary is
    every word of ``captions`` (for models trained from scratch)."""
    path = sd.tokenizer or (Path(sd.pretrained) / "tokenizer" if sd.pretrained else None)
    if path is not None:
        try:
            tok = CLIPTokenizer.from_dir(path)
        except UserInputError as e:
            raise ConfigError(str(e), "sd.tokenizer") from None
        tok.max_length = max_length
        return tok
    words = sorted({w for c in captions for w in c.lower().split()})
    return build_word_tokenizer(words, max_length)


class Diffusion(BaseObjective):
    name = "diffusion"
    supports = frozenset()

    def __init__(self, cfg):
        self.cfg = cfg
        self.sd: SDConfig = cfg.sd
        self.seed = cfg.train.seed
        self.unet_cfg, self.vae_cfg, self.text_cfg, self.noise_cfg = resolve_shapes(self.sd)
        self._check_resolution()
        self.data = open_training_data(cfg, self.vae_cfg)
        self.tokenizer = resolve_tokenizer(self.sd, self.data.all_captions(),
                                           self.text_cfg.max_position_embeddings)
        if self.tokenizer.vocab_size > self.text_cfg.vocab_size:
            raise ConfigError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but "
                              f"sd.text_encoder.vocab_size is {self.text_cfg.vocab_size}; raise it",
                              "sd.text_encoder.vocab_size")
        self.builtin_vae = self._prepare_builtin_vae()
        self.module: StableDiffusion | None = None
        self.ema: EMA | None = None

    @classmethod
    def from_config(cls, cfg) -> Diffusion:
        cfg.sd.validate()
        return cls(cfg)

    def _check_resolution(self) -> None:
        res = self.cfg.data.images.resolution
        step = self.vae_cfg.downscale * self.unet_cfg.downscale
        if res % step:
            raise ConfigError(f"{res} px is not a multiple of {step} (VAE x UNet downscaling)",
                              "data.images.resolution")

    def _prepare_builtin_vae(self):
        """Fit (once, under a file lock so concurrent ranks wait for one) and
        read the VAE of ``sd.vae_pretrain_steps``; sets the VAE's scaling factor."""
        if not self.sd.vae_pretrain_steps or self.sd.pretrained:
            return None

        cache = self.cfg.data.resolved_cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        with open(cache / ".sd-vae.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path, _ = cached_vae(self.vae_cfg, self.data.train, resolution=self.cfg.data.images.resolution,
                                 steps=self.sd.vae_pretrain_steps, seed=self.seed, cache_dir=cache,
                                 compute=True)
        state, scale = read_cached_vae(path)
        self.vae_cfg.scaling_factor = scale
        return state

    # ------------------------------------------------------------ the model
    def build(self, stage: StageSpec) -> nn.Module:
        model = build_sd(self.unet_cfg, self.vae_cfg, self.text_cfg, self.noise_cfg, device="meta")
        freeze(model.vae)
        if not self.sd.train_text_encoder:
            freeze(model.text_encoder)
        model.tokenizer = self.tokenizer
        self.module = model  # parallelized in place; the loaders and the EMA use it
        return model

    def blocks(self, module: nn.Module) -> list[str]:
        names = [f"unet.{n}" for n in module.unet.block_names()]
        if self.sd.train_text_encoder:
            names += [f"text_encoder.{n}" for n in module.text_encoder.block_names()]
        return names

    def edge_units(self, module: nn.Module) -> list[list[nn.Module]]:
        # the VAE runs through methods (moments, decode), not its forward: each
        # FSDP unit is a set of modules whose forwards do run, so it gathers
        vae = module.vae
        units = [[vae.encoder, vae.quant_conv], [vae.decoder, vae.post_quant_conv]]
        if not self.sd.train_text_encoder:
            units.append([module.text_encoder])
        return units

    def init_weights(self, module: nn.Module, device: torch.device) -> None:
        init_sd_weights(module, self.seed, device)
        if self.sd.pretrained:
            self._load_diffusers(module, Path(self.sd.pretrained))
        elif self.builtin_vae is not None:
            _copy_state(module, {f"vae.{k}": v for k, v in self.builtin_vae.items()})
        if self.sd.ema:
            self.ema = EMA(module.unet, self.sd.ema_decay, prefix="unet.")

    def _load_diffusers(self, module: nn.Module, path: Path) -> None:

        state = diffusers_to_native(read_weights(path / "unet", ("diffusion_pytorch_model",)),
                                    read_weights(path / "vae", ("diffusion_pytorch_model",)),
                                    read_weights(path / "text_encoder", ("model", "pytorch_model")))
        _copy_state(module, state, where=path)

    # ------------------------------------------------------------- the loss
    def loss_units(self, batch: dict) -> int:
        n = (batch["latent_moments"] if "latent_moments" in batch else batch["pixel_values"]).shape[0]
        prior = batch.get("is_prior")
        return n - (int(prior.sum()) if prior is not None else 0)

    def loss(self, module: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        device = _device_of(module)
        shape = latent_shape_of(batch, self.vae_cfg.downscale, self.vae_cfg.latent_channels)
        draws = draw_noise(batch["position"], shape, self.noise_cfg.num_train_timesteps,
                           self.seed, self.sd)
        pred, target = module("train", **model_inputs(batch, draws, device))
        per = per_image_loss(pred, target, draws["timesteps"], module.schedule, self.sd.snr_gamma)
        weight = self.sd.dreambooth.prior_loss_weight if self.sd.dreambooth else 1.0
        return reduce_loss(per, batch, weight)

    # ------------------------------------------------------- around training
    def build_loaders(self, *, dp_rank: int, dp_size: int):
        return self.data.loaders(self, dp_rank=dp_rank, dp_size=dp_size)

    def after_step(self) -> None:
        if self.ema is not None:
            self.ema.update()

    def state(self) -> dict:
        return {"ema": self.ema} if self.ema is not None else {}

    def load_pretrained(self, parts: list[nn.Module], path: str | Path) -> Path:
        p = Path(path)
        if (p / "model_index.json").is_file():
            self._load_diffusers(parts[0], p)
            return p
        return load_model_weights(parts, path)

    def step_units(self) -> tuple[str, int]:
        return "images", self.cfg.train.global_batch_size

    def flops_per_unit(self) -> float:
        return train_flops_per_image(self.unet_cfg, self.vae_cfg, self.text_cfg,
                                     self.cfg.data.images.resolution, self.sd.train_text_encoder,
                                     self.cfg.data.cache_latents)

    def model_name(self) -> str:
        return self.sd.name

    def num_params(self) -> int:
        if self.module is None:
            return 0
        return sum(p.numel() for p in self.module.parameters())

    def averaged(self) -> contextlib.AbstractContextManager:
        """Within the block the UNet holds its EMA weights (when kept)."""
        return self.ema.swapped() if self.ema is not None else contextlib.nullcontext()

    def sample(self, model: nn.Module) -> str | None:
        with self.averaged():
            return write_samples(self, model, Path(self.cfg.run.dir) / "samples")


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _copy_state(module: nn.Module, state: dict[str, torch.Tensor], where=None) -> None:
    """Copy full tensors into ``module``'s (possibly sharded) parameters by canonical name."""
    params = {canonical_name(n): p for n, p in module.named_parameters()}
    missing = [k for k in state if k not in params]
    if missing:
        raise UserInputError(f"{where or 'weights'}: {missing[0]} is not a parameter of this "
                             "model; do the shapes in the config match?")
    for k, v in state.items():
        p = params[k]
        if tuple(v.shape) != tuple(p.shape):
            raise UserInputError(f"{where or 'weights'}: {k} has shape {tuple(v.shape)}, the "
                                 f"model needs {tuple(p.shape)}")
        copy_full_into(p, v.float())
