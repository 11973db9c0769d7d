"""Stateful wrappers: what a checkpoint holds, under layout-independent names.

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict``
(get/set_model_state_dict, get/set_optimizer_state_dict), which strips wrapper
prefixes (DDP, torch.compile, activation checkpointing) and keeps FSDP2 and
tensor-parallel parameters as DTensors. Every key is therefore a canonical
parameter name (``layers.3.attention.wq.weight``) whatever the layout, and DCP
reshards DTensor pieces on load. A rank that holds only some layers (a pipeline
stage) saves and loads only those keys; the union over ranks is the model.

Per-rank state (RNG streams, anything wrapped in :class:`PerRank`) must not go
through DCP, which keeps one copy of equal keys across ranks: the manager
writes it to one small file per rank instead.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from giantmodel.models.registry import canonical_name

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _as_parts(parts: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    if isinstance(parts, nn.Module):
        return [parts]
    parts = list(parts)
    if not parts:
        raise ValueError("need at least one model part")
    return parts


def _unwrap(module: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel
    return module.module if isinstance(module, DistributedDataParallel) else module


def model_config_of(parts: list[nn.Module]):
    """The ModelConfig a (possibly wrapped) giantmodel model carries, or None."""
    for part in parts:
        cfg = getattr(_unwrap(part), "cfg", None)
        if cfg is not None:
            return cfg
    return None


class ModelState:
    """Model parameters and persistent buffers of one rank's model parts.

    ``parts`` are the modules this rank holds: one for plain, DDP, FSDP2 and
    tensor-parallel models; one per virtual stage under pipeline parallelism.
    ``keep`` selects the names that are saved and loaded (all when None):
    LoRA checkpoints keep only the adapters, whose frozen base stays in its
    pretrained directory.
    """

    def __init__(self, parts: nn.Module | Iterable[nn.Module],
                 keep: Callable[[str], bool] | None = None):
        self.parts = _as_parts(parts)
        self.keep = keep

    def _own(self, part: nn.Module) -> dict[str, Any]:
        state = get_model_state_dict(part)
        if self.keep is None:
            return state
        return {k: v for k, v in state.items() if self.keep(k)}

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(self._own(part))
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            keys = self._own(part).keys()
            # A partial state (only ``keep``'s names) cannot be strict.
            set_model_state_dict(part, {k: state[k] for k in keys},
                                 options=StateDictOptions(strict=self.keep is None))


class _PartsView(nn.Module):
    """One module whose parameter names are the union of several parts'.

    Needed when a single optimizer spans several pipeline stages on one rank:
    the state_dict API maps optimizer parameters to names through one module.
    ModuleDicts of layers (keyed by global index) are merged; other children
    must not repeat.
    """

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        for part in parts:
            part = _unwrap(part)
            for name, p in part.named_parameters(recurse=False):
                self.register_parameter(name, p)
            for name, child in part.named_children():
                have = self._modules.get(name)
                if have is child or next(child.parameters(), None) is None:
                    continue
                if isinstance(child, nn.ModuleDict):
                    merged = dict(have.items()) if isinstance(have, nn.ModuleDict) else {}
                    overlap = merged.keys() & child.keys()
                    if overlap:
                        raise ValueError(f"model parts both hold {name}.{sorted(overlap)}")
                    self._modules[name] = nn.ModuleDict({**merged, **dict(child.items())})
                elif have is not None:
                    raise ValueError(f"model parts both hold {name!r}")
                else:
                    self._modules[name] = child


def _tied_aliases(module: nn.Module) -> list[list[str]]:
    """Groups of canonical names that share one parameter (tied embeddings)."""
    by_id: dict[int, list[str]] = {}
    for fqn, p in _unwrap(module).named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(canonical_name(fqn))
    return [names for names in by_id.values() if len(names) > 1]


class OptimizerState:
    """Optimizer state keyed by parameter name (``state.<fqn>.exp_avg``,
    ``param_groups.<fqn>.lr``), so it reshards like the parameters.

    ``optimizer`` is one optimizer over all of ``parts``, or a list with one
    optimizer per part. A parameter shared under several names (tied
    embeddings) is saved under each, so a pipeline stage that holds only the
    output head finds its state in a checkpoint written by a tied model.
    """

    def __init__(self, parts: nn.Module | Iterable[nn.Module],
                 optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]):
        self.parts = _as_parts(parts)
        if isinstance(optimizer, (list, tuple)):
            if len(optimizer) != len(self.parts):
                raise ValueError(f"{len(optimizer)} optimizers for {len(self.parts)} model "
                                 "parts; pass one optimizer, or one per part")
            self._pairs = list(zip(self.parts, optimizer))
        elif len(self.parts) == 1:
            self._pairs = [(self.parts[0], optimizer)]
        else:
            self._pairs = [(_PartsView(self.parts), optimizer)]
        # names added as aliases of tied parameters by the last state_dict()
        self._aliases: list[set[str]] | None = None

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self._aliases = []
        for module, optim in self._pairs:
            _materialize_state(optim)
            sd = get_optimizer_state_dict(module, optim, options=_OPTIM_OPTIONS)
            added: set[str] = set()
            for names in _tied_aliases(module):
                present = [n for n in names if any(k.startswith(f"param_groups.{n}.") for k in sd)]
                if not present:
                    continue
                src = present[0]
                for alias in set(names) - set(present):
                    added.add(alias)
                    for section in ("state", "param_groups"):
                        prefix = f"{section}.{src}."
                        for key in [k for k in sd if k.startswith(prefix)]:
                            sd[f"{section}.{alias}.{key[len(prefix):]}"] = sd[key]
            self._aliases.append(added)
            out.update(sd)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._aliases is None:
            self.state_dict()
        for (module, optim), added in zip(self._pairs, self._aliases):
            # torch picks which name of a shared parameter to read by which
            # one is present, so the aliases added on save must go.
            prefixes = tuple(f"{sec}.{a}." for a in added for sec in ("state", "param_groups"))
            own = {k: v for k, v in state.items() if not (prefixes and k.startswith(prefixes))}
            set_optimizer_state_dict(module, optim, own, options=_OPTIM_OPTIONS)


@torch.no_grad()
def _materialize_state(optim: torch.optim.Optimizer) -> None:
    """Create the optimizer's state if it has none yet, so that a checkpoint
    load has tensors to fill. torch does this only when no parameter has a
    gradient, and gradients that are views of a flat buffer always exist; so
    here the gradients are set aside, a zero-gradient step at lr 0 creates
    the state, its step counters go back to 0 -- the same as no state at all
    for the next real step -- and the gradients come back."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    saved = [p.grad for p in params]
    lrs = [g["lr"] for g in optim.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optim.param_groups:
        g["lr"] = 0.0
    optim.step()
    for st in optim.state.values():
        if torch.is_tensor(st.get("step")):
            st["step"].zero_()
        elif "step" in st:
            st["step"] = 0
    for g, lr in zip(optim.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p, grad in zip(params, saved, strict=True):
        p.grad = grad


class PerRank:
    """Marks state that differs between ranks (a data loader's position in
    its shard, for instance); the checkpoint keeps one copy per rank.

    ``fallback`` applies when the world size changed since the save and this
    rank has no saved copy: ``'rank0'`` loads rank 0's copy, ``'skip'`` keeps
    the current state.
    """

    per_rank = True

    def __init__(self, obj: Any, fallback: Literal["rank0", "skip"] = "rank0"):
        self.obj = obj
        self.fallback = fallback

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict() if hasattr(self.obj, "state_dict") else dict(self.obj)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.obj, "load_state_dict"):
            self.obj.load_state_dict(state)
        else:
            self.obj.clear()
            self.obj.update(state)


class RNGState:
    """This rank's random streams: Python, NumPy, torch CPU and the current
    CUDA device. Saved per rank; after a world-size change a rank without a
    saved stream keeps its freshly seeded one."""

    per_rank = True
    fallback = "skip"

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out: dict[str, Any] = {
            "python": [version, list(internal), gauss],
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                      float(cached)],
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


def is_per_rank(obj: Any) -> bool:
    return bool(getattr(obj, "per_rank", False))
