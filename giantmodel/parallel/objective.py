"""The Objective contract: what one kind of training brings to the engine.

Training a language model, a diffusion model or a LoRA fine-tune differs in
the model that is built, in which of its weights train, and in how a batch
becomes a loss. Everything else -- tensor, context, pipeline and data
parallelism, ZeRO, recompute, offload, mixed precision, clipping, the
optimizer, checkpoints -- is the engine's, and is the same for every model.

An objective is one class in ``giantmodel/objectives/`` plus one line in the
registry there; it never adds a branch to the engine or the trainer. Its
model is a plain ``nn.Module`` (a package under ``giantmodel/models/``) that
knows nothing of torch.distributed. The engine calls the objective, in this
order, on every rank:

1. ``build(stage)`` -- the model, or the pipeline stage ``stage`` of it, on
   the meta device, with frozen parameters already marked
   ``requires_grad=False`` (frozen weights get no gradient buffer, no
   optimizer state and no gradient sync);
2. ``apply_tensor_parallel`` / ``apply_context_parallel`` when ``tp`` / ``cp``
   exceed 1 (only for the dimensions named in ``supports``: the layout is
   checked against it before any process group exists);
3. ``blocks(module)`` names the repeated units (dotted module paths): each is
   wrapped for activation recompute and offload, compiled, and made an FSDP2
   unit; ``edge_units(module)`` lists further FSDP2 units (embeddings, head);
4. ``init_weights(module, device)`` materialises the meta module and draws
   every parameter layout-independently, so every layout starts from the
   single-process weights;
5. per step, for each micro-batch: ``loss_units(batch)`` counts what the
   loss averages over (tokens, images) before any forward, so the engine can
   scale each micro-batch by the global count; ``loss(module, batch)``
   returns ``(loss_sum, count)`` for this rank's share of the batch, inside
   ``loss_context()``.

Pipeline parallelism (``"pp"`` in ``supports``) additionally needs
``stage_inputs``, ``stage_loss`` and, where weights are shared between the
first and the last stage, ``tied_parameters``.

Outside the engine, the trainer asks the objective for its data loaders
(``build_loaders``), for initial weights from a pretrained directory
(``load_pretrained``), for which weights its checkpoints hold
(``checkpoint_filter``: all of them by default; a LoRA fine-tune saves only
its adapters, since the frozen base is ``checkpoint.init_from`` and never
changes) and, after training, for a sample (``sample``). It calls
``after_step()`` after every applied optimizer step and checkpoints the
objects ``state()`` returns with the rest of the run (an objective that
keeps an EMA of its weights needs both).
Conversion to and from Hugging Face / diffusers formats lives beside each
model and is reached through the objective (``export``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from giantmodel.config.errors import ConfigError


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model a rank builds: the whole model, or one stage."""

    index: int = 0
    """Global pipeline stage index."""
    num_stages: int = 1
    """Stages in the whole pipeline (pp x virtual stages)."""
    layers: range | None = None
    """Indices of the repeated blocks this stage keeps; None keeps all."""

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def whole(self) -> bool:
        return self.num_stages == 1


@runtime_checkable
class Objective(Protocol):
    """See the module docstring for when the engine calls each method."""

    name: str
    supports: frozenset[str]

    # ------------------------------------------------------------ the model
    def build(self, stage: StageSpec) -> nn.Module: ...

    def blocks(self, module: nn.Module) -> list[str]: ...

    def edge_units(self, module: nn.Module) -> list[list[nn.Module]]: ...

    def apply_tensor_parallel(self, module: nn.Module, tp_mesh, *, sp: bool) -> None: ...

    def apply_context_parallel(self, module: nn.Module, cp_mesh) -> None: ...

    def init_weights(self, module: nn.Module, device: torch.device) -> None: ...

    def tied_parameters(self) -> list[tuple[str, str]]: ...

    # ------------------------------------------------------------- the loss
    def loss_units(self, batch: dict) -> int: ...

    def loss(self, module: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]: ...

    def loss_context(self) -> contextlib.AbstractContextManager: ...

    # ------------------------------------------------------------ pipelines
    def stage_inputs(self, batch: dict) -> tuple[tuple, dict, Any]: ...

    def stage_loss(self, output: torch.Tensor, target: Any) -> torch.Tensor: ...


class BaseObjective:
    """Defaults for the optional parts of :class:`Objective`: data
    parallelism only (no tensor, context or pipeline plan), no extra FSDP
    units, no tied weights, nothing to sample. Subclasses override what their
    model supports and list it in ``supports``."""

    name = "base"
    supports: frozenset[str] = frozenset()

    def edge_units(self, module: nn.Module) -> list[list[nn.Module]]:
        return []

    def apply_tensor_parallel(self, module: nn.Module, tp_mesh, *, sp: bool) -> None:
        raise NotImplementedError(f"{self.name}: no tensor-parallel plan")

    def apply_context_parallel(self, module: nn.Module, cp_mesh) -> None:
        raise NotImplementedError(f"{self.name}: no context-parallel plan")

    def tied_parameters(self) -> list[tuple[str, str]]:
        return []

    def loss_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def stage_inputs(self, batch: dict) -> tuple[tuple, dict, Any]:
        raise NotImplementedError(f"{self.name}: no pipeline stages")

    def stage_loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        raise NotImplementedError(f"{self.name}: no pipeline stages")

    def sample(self, model: nn.Module) -> str | None:
        """Something to show after training (text, an image path); None for nothing."""
        return None

    def step_units(self) -> tuple[str, int]:
        """What throughput is counted in, and how many of it one optimizer
        step processes: ("tokens", global batch x sequence length) for an LM."""
        return "samples", 0

    def flops_per_unit(self) -> float:
        """Model FLOPs (forward + backward) per throughput unit, for MFU; 0 when unknown."""
        return 0.0

    def checkpoint_filter(self) -> Callable[[str], bool] | None:
        """Which model parameters checkpoints hold, by canonical name; None
        for all. A checkpoint that holds only some (LoRA's adapters) is
        completed from ``checkpoint.init_from`` when training resumes, and
        by ``giantmodel convert`` when it is exported."""
        return None

    def model_name(self) -> str:
        """The model's name, for logs and the comm tuner's cache key."""
        return self.name

    def num_params(self) -> int:
        """Parameters of the whole model, for logs and the comm tuner's cache key."""
        return 0

    def step_metrics(self) -> dict[str, float]:
        """Objective-specific metrics of the step just run, reduced over the
        ranks (DPO's rewards/*); called on every rank after every step."""
        return {}

    def after_step(self) -> None:
        """Runs after every applied optimizer step (an EMA of the weights updates here)."""
        return None

    def state(self) -> dict[str, Any]:
        """Further objects (with state_dict / load_state_dict) checkpointed with the
        run under these keys, e.g. an EMA of the weights; tensors may be DTensors."""
        return {}


def check_supported(objective: Objective, *, tp: int, cp: int, pp: int) -> None:
    """Refuse a layout the objective's model has no plan for; runs with the
    other layout checks, before any process group exists."""
    for dim, degree in (("tp", tp), ("cp", cp), ("pp", pp)):
        if degree > 1 and dim not in objective.supports:
            raise ConfigError(f"the {objective.name} objective does not support {dim} > 1; "
                              f"set parallel.{dim}=1", f"parallel.{dim}")
