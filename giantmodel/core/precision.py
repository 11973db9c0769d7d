"""Mixed precision: autocast contexts and a dynamic loss scaler for fp16.

The scaler is written against plain gradients and a caller-supplied
"any rank found inf?" reduction, so it works the same for DDP, FSDP2
(DTensor grads) and pipeline stages, where torch's GradScaler variants differ.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable

import torch

from giantmodel.core.tensors import local_tensor

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
        found = any_rank(unscale_grads_(
            [p.grad for p in params if p.grad is not None], 1.0 / self.scale))
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


def unscale_grads_(grads: list[torch.Tensor], inv_scale: float) -> bool:
    """Multiply ``grads`` (plain or DTensor) by ``inv_scale`` in place; True
    when any of them holds an inf or nan.

    One fused kernel per (device, dtype) group writes a found-inf flag on the
    device, and the host reads the flags once at the end: a check per tensor
    would wait for the device once per parameter (hundreds of syncs a step).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        local = local_tensor(g)
        if local.numel():
            groups.setdefault((local.device, local.dtype), []).append(local)
    flags = []
    for (device, _), tensors in groups.items():
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv)
        flags.append(found)
    if not flags:
        return False
    first = flags[0].device
    return bool(torch.stack([f.to(first) for f in flags]).sum().item() > 0)


def configure_tf32(device_type: str, enabled: bool) -> bool:
    """Let fp32 matmuls and convolutions on CUDA use TF32 tensor cores (``train.tf32``).

    TF32 keeps fp32's range with a 10-bit mantissa and runs fp32 matmuls
    several times faster on Ampere and later; torch leaves it off for
    matmuls by default. ``enabled=False`` asks for IEEE fp32 (bitwise
    reproducible against other fp32 runs). Set through the legacy setters:
    they keep torch's legacy and new (``fp32_precision``) flags consistent,
    whereas setting the new flags alone makes
    ``torch.get_float32_matmul_precision()`` raise (torch 2.13). Returns
    whether anything was set (only on CUDA)."""
    if device_type != "cuda":
        return False
    with warnings.catch_warnings():
        # torch 2.9-2.11 warn once that these setters will be deprecated
        warnings.filterwarnings("ignore", message=".*new API settings to control TF32")
        torch.set_float32_matmul_precision("high" if enabled else "highest")
        torch.backends.cudnn.allow_tf32 = enabled
    return True
