"""Optional accelerations the parallelize plan swaps in: fp8 linears and apex norms.

Each is used when asked for and installed, never required:

* ``precision: fp8``: the linears of every repeated block (attention and
  MLP projections whose sides are multiples of 16; an MoE router stays in
  high precision) become fp8 linears, and the rest of the model runs under
  bf16 autocast.

  - With Transformer Engine: ``te.Linear`` replaces ``nn.Linear`` (same
    parameter names, so initialisation and checkpoints are unchanged), and
    the forward runs under TE's fp8 autocast with a delayed-scaling or
    current-scaling recipe (``train.fp8_recipe``). ``te.LayerNormLinear``
    fuses a norm into the one linear that reads it; in these models every
    norm feeds several projections (q/k/v, gate/up), so it has no place
    without merging them, which would change parameter names and checkpoints.
  - Otherwise with torchao float8 (tensorwise or rowwise scaling), through
    ``convert_to_float8_training``; under FSDP2 with tensorwise scaling the
    weights are all-gathered in fp8 (``enable_fsdp_float8_all_gather``).

  A CPU, a GPU older than compute capability 8.9 (Ada / Hopper) or neither
  package installed is refused in one line, before any process group.
* ``train.norm_impl: apex``: RMSNorm / LayerNorm become NVIDIA apex's fused
  CUDA norms (same parameter names).
* ``optim.impl: apex``: apex's FusedAdam (giantmodel.core.optim).

The module swaps are tested on the CPU with stand-in packages; the numerics
are GPU work (scripts/gpu_check.sh, its last step).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from giantmodel.config.errors import ConfigError
from giantmodel.core.precision import Precision
from giantmodel.models.common.layers import RMSNorm

_TE_RECIPES = ("delayed", "current")
_AO_RECIPES = ("tensorwise", "rowwise")
# github.com/NVIDIA/apex; PyPI's "apex" is an unrelated web toolkit.
_APEX_HINT = "NVIDIA apex (built from github.com/NVIDIA/apex; PyPI's 'apex' is another package)"


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@dataclass
class Accelerations:
    """What the plan swaps into each model chunk, resolved for one device."""

    fp8: str | None = None
    """"te" or "torchao" (None: no fp8)."""
    recipe: str = "tensorwise"
    """delayed / current (te), tensorwise / rowwise (torchao)."""
    fsdp_float8_all_gather: bool = False
    """torchao tensorwise under FSDP2: all-gather the weights in fp8."""
    apex_norms: bool = False

    # ------------------------------------------------------------ the swaps
    def apply(self, module: nn.Module, blocks: list[nn.Module]) -> None:
        """Swap in place, on the meta device, before recompute, compile and
        the data-parallel wrapping."""
        if self.fp8 == "te":
            for block in blocks:
                _swap_linears(block, _te_linear)
        elif self.fp8 == "torchao":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            if self.recipe == "rowwise":
                config = Float8LinearConfig.from_recipe_name("rowwise")
            else:
                config = Float8LinearConfig(
                    enable_fsdp_float8_all_gather=self.fsdp_float8_all_gather)
            for block in blocks:
                convert_to_float8_training(block, config=config,
                                           module_filter_fn=lambda m, fqn: _fp8_eligible(fqn, m))
        if self.apex_norms:
            _swap_norms(module)

    # ------------------------------------------------------ forward context
    def precision(self, mode: str, device_type: str) -> Precision:
        """The trainer's Precision: fp8 is bf16 autocast (plus TE's fp8
        autocast around the forward when TE provides the linears)."""
        if mode != "fp8":
            return Precision(mode, device_type)
        return FP8Precision(device_type, self._te_context if self.fp8 == "te" else None)

    def _te_context(self):
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe

        fmt = te_recipe.Format.HYBRID  # e4m3 forward, e5m2 gradients
        if self.recipe == "current":
            r = te_recipe.Float8CurrentScaling(fp8_format=fmt)
        else:
            r = te_recipe.DelayedScaling(fp8_format=fmt, amax_history_len=16,
                                         amax_compute_algo="max")
        # TE 2.x names it autocast(recipe=); fp8_autocast(fp8_recipe=) is the
        # older (now deprecated) spelling.
        if hasattr(te, "autocast"):
            return te.autocast(enabled=True, recipe=r)
        return te.fp8_autocast(enabled=True, fp8_recipe=r)


class FP8Precision(Precision):
    """bf16 autocast with an optional fp8 context (TE) inside it. Loss
    scaling is off, as for bf16: fp8 scaling is per tensor, inside the linears."""

    def __init__(self, device_type: str, fp8_context: Callable | None):
        super().__init__("bf16", device_type)
        self.mode = "fp8"
        self._fp8_context = fp8_context

    @contextlib.contextmanager
    def _both(self) -> Iterator[None]:
        with super().autocast(), self._fp8_context():
            yield

    def autocast(self):
        return self._both() if self._fp8_context is not None else super().autocast()


def _fp8_eligible(fqn: str, m: nn.Module) -> bool:
    # fp8 GEMMs need both sides a multiple of 16; a router's few logits
    # decide where tokens go and stay in high precision.
    return (isinstance(m, nn.Linear) and m.in_features % 16 == 0
            and m.out_features % 16 == 0 and not fqn.endswith("gate"))


def _swap_linears(block: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
    for fqn, m in list(block.named_modules()):
        if not _fp8_eligible(fqn, m) or type(m) is not nn.Linear:
            continue
        parent = block.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else block
        setattr(parent, fqn.rpartition(".")[2], make(m))


def _te_linear(m: nn.Linear) -> nn.Module:
    import transformer_engine.pytorch as te

    # On the meta device, as the model is: weights are drawn later under
    # their own names (weight, bias), exactly as for nn.Linear.
    return te.Linear(m.in_features, m.out_features, bias=m.bias is not None,
                     params_dtype=m.weight.dtype, device=str(m.weight.device))


def _swap_norms(module: nn.Module) -> None:
    for fqn, m in list(module.named_modules()):
        if isinstance(m, RMSNorm):
            new = _apex_norm("RMSNorm", m.weight.shape, m.eps, m.weight.device)
        elif isinstance(m, nn.LayerNorm) and m.elementwise_affine and m.bias is not None:
            new = _apex_norm("LayerNorm", m.normalized_shape, m.eps, m.weight.device)
        else:
            continue
        parent = module.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else module
        setattr(parent, fqn.rpartition(".")[2], new)


def _apex_norm(kind: str, shape, eps: float, device: torch.device) -> nn.Module:
    from apex import normalization

    # The Mixed* variants take bf16/fp16 input with fp32 weights (what
    # autocast gives them); older apex has only Fused*.
    cls = getattr(normalization, f"MixedFused{kind}", None) or getattr(normalization, f"Fused{kind}")
    with torch.device(device):
        norm = cls(shape, eps=eps)
    # torch's norms here return the input's dtype; keep that contract.
    norm.forward = _same_dtype(norm.forward)
    return norm


def _same_dtype(forward: Callable) -> Callable:
    def run(x: torch.Tensor) -> torch.Tensor:
        return forward(x).to(x.dtype)
    return run


# ------------------------------------------------------------- resolution
def plan_accelerations(cfg, device: torch.device, fsdp: bool = False) -> Accelerations:
    """Resolve ``cfg``'s precision / norm / optimizer choices for ``device``,
    or raise a one-line ConfigError naming the key (no GPU, an older GPU, a
    package missing). Runs before any process group exists."""
    acc = Accelerations(apex_norms=cfg.train.norm_impl == "apex")
    if acc.apex_norms:
        _need_apex("apex.normalization", device, "train.norm_impl")
    if cfg.optim.impl == "apex":
        _need_apex("apex.optimizers", device, "optim.impl")
    if cfg.precision == "fp8":
        acc.fp8, acc.recipe = _fp8_backend(cfg.train.fp8_recipe, device)
        acc.fsdp_float8_all_gather = fsdp and acc.fp8 == "torchao" and acc.recipe == "tensorwise"
    return acc


def _need_apex(module: str, device: torch.device, key: str) -> None:
    if device.type != "cuda":
        raise ConfigError(f"apex runs on CUDA only (this run is on {device.type})", key)
    if not _importable(module):
        raise ConfigError(f"needs {_APEX_HINT}, and {module} is not importable; "
                          f"install it or unset {key}", key)


def _fp8_backend(recipe: str, device: torch.device) -> tuple[str, str]:
    if device.type != "cuda":
        raise ConfigError(f"fp8 needs a CUDA GPU (this run is on {device.type}); "
                          "use precision=bf16", "precision")
    cc = _capability(device)
    if cc < (8, 9):
        raise ConfigError(f"fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                          f"this one is {cc[0]}.{cc[1]}; use precision=bf16", "precision")
    te_ok = _importable("transformer_engine.pytorch")
    ao_ok = _importable("torchao.float8")
    if recipe in _TE_RECIPES and not te_ok:
        raise ConfigError(f"{recipe!r} is a Transformer Engine recipe and transformer_engine "
                          "is not installed; install it or use tensorwise / rowwise (torchao)",
                          "train.fp8_recipe")
    if recipe in _AO_RECIPES and not ao_ok:
        raise ConfigError(f"{recipe!r} is a torchao float8 recipe and torchao is not installed; "
                          "install it or use delayed / current (Transformer Engine)",
                          "train.fp8_recipe")
    if recipe == "auto":
        if not (te_ok or ao_ok):
            raise ConfigError("fp8 needs transformer_engine or torchao, and neither is "
                              "installed; install one or use precision=bf16", "precision")
        recipe = "current" if te_ok else "tensorwise"
    return ("te" if recipe in _TE_RECIPES else "torchao"), recipe
