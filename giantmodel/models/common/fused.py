"""Linears and norms that keep one copy of what backward needs.

Under autocast every ``nn.Linear`` casts its input (and its weight) on its
own and saves its own copy for backward: q, k and v save three copies of
the attention input, gate and up two of the MLP's, and each micro-batch
keeps its own cast weights. The functions here do what Megatron-Core's
``linear_qkv`` / ``linear_fc1`` do, without changing what is stored:

* :func:`project` runs the linears that read one input (wq/wk/wv, w1/w3) as
  one GEMM over their concatenated weights and saves that input once, in
  the compute dtype. The parameters stay separate (``wq``, ``wk``, ...), so
  checkpoints, Hugging Face names, LoRA targets and tensor-parallel plans
  are those of the unfused model; under tensor parallelism each rank's
  local shards are whole heads and whole gate/up slices, so the fused local
  weight is too.
* Weights are cast to the compute dtype once per step: the cast (and the
  concatenation) is kept on the module and reused until a parameter changes
  (its version counter moves when the optimizer steps), and backward reads
  the same tensor; no micro-batch saves a weight copy of its own. Weights
  already in the compute dtype (FSDP2's mixed precision, fp32 training) are
  read as they are and nothing is kept.
* :func:`rms_norm` saves its input in the input's dtype and one fp32 rstd
  per row, and recomputes the normalised rows in backward.
* :func:`swiglu` saves gate and up, and recomputes the activation.

A linear that is not a plain ``nn.Linear`` (LoRA, fp8, QLoRA) runs its own
forward, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls run in: autocast's when it is on, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def plain(linears) -> bool:
    """Whether every linear is a bare ``nn.Linear`` the fused path may read
    the weights of (LoRA, fp8 and quantised linears run their own forward)."""
    return all(type(m) is nn.Linear for m in linears)


_generation = 0


def weights_changed() -> None:
    """Invalidate every kept cast: the engine calls it after each optimizer
    step. Version counters alone miss updates made through a flat buffer
    the parameters were pointed at with ``.data`` (ZeRO's), which keeps a
    counter of its own."""
    global _generation
    _generation += 1


def cast_weight(owner: nn.Module, weights: list[torch.Tensor], dtype: torch.dtype,
                slot: str = "_compute_weight") -> torch.Tensor:
    """``weights`` concatenated along the output dimension, in ``dtype``.

    A cast is kept on ``owner`` (not as a buffer: never in a checkpoint) and
    reused while every weight keeps its storage and version, so a step's
    micro-batches and their backward passes share one copy. Nothing is kept
    when no cast is needed."""
    if len(weights) == 1 and weights[0].dtype == dtype:
        return weights[0]
    if torch.compiler.is_compiling():   # a compiled graph casts in place of the cache
        return _joined(weights, dtype)
    key = (_generation, dtype) + tuple((w.data_ptr(), w._version, w.dtype) for w in weights)
    cached = owner.__dict__.get(slot)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        out = _joined(weights, dtype)
    if any(w.dtype != dtype for w in weights) and owner.__dict__.get("keep_casts", True):
        owner.__dict__[slot] = (key, out)
    return out


def _joined(weights: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([w.to(dtype) for w in weights]) if len(weights) > 1 \
        else weights[0].to(dtype)


def keep_casts(model: nn.Module, keep: bool) -> None:
    """Whether ``model``'s modules keep their weights' casts through a step
    (``train.weight_cast``: step) or cast at each use (use)."""
    for m in model.modules():
        m.__dict__["keep_casts"] = keep
        if not keep:
            m.__dict__.pop("_compute_weight", None)


def input_grad(gy: torch.Tensor, owner: nn.Module, weights: list[torch.Tensor],
               dtype: torch.dtype) -> torch.Tensor:
    """gy @ cat(W), one GEMM, with the kept cast when there is one. (Reading
    uncast weights one by one and adding the products saves the second
    concatenation, but its strided slices of gy round differently with the
    allocation's alignment, enough to move layouts apart by 1e-5.)"""
    return gy @ cast_weight(owner, weights, dtype)


def param_grads(gy: torch.Tensor, x: torch.Tensor | None, weights: list[torch.Tensor],
                has_bias: bool) -> tuple[list, list]:
    """The gradients of ``weights`` (None each when ``x`` is: a frozen group)
    and of their biases, split from one GEMM over the concatenated outputs:
    ``gy`` [..., sum of outputs], ``x`` [..., in], each in its weight's dtype."""
    sizes = [w.shape[0] for w in weights]
    g2 = gy.reshape(-1, gy.shape[-1])
    gws: list = [None] * len(weights)
    if x is not None:
        gw = g2.t() @ x.reshape(-1, x.shape[-1])
        gws = [g.to(w.dtype) for g, w in zip(gw.split(sizes), weights)]
    gbs = [g.to(w.dtype) for g, w in zip(g2.sum(0).split(sizes), weights)] if has_bias else []
    return gws, gbs


class _FusedLinear(torch.autograd.Function):
    """y = x @ cat(W)^T + cat(b): one GEMM, the input saved once in the
    compute dtype, the weights read through :func:`cast_weight`."""

    @staticmethod
    def forward(ctx, x, owner, n, *params):
        weights, biases = list(params[:n]), params[n:]
        dtype = compute_dtype(x)
        xc = x.to(dtype)
        w = cast_weight(owner, weights, dtype)
        b = None
        if biases and biases[0] is not None:
            b = torch.cat([bb.to(dtype) for bb in biases])
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(xc, w, b)
        # the input serves only the weights' gradients: a frozen group
        # (a LoRA base's unadapted linears) keeps none
        keep = any(ctx.needs_input_grad[3:3 + n])
        ctx.save_for_backward(xc if keep else None, *weights)
        ctx.owner, ctx.n, ctx.dtype, ctx.x_dtype = owner, n, dtype, x.dtype
        ctx.has_bias = b is not None
        return y

    @staticmethod
    def backward(ctx, gy):
        xc, *weights = ctx.saved_tensors
        gy = gy.to(ctx.dtype)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = input_grad(gy, ctx.owner, weights, ctx.dtype).to(ctx.x_dtype)
        gws, gbs = param_grads(gy, xc, weights, ctx.has_bias)
        return (gx, None, None, *gws, *gbs)


def fused_linear(x: torch.Tensor, owner: nn.Module, weights, biases=None) -> torch.Tensor:
    """One GEMM of ``x`` with ``weights`` (local tensors) concatenated, as
    :class:`_FusedLinear` computes it; ``owner`` keeps the cast weights."""
    biases = list(biases) if biases is not None and biases[0] is not None else []
    return _FusedLinear.apply(x, owner, len(weights), *weights, *biases)


def local_project(x: torch.Tensor, owner: nn.Module, linears) -> list[torch.Tensor]:
    """The outputs of ``linears`` on ``x`` (one process, or the local part
    under a parallelism that does not touch these linears)."""
    weights = [m.weight for m in linears]
    if not plain(linears) or any(hasattr(w, "to_local") for w in weights):
        return [m(x) for m in linears]
    y = fused_linear(x, owner, weights, [m.bias for m in linears])
    return list(y.split([w.shape[0] for w in weights], dim=-1))


def project(module: nn.Module, x: torch.Tensor, linears) -> list[torch.Tensor]:
    """``[m(x) for m in linears]`` through ``module``'s projector: the
    local fused GEMM by default, tensor parallelism's when it installed one
    (``module.projector``)."""
    projector = module.__dict__.get("projector")
    if projector is not None:
        return projector(x, module, linears)
    return local_project(x, module, linears)


# ------------------------------------------------------------------- norms
def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or wider when it already is (float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class _RMSNorm(torch.autograd.Function):
    """RMSNorm computed in fp32; saves x (its own dtype) and rstd (fp32)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = _acc(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * _acc(weight)).to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        x, weight, rstd = ctx.saved_tensors
        n = _acc(x) * rstd
        g = _acc(gy)
        gw = None
        if ctx.needs_input_grad[1]:
            # Summed over every leading dim without a reshape, which would
            # merge a sequence-sharded dim (a DTensor under sp) with another.
            gw = (g * n).sum(dim=tuple(range(n.dim() - 1))).to(weight.dtype)
        gn = g * _acc(weight)
        gx = rstd * (gn - n * (gn * n).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` in fp32, returned in x's dtype."""
    return _RMSNorm.apply(x, weight, eps)


class _LayerNorm(torch.autograd.Function):
    """LayerNorm computed in fp32; saves x (its own dtype), mean and rstd
    (fp32): autocast would run it on an fp32 copy of a bf16 input on CUDA
    and keep that copy, and leave it in bf16 on the CPU."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        xf = _acc(x)
        mean = xf.mean(-1, keepdim=True)
        rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        out = (xf - mean) * rstd * _acc(weight)
        if bias is not None:
            out = out + _acc(bias)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        x, weight, mean, rstd = ctx.saved_tensors
        n = (_acc(x) - mean) * rstd
        g = _acc(gy)
        lead = tuple(range(n.dim() - 1))
        gw = (g * n).sum(dim=lead).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = g.sum(dim=lead).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        gn = g * _acc(weight)
        gx = rstd * (gn - gn.mean(-1, keepdim=True) - n * (gn * n).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, gb, None


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the last dimension, in fp32 whatever the input's
    dtype, returning the input's dtype and keeping only x, mean and rstd."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1 or self.weight is None:
            return super().forward(x)
        return _LayerNorm.apply(x, self.weight, self.bias, self.eps)


# --------------------------------------------------------------- activations
class _GatedAct(torch.autograd.Function):
    """act(gate) * up, saving gate and up only (the activation and its
    derivative are recomputed in backward)."""

    @staticmethod
    def forward(ctx, gate, up, act):
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return act(gate) * up

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            gate_ = gate.detach().requires_grad_()
            a = ctx.act(gate_)
        (da,) = torch.autograd.grad(a, gate_, g * up)
        return da, g * a.detach(), None


def gated(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` keeping only gate and up for backward."""
    return _GatedAct.apply(gate, up, act)
