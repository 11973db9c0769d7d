"""Recompute modes keep the math and recompute what they say: full reruns
every block's forward (matmuls included) in backward, selective reruns the
norms, casts and activations but neither the matmuls nor the attention core;
a per-block list mixes the modes block by block."""

from __future__ import annotations

from collections import Counter

import layout_harness as H
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from giantmodel.core.loss import cross_entropy_sum
from giantmodel.models import build_model, init_weights
from giantmodel.parallel.recompute import apply_recompute


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops_and_grads(arch: str, mode: str, layers: list[str] | None = None):
    cfg = H.make_config(arch, [f"recompute={mode}", "train.seq_len=32"])
    model = build_model(cfg.model, "meta")
    modes = layers if layers is not None else [cfg.recompute] * len(model.layers)
    apply_recompute(model, {f"layers.{k}": modes[int(k)] for k in model.layers})
    init_weights(model, cfg.model, seed=3, device="cpu")
    ids, labels = H.global_batch(cfg, 0)
    loss, n = cross_entropy_sum(model(ids), labels)
    with _OpCounter() as ops:
        (loss / n).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return ops.counts, grads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_recompute_modes_same_grads(arch):
    none_ops, ref = _backward_ops_and_grads(arch, "none")
    sel_ops, sel = _backward_ops_and_grads(arch, "selective")
    full_ops, full = _backward_ops_and_grads(arch, "full")
    layers = H.make_config(arch, []).model.num_layers
    sdpa = [k for k in none_ops | full_ops if k.startswith("_scaled_dot_product") and "backward" not in k]
    def fwd_attn(c):
        return sum(c[k] for k in sdpa)
    # the attention core runs again in backward only under full recompute
    assert fwd_attn(none_ops) == 0 and fwd_attn(sel_ops) == 0
    assert fwd_attn(full_ops) == layers
    # matmuls: selective keeps them, full recomputes the blocks' projections
    def mm(c):
        return c["mm"] + c["addmm"] + c["bmm"]
    assert mm(sel_ops) == mm(none_ops) < mm(full_ops)
    # selective does recompute something: the norms (rsqrt / layer norm)
    def norm(c):
        return c["rsqrt"] + c["native_layer_norm"]
    assert norm(none_ops) == 0 < norm(sel_ops)
    # a per-block mix: one block full, one selective, the rest as they are
    mixed = ["full", "selective"] + ["none"] * (layers - 2)
    mix_ops, mix = _backward_ops_and_grads(arch, "none", mixed)
    assert fwd_attn(mix_ops) == 1 and mm(none_ops) < mm(mix_ops) < mm(full_ops)
    for grads in (sel, full, mix):
        for name, g in ref.items():
            key = next(k for k in grads if k.replace("._checkpoint_wrapped_module", "") == name)
            torch.testing.assert_close(grads[key], g, rtol=1e-5, atol=1e-7)
