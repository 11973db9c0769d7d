"""Objectives: what differs between kinds of training, as plug-ins.

An objective builds its model, names what trains and what is frozen, turns
a batch into ``(loss_sum, count)``, builds its data loaders, loads
pretrained weights and says how its weights convert to and from other
formats. The contract the engine relies on, and the order in which it calls
each method, is documented in :mod:`giantmodel.parallel.objective`.

A new kind of training is one module here and one entry in ``OBJECTIVES``
(keyed by the config's ``objective`` value); nothing in the engine or the
trainer changes.
"""

from __future__ import annotations

from collections.abc import Callable

from giantmodel.config.errors import ConfigError
from giantmodel.config.schema import JobConfig
from giantmodel.objectives.diffusion import Diffusion
from giantmodel.objectives.dpo import DPO
from giantmodel.objectives.lm import LanguageModel
from giantmodel.objectives.lora import LoRA
from giantmodel.parallel.objective import BaseObjective

OBJECTIVES: dict[str, Callable[..., BaseObjective]] = {
    "lm": LanguageModel.from_config,
    "lora": LoRA.from_config,
    "diffusion": Diffusion.from_config,
    "dpo": DPO.from_config,
}


def build_objective(cfg: JobConfig) -> BaseObjective:
    """The objective ``cfg.objective`` names, built from the job config."""
    try:
        factory = OBJECTIVES[cfg.objective]
    except KeyError:
        raise ConfigError(f"unknown objective {cfg.objective!r}; use one of "
                          f"{', '.join(sorted(OBJECTIVES))}", "objective") from None
    return factory(cfg)


__all__ = ["DPO", "OBJECTIVES", "Diffusion", "LanguageModel", "LoRA", "build_objective"]
