"""Model families: one module per Hugging Face ``model_type``, one line each here.

``from_hf``, ``checkpoint.init_from`` and ``giantmodel convert`` find a
family with :func:`family_for_hf` (from ``config.json``); an export finds it
with :func:`family_of` (``model.family``, else the arch's own). See
:mod:`giantmodel.models.families.base` for what a family defines.
"""

from __future__ import annotations

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig
from giantmodel.models.families import (
    deepseek_v3,
    gemma2,
    gemma3,
    gpt2,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from giantmodel.models.families.base import Family, Fused, NameMap

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY,
    gpt2.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    mistral.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
    mixtral.FAMILY,
    qwen3_moe.FAMILY,
    deepseek_v3.FAMILY,
)}
"""Family name (the ``model_type`` written on export) -> family."""

_DEFAULT_FOR_ARCH = {"llama": "llama", "gpt": "gpt2"}

__all__ = ["FAMILIES", "Family", "Fused", "NameMap", "family_for_hf", "family_of", "supported"]


def supported() -> list[str]:
    """Every HF ``model_type`` giantmodel reads."""
    return sorted({t for f in FAMILIES.values() for t in f.model_types})


def family_for_hf(hf: dict) -> Family:
    """The family of a HF ``config.json`` mapping: by ``model_type``, else by
    ``architectures``; a one-line UserInputError lists the supported ones."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    for f in FAMILIES.values():
        if model_type in f.model_types:
            return f
    if not model_type:
        for f in FAMILIES.values():
            if any(a in f.architectures for a in archs):
                return f
    raise UserInputError(f"unsupported Hugging Face model_type {model_type!r} (architectures "
                         f"{archs}); giantmodel reads {', '.join(supported())}")


def family_of(cfg: ModelConfig) -> Family:
    """The family a model's weights convert to: ``model.family``, else its arch's own."""
    name = cfg.family or _DEFAULT_FOR_ARCH.get(cfg.arch)
    if name not in FAMILIES:
        raise UserInputError(f"model.family {name!r} is not a known family; use one of "
                             f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]
