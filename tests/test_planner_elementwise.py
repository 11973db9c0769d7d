"""The time model's element-wise term against what the block's kernels write.

layer_time charges ``mem_time(2 x bytes)`` per block for the tensors the
block's element-wise kernels write (once written, once read): the saved
tensors, plus the ones the fused path writes without keeping them
(terms.norm_working_bytes, terms.gated_working_bytes). A tensor that stops
being saved while its kernel still writes it must stay in the time.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from giantmodel.config.model import ModelConfig
from giantmodel.models.common.layers import SwiGLU
from giantmodel.planner import perf
from giantmodel.planner.hardware import get_profile
from giantmodel.planner.layout import Cluster, Layout
from giantmodel.planner.perf import PerfOptions, layer_time
from giantmodel.planner.roofline import mem_time
from giantmodel.planner.terms import gated_working_bytes

B, T, H, F = 2, 8, 32, 80


def _llama() -> ModelConfig:
    m = ModelConfig(arch="llama", name="t", hidden_size=H, num_layers=1, num_heads=4,
                    num_kv_heads=None, ffn_hidden_size=F, vocab_size=64, max_seq_len=T)
    m.validate()
    return m


class _Writes(TorchDispatchMode):
    """Every op's output storages (pointer, bytes, op name), in order; the
    outputs are held, so that no storage is freed and its address reused."""

    def __init__(self):
        super().__init__()
        self.out: list[tuple[int, int, str]] = []
        self.held: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        for t in res if isinstance(res, (tuple, list)) else (res,):
            if isinstance(t, torch.Tensor) and t.numel():
                st = t.untyped_storage()
                self.out.append((st.data_ptr(), st.nbytes(), func.__name__))
                self.held.append(t)
        return res


def _swiglu_writes(dtype: torch.dtype):
    """(forward writes not saved for backward, backward writes) of one fused
    SwiGLU over B x T tokens, in ``dtype`` (bf16: autocast, a bf16 input)."""
    torch.manual_seed(0)
    mlp = SwiGLU(H, F)
    x = torch.randn(B, T, H, dtype=dtype, requires_grad=True)
    saved: set[int] = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    fwd, bwd = _Writes(), _Writes()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fwd:
            y = mlp(x)
    with bwd:
        y.sum().backward()
    kept = saved | {y.untyped_storage().data_ptr()}
    return [w for w in fwd.out if w[0] not in kept], bwd.out


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_gated_activation_is_timed_though_not_kept(precision, dtype):
    """The fused SwiGLU keeps gate and up and the product, not act(gate),
    but its forward writes act(gate) ([tokens, f] in the compute dtype)
    before the product reads it, and backward runs the activation again.
    gated_working_bytes counts that one tensor, and layer_time adds it to
    the element-wise term; a time model following only the saved tensors
    (as once the activation stopped being kept) drops it."""
    dropped, backward = _swiglu_writes(dtype)
    ffn_wide = [w for w in dropped if w[1] == B * T * F * torch.finfo(dtype).bits // 8]
    assert [w[2] for w in ffn_wide] == ["silu.default"], dropped
    m = _llama()
    want = gated_working_bytes(m, precision, B, T, 1, False, 1)
    assert want == {"feed_forward.act_work": ffn_wide[0][1]}
    assert "silu.default" in {w[2] for w in backward}   # rebuilt, not read back
    hw, cluster, opts = get_profile("h100-sxm"), Cluster(1, 8), PerfOptions()
    lay = Layout(tp=1, pp=1, dp=1, dp_shard=1, cp=1, sp=False, zero=0, virtual=1,
                 schedule="1f1b", micro_batch=B, n_micro=1, seq_len=T, precision=precision,
                 recompute="none", offload_activations=False, stage_layers=(1,))
    timed = layer_time(m, lay, hw, cluster, opts)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(perf, "gated_working_bytes", lambda *a: {})
        saved_only = layer_time(m, lay, hw, cluster, opts)
    work = sum(want.values())
    assert timed.fwd - saved_only.fwd == pytest.approx(mem_time(hw, 2 * work), rel=1e-9)
    assert timed.bwd - saved_only.bwd == pytest.approx(2 * mem_time(hw, 2 * work), rel=1e-9)


def test_gated_work_follows_the_block_kind():
    """Split by tp for the dense FFN; an MoE layer's shared experts (whole
    on every tp rank) count theirs, its routed experts keep theirs; GPT's
    GELU output is a kept tensor already."""
    m = _llama()
    assert gated_working_bytes(m, "bf16", 1, T, 4, True, 1) == {
        "feed_forward.act_work": T * 2 * F / 4}
    gpt = ModelConfig(arch="gpt", name="g", hidden_size=H, num_layers=1, num_heads=4,
                      num_kv_heads=None, ffn_hidden_size=F, vocab_size=64, max_seq_len=T)
    assert gated_working_bytes(gpt, "bf16", 1, T, 1, False, 1) == {}
