"""Read and write diffusers Stable Diffusion pipeline directories.

A pipeline directory holds ``model_index.json`` and one folder per part:
``unet/`` and ``vae/`` (diffusers ``config.json`` plus
``diffusion_pytorch_model.safetensors``), ``text_encoder/`` (transformers
``config.json`` plus ``model.safetensors``), ``scheduler/``
(``scheduler_config.json``) and, when present, ``tokenizer/``.

Neither diffusers nor transformers is needed: configs are JSON and weights
are safetensors (``.bin`` files are read with ``weights_only=True`` only).
Settings this implementation does not support are refused with the key and
value, never silently dropped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from giantmodel.config.errors import ConfigError, UserInputError
from giantmodel.config.sd import NoiseConfig, TextEncoderConfig, UNetConfig, VAEConfig
from giantmodel.models.sd.model import StableDiffusion, build_sd
from giantmodel.models.sd.tokenizer import CLIPTokenizer

DIFFUSERS_VERSION = "0.30.0"

# diffusers UNet2DConditionModel settings that must keep their default here.
_UNET_FIXED = {
    "act_fn": "silu", "center_input_sample": False, "downsample_padding": 1,
    "mid_block_scale_factor": 1, "mid_block_type": "UNetMidBlock2DCrossAttn",
    "only_cross_attention": False, "dual_cross_attention": False, "class_embed_type": None,
    "addition_embed_type": None, "num_class_embeds": None, "resnet_time_scale_shift": "default",
    "time_embedding_type": "positional", "time_embedding_dim": None, "time_cond_proj_dim": None,
    "conv_in_kernel": 3, "conv_out_kernel": 3, "projection_class_embeddings_input_dim": None,
    "attention_type": "default", "cross_attention_norm": None, "encoder_hid_dim": None,
    "encoder_hid_dim_type": None, "timestep_post_act": None, "resnet_skip_time_act": False,
    "resnet_out_scale_factor": 1.0, "class_embeddings_concat": False,
    "mid_block_only_cross_attention": None, "addition_time_embed_dim": None,
    "reverse_transformer_layers_per_block": None, "time_embedding_act_fn": None,
    "num_attention_heads": None, "addition_embed_type_num_heads": 64,
}
_UNET_KEYS = ("sample_size", "in_channels", "out_channels", "block_out_channels",
              "down_block_types", "up_block_types", "layers_per_block", "attention_head_dim",
              "cross_attention_dim", "use_linear_projection", "transformer_layers_per_block",
              "norm_num_groups", "norm_eps", "upcast_attention", "flip_sin_to_cos", "freq_shift",
              "dropout")
_VAE_FIXED = {"act_fn": "silu", "use_quant_conv": True, "use_post_quant_conv": True,
              "shift_factor": None, "latents_mean": None, "latents_std": None}
_VAE_KEYS = ("in_channels", "out_channels", "latent_channels", "block_out_channels",
             "layers_per_block", "norm_num_groups", "scaling_factor", "sample_size",
             "mid_block_add_attention")
_TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "max_position_embeddings", "hidden_act", "layer_norm_eps")
_NOISE_KEYS = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule",
               "prediction_type", "steps_offset", "timestep_spacing")
# Attention names of diffusers checkpoints older than 0.14 (VAE middle blocks).
_OLD_ATTN = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise UserInputError(f"{path} is missing; is {path.parent.parent} a diffusers "
                             "Stable Diffusion pipeline directory?")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserInputError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserInputError(f"{path}: expected a JSON object")
    return data


def _norm(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def _same(a, b) -> bool:
    return _norm(a) == _norm(b)


def _check_fixed(raw: dict, fixed: dict, where: Path) -> None:
    for key, default in fixed.items():
        if key in raw and not _same(raw[key], default):
            raise UserInputError(f"{where}: {key}={raw[key]!r} is not supported (only "
                                 f"{default!r}); this model is not an SD 1.x/2.x-style pipeline")


def unet_config_from_diffusers(raw: dict, where: Path) -> UNetConfig:
    if raw.get("_class_name", "UNet2DConditionModel") != "UNet2DConditionModel":
        raise UserInputError(f"{where}: _class_name {raw['_class_name']!r} is not UNet2DConditionModel")
    _check_fixed(raw, _UNET_FIXED, where)
    kw = {k: raw[k] for k in _UNET_KEYS if k in raw and raw[k] is not None}
    for key in ("block_out_channels", "down_block_types", "up_block_types"):
        if key in kw:
            kw[key] = list(kw[key])
    if isinstance(kw.get("attention_head_dim"), (list, tuple)):
        kw["attention_head_dim"] = list(kw["attention_head_dim"])
    layers = kw.get("transformer_layers_per_block")
    if isinstance(layers, (list, tuple)):
        if len(set(layers)) != 1:
            raise UserInputError(f"{where}: per-block transformer_layers_per_block {layers} is "
                                 "not supported")
        kw["transformer_layers_per_block"] = layers[0]
    bad = [t for t in kw.get("down_block_types", []) + kw.get("up_block_types", [])
           if t not in ("CrossAttnDownBlock2D", "DownBlock2D", "CrossAttnUpBlock2D", "UpBlock2D")]
    if bad:
        raise UserInputError(f"{where}: block type {bad[0]!r} is not supported")
    cfg = UNetConfig(**kw)
    _validated(cfg, where)
    return cfg


def vae_config_from_diffusers(raw: dict, where: Path) -> VAEConfig:
    if raw.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
        raise UserInputError(f"{where}: _class_name {raw['_class_name']!r} is not AutoencoderKL")
    _check_fixed(raw, _VAE_FIXED, where)
    for key, kind in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
        if any(t != kind for t in raw.get(key, [])):
            raise UserInputError(f"{where}: {key} must all be {kind}")
    kw = {k: raw[k] for k in _VAE_KEYS if k in raw and raw[k] is not None}
    kw["block_out_channels"] = list(kw.get("block_out_channels", [64]))
    kw.setdefault("layers_per_block", 1)
    kw.setdefault("norm_num_groups", 32)
    cfg = VAEConfig(**kw)
    _validated(cfg, where)
    return cfg


def text_config_from_transformers(raw: dict, where: Path) -> TextEncoderConfig:
    kind = raw.get("model_type", "clip_text_model")
    if kind != "clip_text_model":
        raise UserInputError(f"{where}: model_type {kind!r} is not clip_text_model")
    kw = {k: raw[k] for k in _TEXT_KEYS if k in raw}
    if kw.get("hidden_act", "quick_gelu") not in ("quick_gelu", "gelu"):
        raise UserInputError(f"{where}: hidden_act {kw['hidden_act']!r} is not supported")
    defaults = {"vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
                    "num_attention_heads": 8, "max_position_embeddings": 77, "hidden_act": "quick_gelu"}
    cfg = TextEncoderConfig(**{**defaults, **kw})
    _validated(cfg, where)
    return cfg


def noise_config_from_diffusers(raw: dict, where: Path) -> NoiseConfig:
    if raw.get("trained_betas") is not None:
        raise UserInputError(f"{where}: trained_betas are not supported")
    kw = {k: raw[k] for k in _NOISE_KEYS if k in raw and raw[k] is not None}
    kw.setdefault("steps_offset", 0)
    if kw.get("beta_schedule", "linear") not in ("scaled_linear", "linear", "squaredcos_cap_v2"):
        raise UserInputError(f"{where}: beta_schedule {kw['beta_schedule']!r} is not supported")
    if kw.get("prediction_type", "epsilon") not in ("epsilon", "v_prediction"):
        raise UserInputError(f"{where}: prediction_type {kw['prediction_type']!r} is not supported")
    kw.setdefault("beta_schedule", "linear")
    return NoiseConfig(**kw)


def _validated(cfg, where: Path) -> None:
    try:
        cfg.validate(prefix=str(where))
    except ConfigError as e:
        raise UserInputError(str(e)) from None


# ------------------------------------------------------------------ weights
def _weight_files(folder: Path, stems: tuple[str, ...]) -> list[Path]:
    for stem in stems:
        for variant in ("", ".fp16"):
            single = folder / f"{stem}{variant}.safetensors"
            index = folder / f"{stem}{variant}.safetensors.index.json"
            if single.is_file():
                return [single]
            if index.is_file():
                shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
                return [folder / s for s in shards]
            if (folder / f"{stem}{variant}.bin").is_file():
                return [folder / f"{stem}{variant}.bin"]
    raise UserInputError(f"{folder}: no weights ({stems[0]}.safetensors or .bin)")


def read_weights(folder: Path, stems: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(folder, stems):
        try:
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file
                out.update(load_file(str(f)))
            else:
                out.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # noqa: BLE001 - any reader failure means a bad file
            raise UserInputError(f"{f}: cannot read weights ({e})") from None
    return out


def _vae_key(key: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    parts = key.split(".")
    if len(parts) >= 2 and parts[-2] in _OLD_ATTN:
        key = ".".join(parts[:-2] + [_OLD_ATTN[parts[-2]], parts[-1]])
        if t.dim() == 4:  # stored as 1x1 convs by old conversions
            t = t[:, :, 0, 0]
    return key, t


def diffusers_to_native(unet: dict, vae: dict, text: dict) -> dict[str, torch.Tensor]:
    state = {f"unet.{k}": v for k, v in unet.items()}
    for k, v in vae.items():
        k, v = _vae_key(k, v)
        state[f"vae.{k}"] = v
    for k, v in text.items():
        k = k.removeprefix("text_model.")
        if k != "embeddings.position_ids":
            state[f"text_encoder.{k}"] = v
    return state


def load_native_state(model: torch.nn.Module, state: dict[str, torch.Tensor], where) -> None:
    mine = model.state_dict()
    missing = sorted(mine.keys() - state.keys())
    extra = sorted(state.keys() - mine.keys())
    if missing or extra:
        what = (f"missing {missing[:3]}" if missing else "") + \
               (f" unexpected {extra[:3]}" if extra else "")
        raise UserInputError(f"{where}: weights do not match the config ({what.strip()})")
    for k, v in state.items():
        if tuple(v.shape) != tuple(mine[k].shape):
            raise UserInputError(f"{where}: {k} has shape {tuple(v.shape)}, the config needs "
                                 f"{tuple(mine[k].shape)}")
    model.load_state_dict(state, strict=True)


def read_pipeline_configs(path: Path) -> tuple[UNetConfig, VAEConfig, TextEncoderConfig, NoiseConfig]:
    unet = unet_config_from_diffusers(_read_json(path / "unet" / "config.json"), path / "unet")
    vae = vae_config_from_diffusers(_read_json(path / "vae" / "config.json"), path / "vae")
    text = text_config_from_transformers(_read_json(path / "text_encoder" / "config.json"),
                                         path / "text_encoder")
    sched = path / "scheduler" / "scheduler_config.json"
    noise = noise_config_from_diffusers(_read_json(sched), sched.parent) if sched.is_file() \
        else NoiseConfig()
    return unet, vae, text, noise


def from_diffusers(path: str | os.PathLike, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None) -> StableDiffusion:
    """A diffusers SD 1.x/2.x pipeline directory as a :class:`StableDiffusion`
    (eval mode), with its scheduler settings in ``.noise`` and its tokenizer
    in ``.tokenizer`` (None when the directory has none)."""
    p = Path(path)
    if not p.is_dir():
        raise UserInputError(f"{p}: no such directory")
    unet_cfg, vae_cfg, text_cfg, noise = read_pipeline_configs(p)
    model = build_sd(unet_cfg, vae_cfg, text_cfg, noise, device="meta")
    model.to_empty(device=device)
    state = diffusers_to_native(
        read_weights(p / "unet", ("diffusion_pytorch_model",)),
        read_weights(p / "vae", ("diffusion_pytorch_model",)),
        read_weights(p / "text_encoder", ("model", "pytorch_model")))
    load_native_state(model, {k: v.float() for k, v in state.items()}, p)
    if dtype is not None:
        model.to(dtype)
    if (p / "tokenizer" / "vocab.json").is_file():
        model.tokenizer = CLIPTokenizer.from_dir(p / "tokenizer")
    return model.eval()


# ------------------------------------------------------------------ writing
def unet_config_to_diffusers(cfg: UNetConfig) -> dict:
    out = {"_class_name": "UNet2DConditionModel", "_diffusers_version": DIFFUSERS_VERSION}
    out.update({k: getattr(cfg, k) for k in _UNET_KEYS})
    out.update({"act_fn": "silu", "center_input_sample": False, "downsample_padding": 1,
                "mid_block_scale_factor": 1, "resnet_time_scale_shift": "default"})
    return out


def vae_config_to_diffusers(cfg: VAEConfig) -> dict:
    n = len(cfg.block_out_channels)
    out = {"_class_name": "AutoencoderKL", "_diffusers_version": DIFFUSERS_VERSION,
           "act_fn": "silu", "down_block_types": ["DownEncoderBlock2D"] * n,
           "up_block_types": ["UpDecoderBlock2D"] * n, "force_upcast": True}
    out.update({k: getattr(cfg, k) for k in _VAE_KEYS})
    return out


def text_config_to_transformers(cfg: TextEncoderConfig, dtype: torch.dtype) -> dict:
    out = {"architectures": ["CLIPTextModel"], "model_type": "clip_text_model",
           "attention_dropout": 0.0, "initializer_factor": 1.0, "initializer_range": 0.02,
           "projection_dim": cfg.hidden_size, "bos_token_id": 0, "eos_token_id": 2,
           "pad_token_id": 1, "torch_dtype": str(dtype).removeprefix("torch.")}
    out.update({k: getattr(cfg, k) for k in _TEXT_KEYS})
    return out


def noise_config_to_diffusers(cfg: NoiseConfig, sampler: str = "ddim") -> dict:
    cls = {"ddim": "DDIMScheduler", "euler": "EulerDiscreteScheduler"}[sampler]
    out = {"_class_name": cls, "_diffusers_version": DIFFUSERS_VERSION,
           "clip_sample": False, "set_alpha_to_one": False, "skip_prk_steps": True,
           "trained_betas": None}
    out.update({k: getattr(cfg, k) for k in _NOISE_KEYS})
    return out


def _save_tensors(state: dict[str, torch.Tensor], path: Path, dtype: torch.dtype | None) -> None:
    from safetensors.torch import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {}
    for k, v in state.items():
        v = v.detach().cpu()
        out[k] = (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
    save_file(out, str(path), metadata={"format": "pt"})


def save_diffusers(state: dict[str, torch.Tensor], unet: UNetConfig, vae: VAEConfig,
                   text: TextEncoderConfig, noise: NoiseConfig, out_dir: str | os.PathLike,
                   tokenizer: CLIPTokenizer | None = None, dtype: torch.dtype | None = None,
                   sampler: str = "ddim") -> Path:
    """Write a pipeline directory that ``StableDiffusionPipeline.from_pretrained``
    loads. ``state`` holds full tensors under native names (``unet.*``, ...)."""
    out = Path(out_dir)
    if (out / "model_index.json").exists():
        raise UserInputError(f"{out} already holds a diffusers pipeline; write into a new directory")
    parts = {"unet": {}, "vae": {}, "text_encoder": {}}
    for k, v in state.items():
        head, _, rest = k.partition(".")
        if head in parts:
            parts[head]["text_model." + rest if head == "text_encoder" else rest] = v
    wdtype = dtype or torch.float32
    _save_tensors(parts["unet"], out / "unet" / "diffusion_pytorch_model.safetensors", dtype)
    _save_tensors(parts["vae"], out / "vae" / "diffusion_pytorch_model.safetensors", dtype)
    _save_tensors(parts["text_encoder"], out / "text_encoder" / "model.safetensors", dtype)
    configs = {"unet/config.json": unet_config_to_diffusers(unet),
               "vae/config.json": vae_config_to_diffusers(vae),
               "text_encoder/config.json": text_config_to_transformers(text, wdtype),
               "scheduler/scheduler_config.json": noise_config_to_diffusers(noise, sampler)}
    for rel, conf in configs.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(json.dumps(conf, indent=2) + "\n")
    index = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": DIFFUSERS_VERSION,
             "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
             "text_encoder": ["transformers", "CLIPTextModel"],
             "scheduler": ["diffusers", configs["scheduler/scheduler_config.json"]["_class_name"]],
             "tokenizer": ["transformers", "CLIPTokenizer"] if tokenizer else [None, None],
             "safety_checker": [None, None], "feature_extractor": [None, None],
             "image_encoder": [None, None], "requires_safety_checker": False}
    if tokenizer is not None:
        tokenizer.save(out / "tokenizer")
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def save_model_diffusers(model: StableDiffusion, out_dir: str | os.PathLike,
                         dtype: torch.dtype | None = None, sampler: str = "ddim") -> Path:
    """``save_diffusers`` for a whole, unsharded in-memory model."""
    return save_diffusers(model.state_dict(), model.unet.cfg, model.vae.cfg,
                          model.text_encoder.cfg, model.noise, out_dir, model.tokenizer,
                          dtype, sampler)
