"""Stable Diffusion sections of the job config: model shapes (``sd.unet``,
``sd.vae``, ``sd.text_encoder``) and the diffusion objective's settings.

Shapes use diffusers' / transformers' field names so that a diffusers
``config.json`` reads into these classes key for key (see
:mod:`giantmodel.models.sd.diffusers_io`); the defaults are the tiny model
that trains on two CPU cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from giantmodel.config.errors import ConfigError

DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")
NOISE_SCHEDULES = ("scaled_linear", "linear", "squaredcos_cap_v2")


def _positive(obj, prefix: str, *keys: str) -> None:
    for key in keys:
        if getattr(obj, key) <= 0:
            raise ConfigError(f"must be positive, got {getattr(obj, key)}", f"{prefix}.{key}")


@dataclass
class UNetConfig:
    """The denoiser: diffusers' UNet2DConditionModel restricted to SD 1.x/2.x features."""

    sample_size: int = 16
    """Latent height and width at training resolution (image size / VAE downscale)."""
    in_channels: int = 4
    """Channels of the noisy latent it reads (the VAE's latent_channels)."""
    out_channels: int = 4
    """Channels it predicts (noise or velocity, like the latent)."""
    block_out_channels: list[int] = field(default_factory=lambda: [32, 64])
    """Width of each resolution level; one entry per down block."""
    down_block_types: list[Literal[DOWN_BLOCKS]] = field(
        default_factory=lambda: ["DownBlock2D", "CrossAttnDownBlock2D"])
    """Per level: CrossAttnDownBlock2D (resnets + transformers) or DownBlock2D (resnets only)."""
    up_block_types: list[Literal[UP_BLOCKS]] = field(
        default_factory=lambda: ["CrossAttnUpBlock2D", "UpBlock2D"])
    """Per level, deepest first: CrossAttnUpBlock2D or UpBlock2D."""
    layers_per_block: int = 1
    """Resnets per down block (up blocks have one more, for the skip connections)."""
    attention_head_dim: int | list[int] = 4
    """Attention heads per block, in diffusers' naming (its ``attention_head_dim``
    counts heads): SD 1.x uses 8 everywhere, SD 2.x [5, 10, 20, 20] (64-wide heads)."""
    cross_attention_dim: int = 32
    """Width of the text encoder's hidden states that cross-attention reads."""
    use_linear_projection: bool = False
    """Transformer in/out projections as Linear (SD 2.x) instead of 1x1 Conv2d (SD 1.x)."""
    transformer_layers_per_block: int = 1
    """BasicTransformerBlocks inside each Transformer2D."""
    norm_num_groups: int = 16
    """GroupNorm groups in resnets and transformers; must divide every block width."""
    norm_eps: float = 1e-5
    """GroupNorm epsilon of resnets and the output norm."""
    upcast_attention: bool = False
    """Compute attention scores in fp32 under bf16/fp16 autocast (SD 2.1-v sets it)."""
    flip_sin_to_cos: bool = True
    """Timestep embedding order cos|sin (SD) rather than sin|cos."""
    freq_shift: int = 0
    """downscale_freq_shift of the sinusoidal timestep embedding."""
    dropout: float = 0.0
    """Dropout inside resnets and transformer feed-forwards."""

    def heads(self) -> list[int]:
        """Attention heads of each down block (up blocks use them reversed)."""
        h = self.attention_head_dim
        return list(h) if isinstance(h, list) else [h] * len(self.block_out_channels)

    def validate(self, prefix: str = "sd.unet") -> None:
        _positive(self, prefix, "sample_size", "in_channels", "out_channels", "layers_per_block",
                  "cross_attention_dim", "norm_num_groups", "transformer_layers_per_block")
        n = len(self.block_out_channels)
        if n == 0:
            raise ConfigError("needs at least one block width", f"{prefix}.block_out_channels")
        for key in ("down_block_types", "up_block_types"):
            if len(getattr(self, key)) != n:
                raise ConfigError(f"has {len(getattr(self, key))} entries but block_out_channels "
                                  f"has {n}; give one per level", f"{prefix}.{key}")
        heads = self.heads()
        if len(heads) != n:
            raise ConfigError(f"has {len(heads)} entries but block_out_channels has {n}",
                              f"{prefix}.attention_head_dim")
        for c, h in zip(self.block_out_channels, heads):
            if c % self.norm_num_groups:
                raise ConfigError(f"{self.norm_num_groups} groups do not divide block width {c}",
                                  f"{prefix}.norm_num_groups")
            if h <= 0 or c % h:
                raise ConfigError(f"{h} heads do not divide block width {c}",
                                  f"{prefix}.attention_head_dim")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"must be in [0, 1), got {self.dropout}", f"{prefix}.dropout")

    @property
    def downscale(self) -> int:
        """How much smaller the deepest level is than the input."""
        return 2 ** (len(self.block_out_channels) - 1)


@dataclass
class VAEConfig:
    """The autoencoder: diffusers' AutoencoderKL (DownEncoderBlock2D / UpDecoderBlock2D)."""

    in_channels: int = 3
    """Image channels."""
    out_channels: int = 3
    """Decoded image channels."""
    latent_channels: int = 4
    """Channels of the latent the UNet denoises."""
    block_out_channels: list[int] = field(default_factory=lambda: [16, 32])
    """Width of each encoder level (decoder reversed); the image shrinks 2x per extra level."""
    layers_per_block: int = 1
    """Resnets per encoder block (decoder blocks have one more)."""
    norm_num_groups: int = 16
    """GroupNorm groups; must divide every block width."""
    scaling_factor: float = 0.18215
    """Latents are multiplied by this before diffusion (SD 1.x/2.x: 0.18215) so they have about unit variance."""
    sample_size: int = 32
    """Image height and width the VAE was built for (informational, kept for diffusers)."""
    mid_block_add_attention: bool = True
    """Self-attention in the encoder's and decoder's middle blocks."""

    @property
    def downscale(self) -> int:
        """Image size / latent size."""
        return 2 ** (len(self.block_out_channels) - 1)

    def validate(self, prefix: str = "sd.vae") -> None:
        _positive(self, prefix, "in_channels", "out_channels", "latent_channels",
                  "layers_per_block", "norm_num_groups", "scaling_factor")
        if not self.block_out_channels:
            raise ConfigError("needs at least one block width", f"{prefix}.block_out_channels")
        for c in self.block_out_channels:
            if c % self.norm_num_groups:
                raise ConfigError(f"{self.norm_num_groups} groups do not divide block width {c}",
                                  f"{prefix}.norm_num_groups")


@dataclass
class TextEncoderConfig:
    """The text encoder: transformers' CLIPTextModel (causal, pre-norm)."""

    vocab_size: int = 1024
    """Token embedding rows; at least the tokenizer's vocabulary."""
    hidden_size: int = 32
    """Width of the hidden states (the UNet's cross_attention_dim)."""
    intermediate_size: int = 64
    """MLP inner width."""
    num_hidden_layers: int = 2
    """Transformer layers."""
    num_attention_heads: int = 4
    """Attention heads; must divide hidden_size."""
    max_position_embeddings: int = 16
    """Token positions, i.e. the padded caption length (SD: 77)."""
    hidden_act: Literal["quick_gelu", "gelu"] = "quick_gelu"
    """MLP activation: quick_gelu (OpenAI CLIP, SD 1.x) or gelu (OpenCLIP, SD 2.x)."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon."""

    def validate(self, prefix: str = "sd.text_encoder") -> None:
        _positive(self, prefix, "vocab_size", "hidden_size", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "max_position_embeddings")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{self.num_attention_heads} heads do not divide hidden_size "
                              f"{self.hidden_size}", f"{prefix}.num_attention_heads")


@dataclass
class NoiseConfig:
    """The forward (noising) process, shared by training and the samplers."""

    num_train_timesteps: int = 1000
    """Diffusion steps T."""
    beta_schedule: Literal[NOISE_SCHEDULES] = "scaled_linear"
    """scaled_linear (SD: betas linear in sqrt space), linear, or squaredcos_cap_v2 (cosine)."""
    beta_start: float = 0.00085
    """First beta (scaled_linear, linear)."""
    beta_end: float = 0.012
    """Last beta (scaled_linear, linear)."""
    prediction_type: Literal["epsilon", "v_prediction"] = "epsilon"
    """What the UNet predicts: the noise (SD 1.x, 2.x-base) or the velocity (SD 2.x-v)."""
    steps_offset: int = 1
    """Added to the sampler's timesteps (SD: 1), kept for diffusers' scheduler config."""
    timestep_spacing: Literal["leading", "trailing", "linspace"] = "leading"
    """How sampling timesteps are spread over [0, T) (diffusers' timestep_spacing)."""

    def validate(self, prefix: str = "sd.noise") -> None:
        _positive(self, prefix, "num_train_timesteps")
        if not 0 < self.beta_start < self.beta_end < 1:
            raise ConfigError(f"need 0 < beta_start < beta_end < 1, got {self.beta_start}, "
                              f"{self.beta_end}", f"{prefix}.beta_start")


@dataclass
class DreamBoothConfig:
    """DreamBooth: fine-tune on a few instance images bound to a rare identifier,
    optionally preserving the class prior with images the model generates itself."""

    instance_dir: str | None = None
    """Folder of instance images (all captioned with instance_prompt); null generates a
    small instance set from the shapes source (a ring, for the tiny recipe)."""
    instance_prompt: str = "a sks ring on a blue background"
    """Caption of every instance image: the identifier plus the class noun."""
    with_prior_preservation: bool = False
    """Add class images to every batch and the prior-preservation loss."""
    class_prompt: str = "a circle on a blue background"
    """Caption of the class images (the class noun without the identifier)."""
    class_dir: str | None = None
    """Folder of class images; missing images (up to num_class_images) are generated
    into it by the model before training. Null: run.dir/class_images."""
    num_class_images: int = 16
    """Class images wanted for prior preservation."""
    prior_loss_weight: float = 1.0
    """Loss = instance + prior_loss_weight * prior."""
    num_instance_images: int = 8
    """Instance images generated when instance_dir is null."""

    def validate(self) -> None:
        if not self.instance_prompt.strip():
            raise ConfigError("must not be empty", "sd.dreambooth.instance_prompt")
        if self.with_prior_preservation:
            if not self.class_prompt.strip():
                raise ConfigError("prior preservation needs a class prompt",
                                  "sd.dreambooth.class_prompt")
            if self.num_class_images < 1:
                raise ConfigError("must be at least 1", "sd.dreambooth.num_class_images")
        if self.prior_loss_weight < 0:
            raise ConfigError("must be >= 0", "sd.dreambooth.prior_loss_weight")
        if self.num_instance_images < 1:
            raise ConfigError("must be at least 1", "sd.dreambooth.num_instance_images")


@dataclass
class SDConfig:
    """Stable Diffusion: the three models, the noise process and the training recipe
    (the ``sd:`` section, used by ``objective: diffusion``)."""

    name: str = "sd-tiny"
    """Free-form model name, used in run metadata."""
    unet: UNetConfig = field(default_factory=UNetConfig)
    """The denoiser's shape."""
    vae: VAEConfig = field(default_factory=VAEConfig)
    """The autoencoder's shape."""
    text_encoder: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    """The CLIP text encoder's shape."""
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    """Noise schedule and prediction type."""
    pretrained: str | None = None
    """A diffusers pipeline directory: shapes, weights, scheduler and tokenizer start
    from it (the sd.unet / vae / text_encoder / noise sections are then ignored)."""
    tokenizer: str | None = None
    """A CLIP tokenizer directory (vocab.json + merges.txt). Null: the pretrained
    pipeline's, else one built from the training captions' words."""
    train_text_encoder: bool = False
    """Train the text encoder too (otherwise it is frozen, like the VAE always is)."""
    snr_gamma: float = 0.0
    """Min-SNR-gamma loss weighting (Hang et al. 2023; 5.0 is typical); 0 turns it off."""
    noise_offset: float = 0.0
    """Offset noise: add this times per-channel N(0, 1) to the noise (0.05-0.1 brightens darks)."""
    input_perturbation: float = 0.0
    """Input perturbation (Ning et al. 2023): noise the latents with noise + this times fresh noise."""
    caption_dropout: float = 0.0
    """Probability of training a sample on the empty caption, for classifier-free guidance."""
    ema: bool = False
    """Keep an exponential moving average of the UNet (sharded like it, checkpointed);
    samples and exports use it."""
    ema_decay: float = 0.9999
    """Largest EMA decay; early steps use (1 + n) / (10 + n) as diffusers' EMAModel does."""
    vae_pretrain_steps: int = 0
    """Train the VAE as an autoencoder on the training images for this many steps before
    diffusion (once, cached under data.cache_dir): the tiny default's stand-in for a
    pretrained VAE. 0: keep the initial or pretrained VAE."""
    sample_prompts: list[str] = field(default_factory=list)
    """Prompts sampled after training into run.dir/samples/ (empty: some training captions)."""
    num_samples: int = 8
    """Images written after training when sample_prompts is empty (0: none)."""
    sampler: Literal["ddim", "euler"] = "ddim"
    """Sampler for samples and generated class images."""
    sample_steps: int = 30
    """Sampling steps."""
    guidance_scale: float = 7.5
    """Classifier-free guidance scale (1: no guidance)."""
    dreambooth: DreamBoothConfig | None = None
    """DreamBooth fine-tuning; null: text-to-image training on the data section."""

    def validate(self) -> None:
        if self.pretrained is None:
            self.unet.validate()
            self.vae.validate()
            self.text_encoder.validate()
            self.noise.validate()
            if self.unet.in_channels != self.vae.latent_channels:
                raise ConfigError(f"{self.unet.in_channels} != sd.vae.latent_channels "
                                  f"{self.vae.latent_channels}", "sd.unet.in_channels")
            if self.unet.cross_attention_dim != self.text_encoder.hidden_size:
                raise ConfigError(f"{self.unet.cross_attention_dim} != sd.text_encoder.hidden_size "
                                  f"{self.text_encoder.hidden_size}", "sd.unet.cross_attention_dim")
        for key in ("snr_gamma", "noise_offset", "input_perturbation"):
            if getattr(self, key) < 0:
                raise ConfigError("must be >= 0", f"sd.{key}")
        if not 0 <= self.caption_dropout < 1:
            raise ConfigError(f"must be in [0, 1), got {self.caption_dropout}", "sd.caption_dropout")
        if not 0 < self.ema_decay < 1:
            raise ConfigError(f"must be in (0, 1), got {self.ema_decay}", "sd.ema_decay")
        if self.vae_pretrain_steps < 0 or self.num_samples < 0 or self.sample_steps < 1:
            raise ConfigError("vae_pretrain_steps and num_samples must be >= 0, sample_steps >= 1",
                              "sd")
        if self.dreambooth is not None:
            self.dreambooth.validate()
