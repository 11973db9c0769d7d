"""The LoRA objective: the language model with low-rank adapters on a frozen base.

Everything the LM objective does still holds (data, loss, pipeline stages,
context parallelism); this class changes only what is built and what trains:

* ``build`` swaps the targeted block linears for :class:`LoRALinear` and
  freezes every base parameter (``requires_grad=False``), so the engine keeps
  gradients, optimizer state and gradient sync for the adapters alone; under
  ZeRO-3 FSDP2 shards the frozen base like any parameter;
* tensor parallelism shards each adapter consistently with its base weight
  (:mod:`giantmodel.objectives.lora_tp`);
* adapters start as PEFT's do (A Kaiming-uniform or Gaussian, B zero), drawn
  per name at full shape so every layout starts identically;
* the base comes from ``checkpoint.init_from``; checkpoints hold only the
  adapters unless ``lora.save_adapter_only`` is false;
* ``lora.quantize_base: nf4`` stores the frozen base linears in 4 bits (QLoRA).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from giantmodel.checkpoint import load_model_weights
from giantmodel.config.errors import ConfigError
from giantmodel.config.lora import LoRAConfig
from giantmodel.config.schema import JobConfig
from giantmodel.models.lora import (
    apply_lora,
    block_targets,
    freeze_base,
    is_lora_param,
    lora_init_tensor,
    quantize_base_nf4,
)
from giantmodel.models.registry import canonical_name, copy_full_into
from giantmodel.objectives.lm import LanguageModel
from giantmodel.objectives.lora_tp import lora_style
from giantmodel.parallel.objective import StageSpec
from giantmodel.parallel.tensor import apply_tensor_parallel


def _is_base(name: str) -> bool:
    return not is_lora_param(name)


class LoRA(LanguageModel):
    name = "lora"

    def __init__(self, model, *, data, train, lora: LoRAConfig, init_from: str | None = None):
        super().__init__(model, data=data, train=train)
        self.lora = lora
        self.init_from = init_from
        self._quantize_on_load = lora.quantize_base == "nf4"

    @classmethod
    def from_config(cls, cfg: JobConfig) -> LoRA:
        cfg.lora.validate(cfg.model.arch)
        if cfg.lora.quantize_base == "nf4":
            _check_nf4_layout(cfg)
        base = LanguageModel.from_config(cfg)
        obj = cls(base.model_cfg, data=base.data_cfg, train=base.train_cfg, lora=cfg.lora,
                  init_from=cfg.checkpoint.init_from)
        if not cfg.checkpoint.init_from:
            print("giantmodel: objective lora without checkpoint.init_from trains adapters on "
                  "a randomly initialised base", file=sys.stderr, flush=True)
        return obj

    # ------------------------------------------------------------ the model
    def build(self, stage: StageSpec) -> nn.Module:
        model = super().build(stage)
        c = self.lora
        try:
            apply_lora(model, c.targets, c.rank, c.alpha, c.dropout, self.model_cfg.arch)
        except ValueError as e:
            raise ConfigError(str(e), "lora.targets") from None
        freeze_base(model)
        return model

    def apply_tensor_parallel(self, module: nn.Module, tp_mesh, *, sp: bool) -> None:
        # The LM's plan, with each adapted linear sharded with its base.
        apply_tensor_parallel(module, tp_mesh, sp, style_for=lora_style)
        self._vocab_parallel = True

    def init_weights(self, module: nn.Module, device: torch.device) -> None:
        super().init_weights(module, device)
        for fqn, p in module.named_parameters():
            name = canonical_name(fqn)
            if is_lora_param(name):
                copy_full_into(p, lora_init_tensor(name, p.shape, self.lora.init, self.seed))
        if self._quantize_on_load and not self.init_from:
            quantize_base_nf4(module)

    def tied_parameters(self) -> list[tuple[str, str]]:
        # Embeddings are frozen: pipeline copies of a tied weight stay equal
        # without summing gradients they never get.
        return []

    # ------------------------------------------------------- around training
    def load_pretrained(self, parts: list[nn.Module], path: str | Path) -> Path:
        """The frozen base from ``path``; the adapters keep their initial values."""
        out = load_model_weights(parts, path, keep=_is_base)
        if self._quantize_on_load:
            for part in parts:
                quantize_base_nf4(part)
        return out

    def checkpoint_filter(self) -> Callable[[str], bool] | None:
        """Adapter-only checkpoints by default (the base is ``init_from``)."""
        return is_lora_param if self.lora.save_adapter_only else None

    def adapted_modules(self) -> list[str]:
        return block_targets(self.lora.targets, self.model_cfg.arch)


def _check_nf4_layout(cfg: JobConfig) -> None:
    """NF4 base weights replace the frozen parameters after loading, which
    sharded parameters (tensor parallelism, FSDP2) cannot take."""
    p = cfg.parallel
    if not cfg.lora.save_adapter_only:
        raise ConfigError("QLoRA checkpoints hold the adapters only (the NF4 base is re-made "
                          "from checkpoint.init_from); set lora.save_adapter_only=true",
                          "lora.save_adapter_only")
    if p.tp > 1:
        raise ConfigError("QLoRA's NF4 base weights cannot be tensor-parallel sharded; use "
                          "parallel.tp=1 (data parallelism with zero 0-2 works)",
                          "lora.quantize_base")
    if p.zero == 3 or (p.zero == 2 and p.pp > 1):
        raise ConfigError("QLoRA's NF4 base weights cannot be FSDP-sharded (zero 3, or zero 2 "
                          "with pipelines); use parallel.zero<=1, or zero 2 without pp",
                          "lora.quantize_base")
