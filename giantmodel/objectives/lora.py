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
    nf4_quantizable,
    quantize_base_nf4,
)
from giantmodel.models.registry import canonical_name, copy_full_into, full_init_tensor
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
        self.frozen_dtype: torch.dtype | None = None
        """The dtype the frozen float base is kept in (bf16 under bf16
        training: autocast would cast it to bf16 for every matmul anyway);
        None keeps it as built (fp32). The adapters stay fp32."""

    @classmethod
    def from_config(cls, cfg: JobConfig) -> LoRA:
        cfg.lora.validate(cfg.model.arch)
        if cfg.lora.quantize_base == "nf4":
            _check_nf4_layout(cfg)
        base = LanguageModel.from_config(cfg)
        obj = cls(base.model_cfg, data=base.data_cfg, train=base.train_cfg, lora=cfg.lora,
                  init_from=cfg.checkpoint.init_from)
        if cfg.precision == "bf16":
            obj.frozen_dtype = torch.bfloat16
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
        # Freeze again: parallel styles re-register the parameters they shard
        # (SequenceParallel's norm weights come back trainable).
        freeze_base(module)
        # QLoRA: the linears NF4 will hold are never materialised in float
        # on the device; they are staged on the CPU (filled by
        # load_pretrained, or drawn here) and quantised one by one on their
        # way to it.
        staged = _unregister_nf4_bases(module) if self._quantize_on_load else {}
        super().init_weights(module, device)
        for fqn, p in module.named_parameters():
            name = canonical_name(fqn)
            if is_lora_param(name):
                copy_full_into(p, lora_init_tensor(name, p.shape, self.lora.init, self.seed))
        for fqn, (m, meta) in staged.items():
            # In the compute dtype when it is bf16: half the host memory, and
            # the values NF4 would be made from anyway.
            cpu = torch.empty(meta.shape, dtype=self.frozen_dtype or meta.dtype, device="cpu")
            if not self.init_from:  # a random base: the values plain init draws
                cpu.copy_(full_init_tensor(canonical_name(fqn), meta.shape, self.model_cfg,
                                           self.seed))
            m.weight = nn.Parameter(cpu, requires_grad=False)
        if not self.init_from:
            self._finish_base(module, device)

    def _finish_base(self, module: nn.Module, device: torch.device) -> None:
        """The frozen base once it holds its values: NF4 linears moved to
        ``device``, the other frozen float parameters in ``frozen_dtype``."""
        if self._quantize_on_load:
            quantize_base_nf4(module, device, self.frozen_dtype)
        if self.frozen_dtype is not None:
            cast_frozen(module, self.frozen_dtype)

    def tied_parameters(self) -> list[tuple[str, str]]:
        # Embeddings are frozen: pipeline copies of a tied weight stay equal
        # without summing gradients they never get.
        return []

    # ------------------------------------------------------- around training
    def load_pretrained(self, parts: list[nn.Module], path: str | Path) -> Path:
        """The frozen base from ``path``; the adapters keep their initial values."""
        out = load_model_weights(parts, path, keep=_is_base)
        for part in parts:
            self._finish_base(part, _device_of(part))
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


def _device_of(module: nn.Module) -> torch.device:
    """Where training runs: the adapters' device (a staged base is on the CPU)."""
    for name, p in module.named_parameters():
        if is_lora_param(name):
            return p.device
    return next(module.parameters()).device


def _unregister_nf4_bases(module: nn.Module) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """Take the base weights NF4 will hold out of ``module`` (so that
    materialising it allocates none of them): {module name: (LoRA linear,
    its meta weight)}."""
    staged = {}
    for name, m in module.named_modules():
        if nf4_quantizable(m):
            staged[f"{name}.weight"] = (m, m.weight)
            m._parameters["weight"] = None
    return staged


def cast_frozen(module: nn.Module, dtype: torch.dtype) -> int:
    """Re-make every frozen floating-point parameter of ``module`` in
    ``dtype`` (tied ones stay one parameter); NF4 weights and sharded
    (DTensor) parameters, which their wrappers own, are left as they are.
    Returns the number cast."""
    from torch.distributed.tensor import DTensor

    memo: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if (p is None or p.requires_grad or hasattr(p, "get_original_weight")
                    or isinstance(p, DTensor) or not p.is_floating_point() or p.dtype == dtype):
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            m._parameters[name] = memo[id(p)]
    return len(memo)

