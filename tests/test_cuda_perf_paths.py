"""The CUDA memory and speed paths, checked on the CPU: what selective
recompute keeps, how often a packed batch's mask is built, which masks
context-parallel attention hands to SDPA, and QLoRA's build."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from giantmodel.config.model import ModelConfig
from giantmodel.models.common import masks
from giantmodel.models.registry import build_model, init_weights


def _model(cfg: ModelConfig, seed: int = 0):
    return init_weights(build_model(cfg), cfg, seed)


def _tiny(arch: str = "llama", layers: int = 3, **kw) -> ModelConfig:
    base = dict(arch=arch, vocab_size=64, hidden_size=32, num_layers=layers, num_heads=4,
                num_kv_heads=2 if arch == "llama" else 4, ffn_hidden_size=64, max_seq_len=32)
    base.update(kw)
    return ModelConfig(**base)


# ------------------------------------------------------------ selective recompute
class _Ctx:
    def __init__(self, is_recompute: bool):
        self.is_recompute = is_recompute


def test_selective_policy_saves_packed_attention_kernels():
    """The flex-attention op and varlen's custom op are kept in forward and
    read back in the recompute, like SDPA's fused kernels; before, the policy
    did not know them and they ran again in backward."""
    from torch.utils.checkpoint import CheckpointPolicy

    from giantmodel.parallel.recompute import _SelectivePolicy

    flex = pytest.importorskip("torch._higher_order_ops.flex_attention").flex_attention
    ops = [flex, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]
    if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        importlib.import_module("torch.nn.attention.varlen")  # registers its custom op
        ops.append(torch.ops.torch_attn._varlen_attn.default)
    policy = _SelectivePolicy()
    for op in ops:
        for phase in (False, True):
            assert policy(_Ctx(phase), op) == CheckpointPolicy.MUST_SAVE, op
    assert policy(_Ctx(False), torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


def test_selective_recompute_runs_packed_attention_once():
    """A packed batch under selective recompute: the attention kernel runs
    once per block in forward and not again in backward (an outer dispatch
    mode sees only the kernels that really execute), and gradients match
    the model without recompute."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from giantmodel.parallel.recompute import _ATTENTION, apply_recompute

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in _ATTENTION
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    cfg = _tiny(layers=2)
    ref, model = _model(cfg), _model(cfg)
    apply_recompute(model, {f"layers.{i}": "selective" for i in range(2)})
    ids = torch.randint(0, 64, (2, 16))
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    pos = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16) * torch.tensor([[1], [0]])
    pos = pos + torch.tensor([[0], [1]]) * torch.arange(16)
    counter = Count()
    with counter:
        model(ids, positions=pos, document_ids=docs).sum().backward()
    ref(ids, positions=pos, document_ids=docs).sum().backward()
    assert counter.n == 2  # one per block, forward only
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


# ------------------------------------------------------------ packed-batch masks
def test_document_mask_is_built_once_per_batch(monkeypatch):
    """One mask per forward whatever the depth, and none at all when the
    same batch goes through again; a new or modified batch builds anew."""
    calls = []
    real = masks._build_document_mask
    monkeypatch.setattr(masks, "_build_document_mask",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _model(_tiny(layers=4)).eval()
    ids = torch.randint(0, 64, (2, 16))
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    with torch.no_grad():
        first = model(ids, document_ids=docs)
        assert len(calls) == 1
        torch.testing.assert_close(model(ids, document_ids=docs), first)
        assert len(calls) == 1
        model(ids, document_ids=docs.clone())
        assert len(calls) == 2
        docs[1, 8:] = 1  # in place: the cached mask no longer describes it
        changed = model(ids, document_ids=docs)
        assert len(calls) == 3
    assert not torch.allclose(changed[1], first[1])
