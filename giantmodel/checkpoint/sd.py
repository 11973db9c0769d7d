"""A Stable Diffusion run's checkpoint as a whole in-memory model: for
``giantmodel generate`` and ``giantmodel convert --to diffusers``.

The run's ``config.yaml`` gives the shapes (or the diffusers directory they
came from), ``run.dir/tokenizer`` the tokenizer the run trained with, and
the checkpoint the weights; when the run kept an EMA of the UNet, the UNet
gets the EMA weights (what diffusers' scripts save), unless ``ema=False``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from giantmodel.checkpoint.layout import resolve_checkpoint_dir
from giantmodel.checkpoint.manager import dcp_error_message, dcp_load
from giantmodel.checkpoint.weights import load_model_weights
from giantmodel.config import load_config
from giantmodel.config.errors import UserInputError
from giantmodel.models.sd.diffusers_io import read_pipeline_configs, save_model_diffusers
from giantmodel.models.sd.model import StableDiffusion, build_sd, init_sd_weights
from giantmodel.models.sd.tokenizer import CLIPTokenizer


def is_sd_run(path: str | os.PathLike) -> bool:
    """Whether ``path`` (a run, checkpoints or step directory) belongs to a diffusion run."""
    try:
        step_dir = resolve_checkpoint_dir(path)
    except UserInputError:
        return False
    config = step_dir.parent.parent / "config.yaml"
    return config.is_file() and load_config(config, validate=False).objective == "diffusion"


def load_sd_checkpoint(path: str | os.PathLike, step: int | None = None, *, ema: bool = True,
                       device: str | torch.device = "cpu") -> StableDiffusion:
    """The whole model of a diffusion run's checkpoint, in eval mode, with its tokenizer."""
    step_dir = resolve_checkpoint_dir(path, step)
    run_dir = step_dir.parent.parent
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise UserInputError(f"{config} not found: give a giantmodel run directory")
    cfg = load_config(config, validate=False)
    if cfg.objective != "diffusion":
        raise UserInputError(f"{run_dir} is not a diffusion run (objective {cfg.objective!r})")
    sd = cfg.sd
    if sd.pretrained:
        unet, vae, text, noise = read_pipeline_configs(Path(sd.pretrained))
    else:
        unet, vae, text, noise = sd.unet, sd.vae, sd.text_encoder, sd.noise
    model = build_sd(unet, vae, text, noise, device="meta")
    init_sd_weights(model, cfg.train.seed, device)
    load_model_weights([model], step_dir)
    if ema and sd.ema:
        _load_ema_into_unet(model, step_dir)
    tok_dir = run_dir / "tokenizer"
    if (tok_dir / "vocab.json").is_file():
        model.tokenizer = CLIPTokenizer.from_dir(tok_dir)
    return model.eval()


def _load_ema_into_unet(model: StableDiffusion, step_dir: Path) -> None:
    # the EMA's checkpoint keys: "ema" / "shadow.unet.<parameter name>"
    params = {f"shadow.unet.{n}": p for n, p in model.unet.named_parameters() if p.requires_grad}
    shadows = {k: torch.empty_like(p) for k, p in params.items()}
    try:
        dcp_load({"ema": shadows}, step_dir)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported with its cause
        raise UserInputError(f"{step_dir}: cannot load the UNet's EMA ({dcp_error_message(e)}); "
                             "pass --no-ema to use the trained weights") from None
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(shadows[k])


def sd_run_to_diffusers(src: str | os.PathLike, dst: str | os.PathLike, step: int | None = None,
                        dtype: torch.dtype | None = None, ema: bool = True) -> Path:
    """Write a diffusion run's checkpoint as a diffusers pipeline directory."""
    step_dir = resolve_checkpoint_dir(src, step)
    model = load_sd_checkpoint(step_dir, ema=ema)
    save_model_diffusers(model, dst, dtype=dtype)
    return step_dir
