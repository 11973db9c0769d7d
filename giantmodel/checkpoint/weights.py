"""Model weights alone: initialise from a checkpoint or a HF directory, read a
checkpoint's model config, and build a whole model from a checkpoint (for
``generate`` and ``convert``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from giantmodel.checkpoint import layout
from giantmodel.checkpoint.integrity import CheckpointIntegrityError
from giantmodel.checkpoint.manager import dcp_error_message, dcp_load, verify_checkpoint
from giantmodel.checkpoint.state import ModelState
from giantmodel.config.errors import UserInputError
from giantmodel.config.loader import from_dict
from giantmodel.config.lora import LoRAConfig
from giantmodel.config.model import ModelConfig
from giantmodel.models.hf import from_hf, load_hf_into
from giantmodel.models.lora import apply_lora, is_lora_param
from giantmodel.models.registry import build_model


def is_hf_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and not (p / layout.DCP_METADATA).is_file()


def load_model_weights(parts: nn.Module | list[nn.Module], path: str | os.PathLike,
                       process_group=None, keep=None) -> Path:
    """Fill ``parts`` (plain, sharded or pipeline stages) with the weights
    saved at ``path``: a HF directory, or a giantmodel run directory,
    ``checkpoints`` directory or step directory (its newest checkpoint).
    Optimizer and other state in the checkpoint are ignored. ``keep``
    (name -> bool) limits which parameters are filled, e.g. a LoRA model's
    frozen base without its adapters. Returns the directory read. Under a
    process group every rank must call this."""
    parts = [parts] if isinstance(parts, nn.Module) else list(parts)
    if is_hf_dir(path):
        load_hf_into(parts, path, keep=keep)
        return Path(path)
    step_dir = layout.resolve_checkpoint_dir(path)
    problems = verify_checkpoint(step_dir, process_group)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointIntegrityError(f"{step_dir} failed verification: {problems[0]}{more}")
    try:
        dcp_load({"model": ModelState(parts, keep)}, step_dir, process_group)
    except (Exception, CheckpointException) as e:  # reported with its cause
        raise UserInputError(f"{step_dir}: cannot load model weights ({dcp_error_message(e)}); "
                             "was the checkpoint saved by a model with this config?") from None
    return step_dir


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a giantmodel checkpoint: from the run's
    ``config.yaml`` (``run.dir/config.yaml``, two levels above a step
    directory), else from the checkpoint's own ``meta.json``."""

    step_dir = layout.resolve_checkpoint_dir(path)
    for candidate in (step_dir.parent.parent / "config.yaml", step_dir / "config.yaml"):
        if candidate.is_file():
            raw = yaml.safe_load(candidate.read_text()) or {}
            if "model" in raw:
                return from_dict(ModelConfig, raw["model"], prefix="model")
    meta = layout.read_meta(step_dir)
    if "model_config" in meta:
        return from_dict(ModelConfig, meta["model_config"], prefix="model")
    raise UserInputError(f"{step_dir}: cannot tell the model's shape: no config.yaml in the run "
                         "directory and no model_config in meta.json")


def read_lora_settings(path: str | os.PathLike) -> tuple[LoRAConfig, str | None] | None:
    """``(lora section, checkpoint.init_from)`` of the run that wrote the
    checkpoint at ``path`` when it trained LoRA adapters (objective lora, or
    dpo with dpo.use_lora), else None."""
    step_dir = layout.resolve_checkpoint_dir(path)
    run_cfg = step_dir.parent.parent / "config.yaml"
    if not run_cfg.is_file():
        return None
    raw = yaml.safe_load(run_cfg.read_text()) or {}
    dpo_lora = raw.get("objective") == "dpo" and (raw.get("dpo") or {}).get("use_lora")
    if raw.get("objective") != "lora" and not dpo_lora:  # DPO with LoRA saves adapters too
        return None
    lora = from_dict(LoRAConfig, raw.get("lora") or {}, prefix="lora")
    return lora, (raw.get("checkpoint") or {}).get("init_from")


def load_model_from_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu",
                               dtype: torch.dtype | None = None) -> nn.Module:
    """A whole model built from a checkpoint's config and weights (one
    process, no process group), in eval mode, carrying ``model.cfg``.

    A LoRA run's model comes back with its adapters (``LoRALinear`` modules);
    when its checkpoints hold only the adapters, the frozen base is read
    from the run's ``checkpoint.init_from``."""

    if is_hf_dir(path):
        return from_hf(path, device=device, dtype=dtype)
    cfg = read_model_config(path)
    lora = read_lora_settings(path)
    model = build_model(cfg, device="meta")
    if lora is not None:
        apply_lora(model, lora[0].targets, lora[0].rank, lora[0].alpha, 0.0, cfg.arch)
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "tie_weights"):
            module.tie_weights()
    if lora is not None and lora[0].save_adapter_only:
        if not lora[1]:
            raise UserInputError(f"{path}: the checkpoint holds LoRA adapters only and its run "
                                 "names no checkpoint.init_from to read the base weights from")
        load_model_weights([model], lora[1], keep=lambda name: not is_lora_param(name))
        load_model_weights([model], path, keep=is_lora_param)
    else:
        load_model_weights([model], path)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(device=device)
    if dtype is not None:
        model.to(dtype)
    return model.eval()
