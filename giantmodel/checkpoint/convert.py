"""``giantmodel convert``: giantmodel checkpoints to Hugging Face and back.

giantmodel -> HF: SRC is a run directory (its newest checkpoint), its
``checkpoints`` directory or one ``step-N`` directory; the model shape comes
from the run's ``config.yaml``. The DCP checkpoint is read in one process, with
no process group, whatever layout wrote it.

A LoRA run (``objective: lora``) exports either merged (``--to hf
--merge-lora``: each adapted weight becomes ``W + (alpha/r) B A``, a plain HF
model) or as a PEFT adapter directory (``--to peft``: ``adapter_config.json``
and ``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained``
loads on the HF base model). Adapter-only checkpoints take the base from the
run's ``checkpoint.init_from``.

HF -> giantmodel: SRC is a HF directory; DST becomes a run directory holding
``config.yaml`` (the model section) and ``checkpoints/step-00000000``, usable
as ``checkpoint.init_from`` or by ``giantmodel generate``.

Both directions go through the model family (:mod:`giantmodel.models.families`):
``config.json``'s ``model_type`` on the way in (recorded as ``model.family``),
``model.family`` on the way out.

Stable Diffusion run -> diffusers (``--to diffusers``, the default for a
diffusion run): DST becomes a pipeline directory that
``diffusers.StableDiffusionPipeline.from_pretrained`` loads, with the UNet's
EMA weights when the run kept an EMA.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
import yaml

from giantmodel.checkpoint.layout import resolve_checkpoint_dir
from giantmodel.checkpoint.manager import CheckpointManager
from giantmodel.checkpoint.sd import is_sd_run, sd_run_to_diffusers
from giantmodel.checkpoint.state import ModelState
from giantmodel.checkpoint.weights import (
    is_hf_dir,
    load_model_from_checkpoint,
    read_lora_settings,
    read_model_config,
)
from giantmodel.config.errors import UserInputError
from giantmodel.config.loader import to_dict
from giantmodel.config.train import CheckpointConfig
from giantmodel.models.families import family_of
from giantmodel.models.hf import from_hf, plain_state, save_hf
from giantmodel.models.lora import merge_lora_state, save_peft_adapter

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 500MB or 2GB")
    scale = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9}
    return int(float(m.group(1)) * scale[m.group(2)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="giantmodel run/checkpoint directory, or a Hugging Face "
                                    "model directory")
    parser.add_argument("dst", help="output directory (must not already hold weights)")
    parser.add_argument("--to", choices=("hf", "giantmodel", "peft", "diffusers"), default=None,
                        help="target format; default: the opposite of SRC's format. peft: a "
                        "LoRA run's adapters as a PEFT adapter directory; diffusers: a Stable "
                        "Diffusion run as a pipeline directory")
    parser.add_argument("--merge-lora", action="store_true",
                        help="--to hf from a LoRA run: fold the adapters into the base weights")
    parser.add_argument("--step", type=int, default=None,
                        help="giantmodel -> hf: which checkpoint step (default: the latest)")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default=None,
                        help="cast floating weights (default: keep the stored dtype)")
    parser.add_argument("--max-shard-size", type=_size, default="2GB",
                        help="giantmodel -> hf: split safetensors above this size (default 2GB)")


def to_hf_dir(src: str | Path, dst: str | Path, step: int | None = None,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 2 * 10**9,
              merge_lora: bool = False) -> Path:
    step_dir = resolve_checkpoint_dir(src, step)
    cfg = read_model_config(step_dir)
    lora = read_lora_settings(step_dir)
    if lora is not None and not merge_lora:
        raise UserInputError(f"{step_dir} holds LoRA adapters; pass --merge-lora to write merged "
                             "Hugging Face weights, or use --to peft for an adapter directory")
    if lora is None and merge_lora:
        raise UserInputError(f"--merge-lora: {step_dir} was not trained with objective: lora")
    state = plain_state(load_model_from_checkpoint(step_dir))
    if lora is not None:
        state = merge_lora_state(state, lora[0].alpha / lora[0].rank)
    save_hf(state, cfg, dst, max_shard_bytes, dtype)
    return step_dir


def to_peft_dir(src: str | Path, dst: str | Path, step: int | None = None,
                dtype: torch.dtype | None = None) -> Path:
    """A LoRA run's adapters as a PEFT adapter directory for its HF base."""
    step_dir = resolve_checkpoint_dir(src, step)
    lora = read_lora_settings(step_dir)
    if lora is None:
        raise UserInputError(f"--to peft: {step_dir} was not trained with objective: lora")
    cfg = read_model_config(step_dir)
    family = family_of(cfg)
    settings, base = lora
    state = plain_state(load_model_from_checkpoint(step_dir))
    # The family's own HF names; its fused modules (Phi-3's qkv_proj) take
    # their parts' adapters combined into one exact LoRA
    save_peft_adapter(state, dst, targets=settings.targets, rank=settings.rank,
                      alpha=settings.alpha, dropout=settings.dropout, base_model=base,
                      dtype=dtype, names=family.names, cfg=cfg, family=family.name)
    return step_dir


def to_giantmodel_dir(src: str | Path, dst: str | Path,
                      dtype: torch.dtype | None = None) -> Path:

    dst = Path(dst)
    if (dst / "checkpoints").exists() or (dst / "config.yaml").exists():
        raise UserInputError(f"{dst} already holds a giantmodel run; convert into a new directory")
    model = from_hf(src, dtype=dtype)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.yaml").write_text(yaml.safe_dump({"model": to_dict(model.cfg)},
                                                    sort_keys=False))
    manager = CheckpointManager(CheckpointConfig(keep=0), dst, is_rank0=True)
    manager.save(0, {"model": ModelState([model])})
    manager.close()
    return manager.step_dir(0)


def main(args: argparse.Namespace) -> int:

    src = Path(args.src)
    if not src.exists():
        raise UserInputError(f"{src}: no such directory")
    target = args.to or ("giantmodel" if is_hf_dir(src) else "diffusers" if is_sd_run(src) else "hf")
    dtype = _DTYPES[args.dtype] if args.dtype else None
    if target == "diffusers":
        step_dir = sd_run_to_diffusers(src, args.dst, args.step, dtype)
        print(f"wrote diffusers pipeline to {args.dst} (from {step_dir})")
        return 0
    if target in ("hf", "peft"):
        if is_hf_dir(src):
            raise UserInputError(f"{src} is already a Hugging Face directory")
        if target == "peft":
            step_dir = to_peft_dir(src, args.dst, args.step, dtype)
            print(f"wrote PEFT adapter to {args.dst} (from {step_dir})")
            return 0
        step_dir = to_hf_dir(src, args.dst, args.step, dtype, args.max_shard_size,
                             merge_lora=args.merge_lora)
        print(f"wrote Hugging Face model to {args.dst} (from {step_dir}"
              f"{', adapters merged' if args.merge_lora else ''})")
    else:
        if not is_hf_dir(src):
            raise UserInputError(f"{src} is not a Hugging Face directory (no config.json)")
        step_dir = to_giantmodel_dir(src, args.dst, dtype)
        print(f"wrote giantmodel checkpoint {step_dir} and {Path(args.dst) / 'config.yaml'}")
    return 0
