"""The fused building blocks against the plain modules they replace
(giantmodel.models.common.fused): values and gradients, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from giantmodel.models.common import fused
from giantmodel.planner.measure import SavedTensorCounter


def _linears(bias: bool) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(32, n, bias=bias) for n in (24, 8, 8)]


def _grads(params, x):
    return [p.grad.clone() for p in params] + [x.grad.clone()]


def test_project_equals_separate_linears_fp32_and_bf16():
    for bias in (False, True):
        for dtype in (None, torch.bfloat16):
            lins = _linears(bias)
            owner = nn.Module()
            params = [p for m in lins for p in m.parameters()]
            x = torch.randn(2, 5, 32, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
                ref = [m(x) for m in lins]
            sum((r.float() * (i + 1)).sum() for i, r in enumerate(ref)).backward()
            want = _grads(params, x)
            for p in params + [x]:
                p.grad = None
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
                got = fused.local_project(x, owner, lins)
            sum((g.float() * (i + 1)).sum() for i, g in enumerate(got)).backward()
            tol = 1e-6 if dtype is None else 2e-2
            for a, b in zip(got, ref):
                assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
            for a, b in zip(_grads(params, x), want):
                assert torch.allclose(a, b, atol=tol * 10, rtol=tol), (bias, dtype)


def test_a_frozen_group_keeps_no_input_and_casts_are_kept_per_step():
    lins = _linears(False)
    owner = nn.Module()
    x = torch.randn(2, 5, 32, requires_grad=True)
    for m in lins:
        m.weight.requires_grad_(False)
    with SavedTensorCounter(exclude=tuple(p for m in lins for p in m.parameters())) as c, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        y = fused.local_project(x, owner, lins)
    assert c.bytes == 0   # nothing but the (frozen) weights
    kept = owner.__dict__["_compute_weight"][1]
    assert kept.dtype == torch.bfloat16 and kept.shape == (40, 32)
    sum(t.float().sum() for t in y).backward()
    assert x.grad is not None
    # the same step reuses the cast; the next step (weights_changed) makes a new one
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused.local_project(x, owner, lins)
    assert owner.__dict__["_compute_weight"][1] is kept
    fused.weights_changed()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused.local_project(x, owner, lins)
    assert owner.__dict__["_compute_weight"][1] is not kept
    fused.keep_casts(owner, False)
    assert "_compute_weight" not in owner.__dict__
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused.local_project(x, owner, lins)
    assert "_compute_weight" not in owner.__dict__


def test_norms_and_gated_activation_equal_autograd():
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(16, dtype=torch.float64, requires_grad=True)

    def rms_ref(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    assert torch.autograd.gradcheck(lambda x, w: fused.rms_norm(x, w, 1e-5).double(), (x, w))
    assert torch.allclose(fused.rms_norm(x, w, 1e-5).double(), rms_ref(x, w), atol=1e-6)
    ln = fused.LayerNorm(16).double()
    with torch.no_grad():
        ln.weight.copy_(w)
        ln.bias.copy_(b)
    assert torch.allclose(ln(x), F.layer_norm(x, (16,), w, b), atol=1e-6)
    assert torch.autograd.gradcheck(lambda x: ln(x), (x,))
    g, u = torch.randn(2, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, u: fused.gated(F.silu, g, u), (g, u))
    assert torch.allclose(fused.gated(F.silu, g, u), F.silu(g) * u)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_project_on_cuda_bf16_equals_separate_linears():
    """The fused GEMM, its kept cast and its hand-written backward on a GPU
    under bf16 autocast, against the plain linears."""
    lins = [m.cuda() for m in _linears(True)]
    owner = nn.Module()
    params = [p for m in lins for p in m.parameters()]
    x = torch.randn(4, 64, 32, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = [m(x) for m in lins]
    sum(r.float().sum() for r in ref).backward()
    want = _grads(params, x)
    for p in params + [x]:
        p.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = fused.local_project(x, owner, lins)
    sum(g.float().sum() for g in got).backward()
    for a, b in zip(got, ref):
        assert a.dtype == torch.bfloat16 and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    for a, b in zip(_grads(params, x), want):
        assert torch.allclose(a, b, atol=2e-1, rtol=2e-2)
