"""Mixed precision: autocast contexts and a dynamic loss scaler for fp16.

The scaler is written against plain gradients and a caller-supplied
"any rank found inf?" reduction, so it works the same for DDP, FSDP2
(DTensor grads) and pipeline stages, where torch's GradScaler variants differ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, mode: str, device_type: str, init_scale: float = 2.0**16,
                 growth_interval: int = 1000):
        self.mode = mode
        self.device_type = device_type
        self.dtype = DTYPES[mode]
        self.scale = init_scale if mode == "fp16" else 1.0
        self.growth_interval = growth_interval
        self._good_steps = 0

    def autocast(self):
        if self.mode == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.mode == "fp16" else loss

    def unscale_and_check(self, params: Iterable[torch.Tensor],
                          any_rank: Callable[[bool], bool] = lambda x: x) -> bool:
        """Divide grads by the scale; return True when the step must be skipped
        because some rank saw inf/nan. Adjusts the scale for the next step."""
        if self.mode != "fp16":
            return False
        grads = [p.grad for p in params if p.grad is not None]
        inv = 1.0 / self.scale
        found = False
        for g in grads:
            g.mul_(inv)
            local = g.to_local() if hasattr(g, "to_local") else g
            if not torch.isfinite(local).all():
                found = True
        found = any_rank(found)
        if found:
            self.scale /= 2.0
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        return found

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
