"""The chunked linear cross-entropy against the plain loss: values, gradients,
and a few training steps of the engine with each."""

import layout_harness as H
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from giantmodel.config import ConfigError, load_config
from giantmodel.core.loss import (
    IGNORE_INDEX,
    check_loss_impl,
    chunked_linear_cross_entropy_sum,
    cross_entropy_sum,
    head_computes_loss,
    resolve_loss_impl,
)


def _case(B=2, T=37, Hd=16, V=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, Hd, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (0.5 * torch.randn(V, Hd, generator=g)).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, :5] = IGNORE_INDEX
    y[1, -3:] = IGNORE_INDEX
    return h, w, y


def _grads(fn, h, w, y, scale=0.37):
    h.grad = w.grad = None
    loss, count = fn(h, w, y)
    (loss * scale).backward()  # the engine's 1/global-tokens factor
    return (loss.detach(), count, h.grad.clone(),
            None if w.grad is None else w.grad.clone())


@pytest.mark.parametrize("chunk", [1, 7, 37, 74, 1000])
def test_chunked_loss_and_grads_match_plain(chunk):
    h, w, y = _case()
    ref = _grads(lambda a, b, c: cross_entropy_sum(F.linear(a, b), c), h, w, y)
    got = _grads(lambda a, b, c: chunked_linear_cross_entropy_sum(a, b, c, chunk), h, w, y)
    assert int(got[1]) == int(ref[1]) == 2 * 37 - 8
    assert torch.allclose(got[0], ref[0], rtol=1e-6, atol=0)
    for a, b in zip(got[2:], ref[2:], strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), float((a - b).abs().max())
    # ignored tokens get no gradient
    assert got[2][0, :5].abs().max() == 0


def test_chunked_loss_without_grad_and_all_ignored():
    h, w, y = _case()
    with torch.no_grad():
        loss, _ = chunked_linear_cross_entropy_sum(h, w, y, 5)
        ref, _ = cross_entropy_sum(F.linear(h, w), y)
    assert not loss.requires_grad and torch.allclose(loss, ref, rtol=1e-6)
    y_none = torch.full_like(y, IGNORE_INDEX)
    loss, count = chunked_linear_cross_entropy_sum(h, w, y_none, 5)
    loss.backward()
    assert float(loss.detach()) == 0 and int(count) == 0 and h.grad.abs().max() == 0


def test_chunked_loss_frozen_weight_and_bf16_autocast():
    h, w, y = _case()
    w.requires_grad_(False)   # LoRA: a frozen head still passes gradients to hidden
    ref = _grads(lambda a, b, c: cross_entropy_sum(F.linear(a, b), c), h, w, y)[2]
    h.grad = None
    chunked_linear_cross_entropy_sum(h, w, y, 9)[0].mul(0.37).backward()
    assert w.grad is None and torch.allclose(h.grad, ref, rtol=1e-6, atol=1e-6)
    w.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _grads(lambda a, b, c: cross_entropy_sum(F.linear(a, b), c), h, w, y)
        chunked = _grads(lambda a, b, c: chunked_linear_cross_entropy_sum(a, b, c, 9), h, w, y)
    assert chunked[2].dtype == h.dtype and chunked[3].dtype == w.dtype
    assert torch.allclose(chunked[0], plain[0], rtol=1e-3)
    for a, b in zip(chunked[2:], plain[2:], strict=True):  # bf16 rounding of the matmuls
        assert float((a - b).norm() / b.norm()) < 2e-2


def test_head_computes_loss_restores_the_head():
    head = nn.Linear(16, 101, bias=False)
    h, _, y = _case()
    with head_computes_loss(head, y, "chunked"):
        loss = head(h)
    assert loss.shape == () and torch.allclose(loss, cross_entropy_sum(head(h), y)[0], rtol=1e-6)
    assert head(h).shape == (2, 37, 101) and "forward" not in head.__dict__


def test_resolve_and_check_loss_impl():
    head = nn.Linear(8, 32, bias=False)
    assert resolve_loss_impl("auto", head, "cpu") == ("chunked", "")
    assert resolve_loss_impl("plain", head, "cpu") == ("plain", "")
    impl, why = resolve_loss_impl("chunked", head, "cpu", vocab_parallel=True)
    assert impl == "plain" and "tp" in why
    assert resolve_loss_impl("chunked", nn.Linear(8, 32), "cpu")[0] == "plain"  # biased head
    with pytest.raises(ConfigError, match="train.loss_impl"):
        check_loss_impl("liger", "cpu")
    with pytest.raises(ConfigError, match="train.loss_impl"):
        load_config(None, ["train.loss_impl=fused"])
    assert load_config(None, []).train.loss_impl == "auto"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch,extra", [("llama", []), ("gpt", ["model.tie_embeddings=true"])])
def test_engine_trains_the_same_with_chunked_and_plain_loss(arch, extra, monkeypatch):
    """A few steps of the engine (uneven -100 labels, the global token mean
    over micro-batches): chunked and plain give the same losses and weights."""
    import giantmodel.core.loss as loss_mod

    calls = []
    real = loss_mod.chunked_linear_cross_entropy_sum
    monkeypatch.setattr(loss_mod, "chunked_linear_cross_entropy_sum",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = H.run_steps(H.make_config(arch, extra + ["train.loss_impl=plain"]), 4)
    assert not calls
    chunked = H.run_steps(H.make_config(arch, extra + ["train.loss_impl=chunked"]), 4)
    assert len(calls) == 4 * 4  # 4 steps x 4 micro-batches went through the chunked loss
    # Losses to 1e-6; weights to the harness's 1e-5, since AdamW divides each
    # gradient by its own running size and so lifts fp32 rounding noise of
    # near-zero gradients to update size.
    H.assert_matches(chunked, plain, f"{arch} chunked", loss_rtol=1e-6)
    assert plain["losses"][-1] < plain["losses"][0]


@pytest.mark.timeout(240)
def test_chunked_loss_under_fsdp_and_tp_matches_the_plain_single_process_run():
    """zero-3 (FSDP2 gathers the head for its forward, where the loss runs,
    tied and untied) and tp=2 (a vocab-sharded head: falls back to the
    plain vocab-parallel loss), against one process with the plain loss."""
    from giantmodel.testing import run_ranks

    chunked = ["train.loss_impl=chunked"]
    cases = [("llama", ["parallel.dp=2", "parallel.zero=3"] + chunked),
             ("gpt", ["parallel.dp=2", "parallel.zero=3", "model.tie_embeddings=true"] + chunked),
             ("llama", ["parallel.tp=2"] + chunked)]
    results = run_ranks(H.run_cases, 2, cases, 3, timeout=200)[0]
    for (arch, overrides), result in zip(cases, results, strict=True):
        plain = [o for o in overrides if not o.startswith(("parallel.", "train.loss_impl"))]
        ref = H.run_steps(H.make_config(arch, plain + ["train.loss_impl=plain"]), 3)
        H.assert_matches(result, ref, f"{arch} {overrides}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_chunked_and_liger_losses_match_plain():
    """On CUDA: chunked in fp32 (TF32 off) as tight as on the CPU; chunked
    and, when installed, liger-kernel under bf16 autocast within bf16 rounding."""
    from giantmodel.core.loss import liger_installed, liger_linear_cross_entropy_sum

    h, w, y = (t.cuda().detach().requires_grad_(t.requires_grad) for t in _case(2, 300, 64, 5000))
    y = y.cuda()
    matmul = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        ref = _grads(lambda a, b, c: cross_entropy_sum(F.linear(a, b), c), h, w, y)
        got = _grads(lambda a, b, c: chunked_linear_cross_entropy_sum(a, b, c, 128), h, w, y)
    finally:
        torch.set_float32_matmul_precision(matmul)
    assert torch.allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(got[2:], ref[2:], strict=True):
        assert float((a - b).norm() / b.norm()) < 1e-5
    impls = [lambda a, b, c: chunked_linear_cross_entropy_sum(a, b, c, 128)]
    if liger_installed():
        impls.append(liger_linear_cross_entropy_sum)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plain = _grads(lambda a, b, c: cross_entropy_sum(F.linear(a, b), c), h, w, y)
        for fn in impls:
            got = _grads(fn, h, w, y)
            assert torch.allclose(got[0], plain[0], rtol=1e-2)
            for a, b in zip(got[2:], plain[2:], strict=True):
                assert float((a - b).norm() / b.norm()) < 3e-2
