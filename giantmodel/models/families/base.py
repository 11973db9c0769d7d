"""What a model family is: its Hugging Face names and config keys, both ways.

A family maps one HF ``model_type`` onto the shared transformer. Its
differences from the shared block live in :class:`ModelConfig` fields (a bias
pattern, qk-norm, a window, ...) that the block reads; the family only says
which fields its ``config.json`` sets (:meth:`Family.config_from_hf`), how to
write them back (:meth:`Family.config_to_hf`), which of them its format can
express (:meth:`Family.check`), and how tensors are named and laid out
(:class:`NameMap`, with per-tensor transforms: transposed ``Conv1D`` weights,
fused projections split on load and concatenated on save).

A new family is a module defining a :class:`Family` (usually a subclass of
another, overriding a few methods) plus one line in ``families/__init__.py``.
A family whose tensors are not one-to-one or fused renames (stacked experts)
overrides :meth:`Family.to_native` / :meth:`Family.to_hf`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig

# Buffers that old checkpoints stored next to the weights; recomputed here.
IGNORED = re.compile(r"(?:^|\.)(?:rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")
_NATIVE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


@dataclass(frozen=True)
class Fused:
    """One HF tensor holding several giantmodel tensors stacked along the
    output dimension (dim 0 of a Linear weight, or of its bias)."""

    parts: tuple[str, ...]
    """giantmodel module names (inside a block), in their HF order."""
    sizes: Callable[[ModelConfig], tuple[int, ...]]
    """Rows of each part for a given config."""


@dataclass(frozen=True)
class NameMap:
    """HF tensor names <-> giantmodel names.

    HF names are ``base + top name`` or ``base + layers.N.module.leaf``; the
    head (``lm_head.weight``) sits outside ``base``. On read ``base`` may be
    absent (a bare GPT2Model has none)."""

    base: str
    """Prefix of everything but the head: 'model.' (llama-like) or 'transformer.' (GPT-2)."""
    layers: str
    """HF name of the layer list under ``base``: 'layers' or 'h'."""
    top: dict[str, str]
    """HF name under ``base`` -> giantmodel name, for non-layer tensors."""
    layer: dict[str, str]
    """HF module inside a layer -> giantmodel module inside a block."""
    fused: dict[str, Fused] = field(default_factory=dict)
    """HF module inside a layer -> the giantmodel modules it packs."""
    transposed: frozenset[str] = frozenset()
    """HF modules (in ``layer`` or ``fused``) whose weights are stored [in, out]."""
    head: str = "lm_head.weight"

    def layer_re(self) -> re.Pattern:
        return re.compile(rf"^{re.escape(self.layers)}\.(\d+)\.(.+)\.(weight|bias)$")


class Family:
    """A HF model family (see the module docstring). Subclasses set the
    class attributes and override what differs."""

    name: str = ""
    """Written as ``model_type`` on export, and as ``model.family``."""
    model_types: tuple[str, ...] = ()
    """``model_type`` values read as this family."""
    architectures: tuple[str, ...] = ()
    """HF ``architectures`` entries that identify it when ``model_type`` is absent;
    the first is written on export."""
    arch: str = "llama"
    """The giantmodel skeleton (``model.arch``) this family builds."""
    softcaps: frozenset[str] = frozenset()
    """Which soft-caps (``attn_softcap``, ``final_softcap``) the format's
    ``config.json`` carries and transformers' class applies (Gemma 2 both,
    Gemma 3 the final one); :meth:`check_export` refuses the others."""
    names: NameMap

    # ------------------------------------------------------------- config
    def config_from_hf(self, hf: dict) -> dict:
        """ModelConfig keyword arguments read from a HF ``config.json`` mapping
        (missing required keys raise KeyError; the caller reports them)."""
        raise NotImplementedError

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """The ``config.json`` mapping (without dtype keys) that rebuilds ``cfg``."""
        raise NotImplementedError

    def check(self, cfg: ModelConfig) -> None:
        """Raise UserInputError when ``cfg`` has something this format cannot
        express (so an export never drops a tensor or a setting silently)."""

    def check_export(self, cfg: ModelConfig, families: dict[str, Family]) -> None:
        """:meth:`check`, after the soft-caps, which a format without them
        (:attr:`softcaps`) would drop: the export would compute other logits
        than the model trained. ``families``: the registry, to name the
        formats that can take a cap."""
        for key in ("attn_softcap", "final_softcap"):
            cap = getattr(cfg, key)
            if cap is not None and key not in self.softcaps:
                able = " or ".join(sorted(n for n, f in families.items() if key in f.softcaps))
                raise UserInputError(
                    f"model.{key}={cap!r} cannot be written in the {self.name} format "
                    f"(transformers' {(self.architectures or (self.name,))[0]} has no such "
                    f"soft-cap); export it as {able}")
        self.check(cfg)

    def refuse(self, cfg: ModelConfig, **expected) -> None:
        """Helper for :meth:`check`: every ``model.<key>`` must equal its value."""
        for key, want in expected.items():
            have = getattr(cfg, key)
            if have != want:
                raise UserInputError(
                    f"model.{key}={have!r} cannot be written in the {self.name} format "
                    f"(it needs {want!r}); set model.family to a family that has it "
                    f"(giantmodel.models.families.supported())")

    # ------------------------------------------------------------- tensors
    def to_native(self, name: str, tensor: torch.Tensor,
                  cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
        """One HF tensor -> giantmodel tensors; [] for recomputed buffers."""
        if IGNORED.search(name):
            return []
        nm = self.names
        if name == nm.head:
            return [("output.weight", tensor)]
        short = name.removeprefix(nm.base)
        if short in nm.top:
            return [(nm.top[short], tensor)]
        m = nm.layer_re().match(short)
        if m is None:
            raise UserInputError(f"unexpected tensor {name!r} in a {self.name} checkpoint")
        idx, module, leaf = m.groups()
        prefix = f"layers.{idx}."
        if leaf == "weight" and module in nm.transposed:
            tensor = tensor.t()
        if module in nm.fused:
            fused = nm.fused[module]
            pieces = tensor.split(list(fused.sizes(cfg)), dim=0)
            return [(f"{prefix}{part}.{leaf}", x.contiguous())
                    for part, x in zip(fused.parts, pieces)]
        if module not in nm.layer:
            raise UserInputError(f"unexpected tensor {name!r} in a {self.name} checkpoint")
        return [(f"{prefix}{nm.layer[module]}.{leaf}", tensor.contiguous())]

    def to_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """A giantmodel full state dict -> HF tensors (a tied head omitted, as HF does)."""
        nm = self.names
        inv_top = {v: nm.base + k for k, v in nm.top.items()}
        inv_layer = {v: k for k, v in nm.layer.items()}
        part_of = {part: (hf, fused) for hf, fused in nm.fused.items() for part in fused.parts}
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            if name == "output.weight":
                if not cfg.tie_embeddings:
                    out[nm.head] = t
                continue
            if name in inv_top:
                out[inv_top[name]] = t
                continue
            m = _NATIVE_LAYER.match(name)
            if m is None:
                raise ValueError(f"unexpected parameter {name!r} for a {self.name} model")
            idx, module, leaf = m.groups()
            if module in part_of:
                hf, fused = part_of[module]
                if module != fused.parts[0]:
                    continue  # written once, with the first part
                t = torch.cat([state[f"layers.{idx}.{p}.{leaf}"] for p in fused.parts], dim=0)
            elif module in inv_layer:
                hf = inv_layer[module]
            else:
                raise ValueError(f"unexpected parameter {name!r} for a {self.name} model")
            if leaf == "weight" and hf in nm.transposed:
                t = t.t()
            out[f"{nm.base}{nm.layers}.{idx}.{hf}.{leaf}"] = t
        return out
