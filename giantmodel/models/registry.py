"""Build models from config: on the meta device, then initialise in place.

Initialisation is layout-independent: every parameter is drawn from a
generator seeded by (seed, canonical parameter name) at its full shape, and
each rank keeps only its shard. A tp2 x pp2 run therefore starts from exactly
the weights of a single-process run, which is what makes parity tests and
resharding possible.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from giantmodel.config.model import ModelConfig
from giantmodel.models.gpt.model import GPT
from giantmodel.models.llama.model import Llama

# Wrapper names inserted by torch.compile and activation checkpointing.
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(fqn: str) -> str:
    for part in _WRAPPER_PARTS:
        fqn = fqn.replace(part, "")
    return fqn


def model_class(arch: str) -> type[nn.Module]:
    if arch == "llama":
        return Llama
    if arch == "gpt":
        return GPT
    raise ValueError(f"unknown model.arch {arch!r}; expected 'llama' or 'gpt'")


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> nn.Module:
    """Construct the model without allocating (``device='meta'``) or on ``device``."""
    with torch.device(device):
        return model_class(cfg.arch)(cfg)


def _init_std(name: str, cfg: ModelConfig) -> float | None:
    """Std of the normal init for a parameter, or None for ones/zeros."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return None
    if "norm" in name:
        return None
    # Residual-branch output projections: GPT-2's 1/sqrt(2L) scaling.
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        return cfg.init_std / math.sqrt(2 * cfg.num_layers)
    return cfg.init_std


def full_init_tensor(name: str, shape: torch.Size, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``, in fp32 on CPU."""
    std = _init_std(name, cfg)
    if std is None:
        fill = 0.0 if name.endswith("bias") else 1.0
        return torch.full(tuple(shape), fill)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.empty(tuple(shape)).normal_(0.0, std, generator=gen)


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into ``param``, keeping only this rank's shard when
    ``param`` is a DTensor (tensor-parallel or FSDP-sharded)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds the same full tensor, so
            # slice locally instead of broadcasting.
            local = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh,
                                      param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full.to(param.device, param.dtype))


def init_weights(model: nn.Module, cfg: ModelConfig, seed: int,
                 device: str | torch.device = "cpu") -> nn.Module:
    """Materialise a meta-device (possibly sharded) model on ``device`` and
    initialise every parameter and buffer, deterministically per name."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        for module in model.modules():
            if hasattr(module, "tie_weights"):
                module.tie_weights()
    seen: set[int] = set()
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied weights: initialised once, under the first name
            continue
        seen.add(id(p))
        name = canonical_name(fqn)
        # A DTensor's .shape is its global shape: the full tensor is drawn.
        copy_full_into(p, full_init_tensor(name, p.shape, cfg, seed))
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(device=device)
    return model


def count_params(model: nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
