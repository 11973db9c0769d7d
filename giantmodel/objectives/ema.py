"""Exponential moving average of a module's trainable parameters.

The shadow of each parameter is a clone of it, so it has the parameter's
placement: a DTensor shard under FSDP2 (ZeRO-3, HSDP) or tensor
parallelism, a full tensor under replicated data parallelism. Updates touch
only local shards, with no communication. The state dict is keyed by
canonical parameter names and holds the shadows as they are (DTensors
included), so DCP saves it sharded and reshards it on load like the model.

The decay follows diffusers' ``EMAModel`` defaults: the n-th update uses
``min(decay, (1 + n) / (10 + n))`` counting from n = 0 (which copies).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from giantmodel.core.tensors import local_tensor
from giantmodel.models.registry import canonical_name


class EMA:
    def __init__(self, module: nn.Module, decay: float, prefix: str = ""):
        self.decay = decay
        self.prefix = prefix
        self.params: dict[str, nn.Parameter] = {}
        for fqn, p in module.named_parameters():
            if p.requires_grad:
                self.params[prefix + canonical_name(fqn)] = p
        self.shadow = {k: p.detach().clone() for k, p in self.params.items()}
        self.updates = 0

    def current_decay(self) -> float:
        n = self.updates
        return 0.0 if n == 0 else min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self) -> None:
        """One step towards the current parameters (call after each optimizer step)."""
        d = self.current_decay()
        shadows = [local_tensor(s) for s in self.shadow.values()]
        params = [local_tensor(p.detach()).to(s.dtype) for p, s in zip(self.params.values(), shadows)]
        if d == 0.0:
            torch._foreach_copy_(shadows, params)
        else:
            torch._foreach_lerp_(shadows, params, 1.0 - d)
        self.updates += 1

    @contextmanager
    def swapped(self):
        """Within the block, the module's parameters hold the EMA values."""
        with torch.no_grad():
            saved = [local_tensor(p).clone() for p in self.params.values()]
            for p, s in zip(self.params.values(), self.shadow.values()):
                local_tensor(p).copy_(local_tensor(s))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params.values(), saved):
                    local_tensor(p).copy_(s)

    def state_dict(self) -> dict:
        return {"updates": self.updates, **{f"shadow.{k}": v for k, v in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        with torch.no_grad():
            for k, v in self.shadow.items():
                src = state[f"shadow.{k}"]
                if src is not v:  # DCP loads in place into the tensors state_dict() gave it
                    local_tensor(v).copy_(local_tensor(src))
