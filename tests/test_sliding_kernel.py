"""The blocked CPU sliding-window kernel beyond tests/test_families_gemma_phi.py's
fp64 check: fp32 against the dense band at a size with many blocks, with
packed rows (document masks) and GQA, and its memory: it saves what full
attention saves (less than the dense band, which keeps a [T, T] mask), and
its forward and backward hold about one block's temporaries beyond their
outputs."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch
import torch.nn.functional as F

from giantmodel.models.common import masks


def _qkv(B, H, Hkv, T, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # [B, T, H, D] projections viewed as [B, H, T, D], as the attention layer passes them
    q = torch.randn(B, T, H, D, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(B, T, Hkv, D, generator=g, dtype=dtype).transpose(1, 2)
            .requires_grad_() for _ in range(2))
    return q, k, v


def test_fp32_matches_the_dense_band_with_many_blocks():
    q, k, v = _qkv(2, 4, 2, 300, 16)
    w = 32  # 300 rows: nine whole blocks and a short last one
    assert masks.banded_cpu(300, w)
    band = masks.window_band(300, 300, w, "cpu")
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True)
    out = masks.sliding_attention(q, k, v, w)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad),
                    torch.autograd.grad(ref, (q, k, v), grad), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _packed(B):
    """Document ids of ``B`` packed rows of 300 tokens: documents shorter
    and longer than a block, boundaries inside and at block edges."""
    lengths = [[50, 100, 150], [7, 200, 93]][:B]
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])


def test_packed_rows_match_the_dense_document_mask_without_building_it():
    """A windowed layer on packed rows takes the blocked kernel with the
    document ids: values and gradients equal SDPA under the dense document
    mask ANDed with the band (fp32, GQA, the window shorter and longer than
    documents, rows from 1.1x to 9x the window), and the [B, 1, T, T] mask
    is never built."""
    B, T = 2, 300
    docs = _packed(B)
    dense = masks.dense_document_mask(docs)
    for w, hkv in ((32, 2), (64, 4), (128, 1), (272, 2)):
        q, k, v = _qkv(B, 4, hkv, T, 16, seed=w)
        mask = masks.document_mask(docs.clone(), torch.float32)
        assert masks.banded_cpu(T, w)
        out = masks.masked_attention(q, k, v, mask, window=w)
        assert mask._mask is None, w   # no T x T mask built
        ref = F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense & masks.window_band(T, T, w, "cpu"), enable_gqa=hkv != 4)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        for a, b in zip(torch.autograd.grad(out, (q, k, v), grad),
                        torch.autograd.grad(ref, (q, k, v), grad), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # a full-attention layer (Gemma's global ones) still reads the dense mask
    q, k, v = _qkv(B, 4, 2, T, 16)
    mask = masks.document_mask(docs.clone(), torch.float32)
    masks.masked_attention(q, k, v, mask)
    torch.testing.assert_close(mask.mask, dense)


def test_saves_less_than_the_dense_band():
    """The dense-band path (SDPA with the [T, T] boolean mask) keeps the
    mask, made additive in the compute dtype, for backward; the blocked
    kernel keeps no mask, unpacked or packed, even at 1.25x the window."""
    B, T, w = 2, 300, 240
    q, k, v = _qkv(B, 4, 2, T, 16)
    band = masks.window_band(T, T, w, "cpu")
    dense, _ = _saved_bytes(
        lambda *a: F.scaled_dot_product_attention(*a, attn_mask=band, enable_gqa=True), q, k, v)
    blocked, _ = _saved_bytes(masks.sliding_attention, q, k, v, w)
    assert dense - blocked >= T * T * 4, (dense, blocked)
    docs = _packed(B)
    packed_dense, _ = _saved_bytes(masks.masked_attention, q, k, v,
                                   masks.DenseMask(masks.dense_document_mask(docs)), 0.0, w)
    packed, _ = _saved_bytes(masks.masked_attention, q, k, v,
                             masks.DenseMask(document_ids=docs), 0.0, w)
    assert packed == blocked + docs.numel() * 8   # the ids: int64 [B, T]
    assert packed_dense - packed >= T * T * 4, (packed_dense, packed)


def _saved_bytes(fn, *args) -> tuple[int, torch.Tensor]:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return sum(storages.values()), out


def test_saves_what_full_attention_saves():
    """q, k, v, the log-sum-exp and the output, the output in the layout
    the output projection reads (its reshape is a view: one copy kept)."""
    q, k, v = _qkv(2, 4, 1, 512, 32)
    full, out_full = _saved_bytes(
        lambda *a: F.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True), q, k, v)
    banded, out = _saved_bytes(masks.sliding_attention, q, k, v, 64)
    assert banded == full
    flat = out.transpose(1, 2).reshape(2, 512, -1)
    assert flat.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()


def _mallinfo():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc's mallinfo2 to read live heap bytes")

    class Info(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = Info

    def live() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd   # heap in use + mmapped chunks

    return live


def _backward_transient(core, live, shape) -> int:
    """Peak live heap bytes above the start of backward, read after every
    op the backward dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Peak(TorchDispatchMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Peak.peak = max(Peak.peak, live())
            return out

    q, k, v = _qkv(*shape)
    out = core(q, k, v)
    grad = torch.randn(out.shape)
    start = Peak.peak = live()
    with Peak():
        out.backward(grad)
    return Peak.peak - start


def test_backward_holds_one_block_beyond_its_gradients():
    """Full attention's backward allocates dq, dk and dv; the banded one
    those and one block's gradients (the previous kernel rebuilt every
    overlapping key block and its gradient: about 1.9x full's here)."""
    live = _mallinfo()
    shape = (1, 8, 2, 2048, 64)   # q 4 MiB, k and v 1 MiB each; 16 blocks of 128

    def full(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def banded(q, k, v):
        return masks.sliding_attention(q, k, v, 128)

    for core in (full, banded):   # warm up: the kernels' caches and thread pools
        _backward_transient(core, live, shape)
    t_full, t_banded = (_backward_transient(c, live, shape) for c in (full, banded))
    assert t_full >= 6 * 2 ** 20 * 0.95, t_full   # dq + dk + dv
    assert t_banded <= 1.25 * t_full, (t_banded, t_full)


def test_planner_counts_no_dense_band_where_the_blocked_kernel_runs():
    """Mistral's 128 window at 512 tokens takes the blocked kernel: the
    planner's activations (no [T, T] band or mask) match what the forward
    keeps, as tests/test_planner_families.py checks at 256 tokens."""
    from test_planner_families import _family, _layout, _measure_block

    from giantmodel.planner.hardware import get_profile
    from giantmodel.planner.memory import dense_band, rank_memory

    B, T = 1, 512
    m = _family("mistral", vocab_size=1024, num_layers=2)
    assert not dense_band(m, T) and not dense_band(m, 160) and not dense_band(m, 128)
    r = rank_memory(m, _layout(m, "fp32", B, T), 0, get_profile("cpu"))
    pred = (r.components["activations"] + r.components["embedding_head_activations"]
            + r.components["working_weights"] - B * T * 8)  # ids made outside
    live, saved = _measure_block(m, "fp32", B, T)
    assert abs(pred / live - 1) < 0.02, (pred, live)
    assert abs(pred / saved - 1) < 0.02, (pred, saved)
