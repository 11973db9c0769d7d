"""AdamW and learning-rate schedules."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from giantmodel.config.errors import ConfigError
from giantmodel.config.train import OptimConfig
from giantmodel.core.tensors import unique


def param_groups(params: Iterable[torch.Tensor], weight_decay: float) -> list[dict]:
    """Decay matrices (and embeddings); leave norms and biases undecayed.

    Frozen parameters are left out, and each group is further split by
    tensor kind: multi-tensor kernels cannot mix plain tensors (unsharded
    norm weights under tp) with DTensors, nor DTensors on different meshes.
    DCP keys optimizer state by parameter name, so the number of groups does
    not reach checkpoints.
    """
    decay: dict = {}
    no_decay: dict = {}
    for p in unique(params):
        if not p.requires_grad:
            continue
        kind = ((id(p.device_mesh), tuple(map(str, p.placements)))
                if hasattr(p, "placements") else None)
        (decay if p.dim() >= 2 else no_decay).setdefault(kind, []).append(p)
    groups = [{"params": ps, "weight_decay": weight_decay} for ps in decay.values()]
    groups += [{"params": ps, "weight_decay": 0.0} for ps in no_decay.values()]
    return groups or [{"params": [], "weight_decay": weight_decay}]


def build_adamw(params: Iterable[torch.Tensor], cfg: OptimConfig,
                device_type: str) -> torch.optim.Optimizer:
    """AdamW over ``params`` (duplicates, e.g. tied weights, counted once)."""
    impl = cfg.impl
    if impl == "apex":
        return _apex_adamw(param_groups(params, cfg.weight_decay), cfg, device_type)
    if impl == "auto":
        # torch has fused AdamW kernels for CUDA and CPU (3-6x faster than
        # foreach on CPU: one pass over each tensor instead of one per op).
        impl = "fused" if device_type in ("cuda", "cpu") else "foreach"
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(param_groups(params, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)


def _apex_adamw(groups: list[dict], cfg: OptimConfig, device_type: str) -> torch.optim.Optimizer:
    """NVIDIA apex's FusedAdam in AdamW mode (decoupled weight decay, as torch's AdamW)."""
    try:
        from apex.optimizers import FusedAdam
    except ImportError:  # PyPI's "apex" is an unrelated package without it
        raise ConfigError("needs NVIDIA apex (github.com/NVIDIA/apex) and apex.optimizers is "
                          "not importable; install it or use optim.impl=fused",
                          "optim.impl") from None
    params = [p for g in groups for p in g["params"]]
    if device_type != "cuda" or any(hasattr(p, "placements") for p in params):
        # Its multi-tensor kernels read raw CUDA storages: no CPU tensors, no
        # DTensors (a layout that shards parameters: tp, zero 3, HSDP).
        raise ConfigError("apex's FusedAdam takes plain CUDA tensors; this layout gives "
                          f"{'DTensors' if device_type == 'cuda' else device_type + ' tensors'}; "
                          "use optim.impl=fused", "optim.impl")
    return FusedAdam(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                     weight_decay=cfg.weight_decay, adam_w_mode=True)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "cosine":
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    # wsd: warm-up, stable at lr, then linear decay over the last decay_fraction.
    decay_start = total_steps - int(round(cfg.decay_fraction * total_steps))
    if step < decay_start:
        return cfg.lr
    # The last step (total_steps - 1) lands exactly on min_lr.
    frac = (step - decay_start) / max(1, total_steps - 1 - decay_start)
    return cfg.lr + (cfg.min_lr - cfg.lr) * min(1.0, frac)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, cfg, total_steps) / cfg.lr)


class SchedulerState:
    """Checkpoint view of an LR schedule: only its position.

    LambdaLR's own state holds one entry per optimizer param group, and how
    many groups there are depends on the parallel layout (sharded optimizers
    split them by tensor kind). The position is all a schedule needs, so
    saving only it lets a run resume under any layout."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR):
        self.scheduler = scheduler

    def state_dict(self) -> dict:
        return {"last_epoch": self.scheduler.last_epoch,
                "step_count": self.scheduler._step_count}

    def load_state_dict(self, state: dict) -> None:
        s = self.scheduler
        s.last_epoch = int(state["last_epoch"])
        s._step_count = int(state["step_count"])
        for group, base, fn in zip(s.optimizer.param_groups, s.base_lrs, s.lr_lambdas):
            group["lr"] = base * fn(s.last_epoch)
        s._last_lr = [g["lr"] for g in s.optimizer.param_groups]
