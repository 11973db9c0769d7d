"""Block-diagonal causal attention for packed sequences.

A packed row holds several examples end to end; ``document_ids`` [B, T] says
which example each token belongs to. A token attends only to earlier tokens
of its own example, never across examples. :func:`document_mask` turns the ids
into the representation the device's fastest kernel takes, once per forward
(every layer shares it):

* CPU, or no faster kernel: a dense boolean mask [B, 1, T, T] for SDPA;
* CUDA with a half-precision compute dtype: cumulative sequence lengths for
  ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's varlen kernel);
* CUDA otherwise (fp32): a flex-attention ``BlockMask``.

The model itself stays plain: these are tensors passed down as a keyword, and
:func:`masked_attention` is the attention core's dispatch on their type.

Sliding windows (Mistral): a mask describes documents only; a layer's window
is applied where it attends (:func:`masked_attention`'s ``window``): ANDed
into the dense mask (once per mask and window), passed to the varlen kernel
as ``window_size``, or built into a flex BlockMask (once per mask and
window). Unpacked rows longer than the window take :func:`sliding_attention`,
whose masks depend only on shapes and are built once per process, never per
step; on CUDA no dense T x T mask exists at all.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from giantmodel.core import compat


@dataclass
class DenseMask:
    """Boolean ``[B, 1, T, T]``: True where query t may attend key s."""

    mask: torch.Tensor
    windowed: dict = field(default_factory=dict, repr=False)
    """window -> the mask ANDed with that window's band (built on first use)."""

    def for_window(self, window: int | None) -> torch.Tensor:
        if window is None or window >= self.mask.shape[-1]:
            return self.mask
        if window not in self.windowed:
            T = self.mask.shape[-1]
            self.windowed[window] = self.mask & window_band(T, T, window, self.mask.device)
        return self.windowed[window]


@dataclass
class VarlenMask:
    """The packed batch as flash-attention varlen segments: row-major flattened
    tokens cut at every example boundary and at every row end."""

    cu_seqlens: torch.Tensor
    """int32 [N + 1]: start offset of each segment in the flattened [B*T] tokens."""
    max_len: int
    """Longest segment, which the kernel needs on the host."""


@dataclass
class FlexMask:
    """A flex-attention BlockMask of the same block-diagonal causal pattern."""

    block_mask: object
    document_ids: torch.Tensor | None = None
    windowed: dict = field(default_factory=dict, repr=False)
    """window -> the BlockMask with that sliding window too (built on first use)."""

    def for_window(self, window: int | None):
        if window is None or self.document_ids is None:
            return self.block_mask
        if window not in self.windowed:
            self.windowed[window] = flex_document_mask(self.document_ids, window).block_mask
        return self.windowed[window]


def dense_document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: same document and key not after query."""
    T = document_ids.shape[-1]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal)[:, None]


def varlen_segments(document_ids: torch.Tensor) -> VarlenMask:
    """Segment boundaries of the flattened batch: a new segment starts wherever
    the id changes and at the start of every row (ids are contiguous runs)."""
    B, T = document_ids.shape
    starts = torch.ones(B, T, dtype=torch.bool, device=document_ids.device)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    idx = starts.flatten().nonzero().flatten().to(torch.int32)
    total = torch.tensor([B * T], dtype=torch.int32, device=document_ids.device)
    cu = torch.cat([idx, total])
    return VarlenMask(cu, int((cu[1:] - cu[:-1]).max()))  # one host sync per forward


def flex_document_mask(document_ids: torch.Tensor, window: int | None = None) -> FlexMask:
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids

    def mask_mod(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (kv_idx <= q_idx)

    def window_mod(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)

    B, T = docs.shape
    # Uncompiled, create_block_mask evaluates mask_mod densely over B x T x T
    # (a [B, T, T] temporary per call); compiled it never materialises that.
    # Dynamo reads ``docs`` as a graph input, so one compile serves every
    # batch of the same shape. The CPU keeps the eager builder: compiling
    # needs a C++ toolchain and only the CUDA flex kernel is fast anyway.
    block = create_block_mask(mask_mod if window is None else window_mod, B, None, T, T,
                              device=docs.device, _compile=docs.is_cuda)
    return FlexMask(block, docs)


def window_band(rows: int, span: int, window: int, device) -> torch.Tensor:
    """[rows, span] bool, lower-right aligned: query i sits at key i + span -
    rows and sees that key and the ``window - 1`` before it. Cached per
    shape (read-only: callers never modify it)."""
    return _window_band(rows, span, window, str(torch.device(device)))


@functools.lru_cache(maxsize=64)
def _window_band(rows: int, span: int, window: int, device: str) -> torch.Tensor:
    # Built outside inference mode so that a band first made by generation
    # can still be saved for a later training backward.
    with torch.inference_mode(False):
        q_at = torch.arange(rows, device=device)[:, None] + (span - rows)
        dist = q_at - torch.arange(span, device=device)[None, :]
        return (dist >= 0) & (dist < window)


@functools.lru_cache(maxsize=64)
def _sliding_block_mask(rows: int, span: int, window: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    offset = span - rows

    def mask_mod(b, h, q_idx, kv_idx):
        q_at = q_idx + offset
        return (kv_idx <= q_at) & (q_at - kv_idx < window)

    with torch.inference_mode(False):
        return create_block_mask(mask_mod, None, None, rows, span, device=device,
                                 _compile=device.startswith("cuda"))


def _varlen_sliding(q, k, v, window: int) -> torch.Tensor:
    """Each row of the batch as one varlen segment, the window as flash's
    ``window_size``: flash aligns the causal diagonal to the lower right when
    a row has more keys than queries, as :func:`window_band` does."""
    from torch.nn.attention.varlen import varlen_attn


    B, H, rows, D = q.shape
    span = k.shape[2]
    gqa_kw = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if gqa_kw and not compat.has("varlen_enable_gqa"):
        k, v = compat.expand_kv_heads(k, v, H, head_dim=1)
        gqa_kw = {}
    steps = torch.arange(B + 1, device=q.device, dtype=torch.int32)
    flat = [t.transpose(1, 2).reshape(B * t.shape[2], t.shape[1], D) for t in (q, k, v)]
    out = varlen_attn(*flat, steps * rows, steps * span, rows, span,
                      window_size=(window - 1, 0), **gqa_kw)
    return out.reshape(B, rows, H, D).transpose(1, 2)


def sliding_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                      dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of ``q`` [B, H, rows, D], the last rows of ``k``'s
    span, over at most the ``window`` latest keys each (a query's own
    included). CUDA: the flash varlen kernel with a window in half precision,
    else flex attention with a sliding BlockMask (built once per shape); the
    CPU: blocks of ``window`` queries, each against only its own keys and the
    ``window - 1`` before (:class:`_BandedCPU`), when that skips work; else
    (and with attention dropout) SDPA with the [rows, span] band, cached."""
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda and not dropout_p:
        half = q.dtype in (torch.float16, torch.bfloat16)
        if half and _varlen_available() and _varlen_window():
            return _varlen_sliding(q, k, v, window)
        block = _sliding_block_mask(q.shape[2], k.shape[2], window, str(q.device))
        return _flex(q, k, v, block, gqa)
    if q.device.type == "cpu" and not dropout_p and q.shape[2] >= 4 * window:
        return _BandedCPU.apply(q, k, v, window)
    band = window_band(q.shape[2], k.shape[2], window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=gqa,
                                          dropout_p=dropout_p)


@functools.lru_cache(maxsize=32)
def _banded_mask(blocks: int, window: int, left_pad: int, dtype: torch.dtype,
                 device: str) -> torch.Tensor:
    """Additive mask [blocks, 1, window, 2*window - 1]: block i's query j sits
    at its keys' index j + window - 1 and sees keys j .. j + window - 1; keys
    before index ``left_pad`` of the padded span (padding) are hidden."""
    with torch.inference_mode(False):
        j = torch.arange(window, device=device)[:, None]
        s = torch.arange(2 * window - 1, device=device)[None, :]
        band = (s >= j) & (s <= j + window - 1)
        start = torch.arange(blocks, device=device)[:, None, None] * window
        real = (start + s[None]) >= left_pad
        visible = band[None] & real
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~visible, float("-inf"))[:, None]


def _banded_blocks(q, k, v, window: int):
    """q as [B*n, H, w, D] blocks of ``window`` queries and k/v as [B*n, Hkv,
    2w-1, D] blocks of the keys each sees (copies: views of overlapping
    windows), plus the mask. Queries are the last rows of the key span;
    the span is padded on the left (or cut) so that block i's keys start at
    i*w, and both are padded on the right to whole blocks."""
    B, H, rows, D = q.shape
    span, w = k.shape[2], window
    n = -(-rows // w)
    shift = span - rows - (w - 1)  # first key index the first query may see
    left_pad = max(0, -shift)
    k, v = k[:, :, max(0, shift):], v[:, :, max(0, shift):]
    right = n * w + w - 1 - left_pad - k.shape[2]
    k, v = (F.pad(t, (0, 0, left_pad, right)) for t in (k, v))
    if n * w != rows:
        q = F.pad(q, (0, 0, 0, n * w - rows))
    # [B, H, n*w, D] -> [B*n, H, w, D]: a view when q is the usual transpose
    # of a [B, T, H, D] projection (no copy of the queries).
    qb = q.reshape(B, H, n, w, D).transpose(1, 2).reshape(B * n, H, w, D)

    def blocks(t, size):  # [B, h, L, D] -> [B*n, h, size, D]
        b = t.unfold(2, size, w)  # [B, h, n, D, size]
        return b.permute(0, 2, 1, 4, 3).reshape(B * n, t.shape[1], size, D)

    mask = _banded_mask(n, w, left_pad, q.dtype, str(q.device))
    mask = mask.expand(B, *mask.shape).reshape(B * n, 1, w, 2 * w - 1)
    return qb, blocks(k, 2 * w - 1), blocks(v, 2 * w - 1), mask, n


class _BandedCPU(torch.autograd.Function):
    """Sliding-window attention on the CPU as blocks: each block of ``window``
    queries attends its 2*window - 1 keys through the CPU flash kernel, so
    the work is rows x (2w - 1), not rows x span. Only q, k, v, the output
    and the log-sum-exp are saved (what full attention saves); the
    overlapping key blocks are rebuilt in backward."""

    @staticmethod
    def forward(ctx, q, k, v, window: int):
        qb, kb, vb, mask, n = _banded_blocks(q, k, v, window)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qb, kb, vb, 0.0, False, attn_mask=mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.window = window
        return _unblock(out, q.shape, n)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, rows, D = q.shape
        w, span = ctx.window, k.shape[2]
        n = out.shape[0] // B
        # The blocks' key gradients are summed into padded dk/dv by slices
        # (no autograd replay of the unfold: fewer layer-sized temporaries).
        qb, kb, vb, mask, _ = _banded_blocks(q, k, v, w)
        if n * w != rows:
            dout = F.pad(dout, (0, 0, 0, n * w - rows))
        db = dout.reshape(B, H, n, w, D).transpose(1, 2).reshape(B * n, H, w, D)
        dqb, dkb, dvb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            db, qb, kb, vb, out, lse, 0.0, False, attn_mask=mask)
        del qb, kb, vb, db
        dq = _unblock(dqb, q.shape, n)
        shift = span - rows - (w - 1)
        left_pad = max(0, -shift)
        # Block i's 2w - 1 keys start at i*w: their last w rows tile keys
        # [w - 1, w - 1 + n*w) and their first w - 1 (padded to w) tile
        # [0, n*w), so each part is one strided add, not one per block.
        Hkv = k.shape[1]
        dk_pad = k.new_empty(B, Hkv, n * w + w - 1, D)
        dv_pad = torch.empty_like(dk_pad)
        for pad, blocks in ((dk_pad, dkb), (dv_pad, dvb)):
            blocks = blocks.view(B, n, Hkv, 2 * w - 1, D).transpose(1, 2)
            pad[:, :, :w - 1].zero_()
            pad[:, :, w - 1:] = blocks[:, :, :, w - 1:].reshape(B, Hkv, n * w, D)
            pad[:, :, :n * w] += F.pad(blocks[:, :, :, :w - 1], (0, 0, 0, 1)).reshape(
                B, Hkv, n * w, D)
        real = slice(left_pad, left_pad + span - max(0, shift))
        if shift <= 0:  # every key is in some block: the gradients are views
            return dq, dk_pad[:, :, real], dv_pad[:, :, real], None
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dk[:, :, max(0, shift):] = dk_pad[:, :, real]
        dv[:, :, max(0, shift):] = dv_pad[:, :, real]
        return dq, dk, dv, None


def _unblock(out: torch.Tensor, shape, n: int) -> torch.Tensor:
    B, H, rows, D = shape
    w = out.shape[2]
    return out.reshape(B, n, H, w, D).transpose(1, 2).reshape(B, H, n * w, D)[:, :, :rows]


def _varlen_window() -> bool:

    return compat.has("varlen_window")


def _varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


class _LastMask:
    """The mask last built, kept while its ``document_ids`` tensor is alive
    and unmodified: a forward that is run again on the same batch (an
    evaluation pass, a pipeline stage's recompute) reuses it instead of
    building it again. A weak reference, so a freed batch is never matched
    by a new tensor that happens to reuse its id."""

    ref = None
    key: tuple = ()
    mask = None

    @classmethod
    def get(cls, ids: torch.Tensor, key: tuple):
        if cls.ref is not None and cls.ref() is ids and cls.key == key:
            return cls.mask
        return None

    @classmethod
    def put(cls, ids: torch.Tensor, key: tuple, mask) -> None:
        cls.ref, cls.key, cls.mask = weakref.ref(ids), key, mask


def document_mask(document_ids: torch.Tensor, compute_dtype: torch.dtype,
                  kernel: str = "auto") -> DenseMask | VarlenMask | FlexMask:
    """The mask for ``document_ids`` in the form the fastest available kernel
    takes (see the module docstring). ``kernel`` forces one: "dense",
    "varlen" or "flex". Built once per batch: every layer shares it, and a
    second call with the same (unmodified) tensor returns the same mask."""
    if document_ids.is_inference():  # no version counter to tell an in-place change
        return _build_document_mask(document_ids, compute_dtype, kernel)
    key = (document_ids._version, tuple(document_ids.shape), compute_dtype, kernel)
    mask = _LastMask.get(document_ids, key)
    if mask is None:
        mask = _build_document_mask(document_ids, compute_dtype, kernel)
        _LastMask.put(document_ids, key, mask)
    return mask


def _build_document_mask(document_ids: torch.Tensor, compute_dtype: torch.dtype,
                         kernel: str) -> DenseMask | VarlenMask | FlexMask:
    if kernel == "auto":
        kernel = "dense"
        if document_ids.is_cuda:
            half = compute_dtype in (torch.float16, torch.bfloat16)
            varlen = half and _varlen_available() and _varlen_window()
            kernel = "varlen" if varlen else "flex"
    if kernel == "varlen":
        return varlen_segments(document_ids)
    if kernel == "flex":
        return flex_document_mask(document_ids)
    return DenseMask(dense_document_mask(document_ids))


_compiled_flex = None


def _flex(q, k, v, block_mask, gqa: bool):
    # flex_attention is only fast compiled; compile it once per process.
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask,
                     dropout_p: float = 0.0, window: int | None = None) -> torch.Tensor:
    """softmax(QK^T/sqrt(d)) V under ``mask``, and within the last ``window``
    keys of each query when set; q/k/v are [B, H, T, D], k/v possibly with
    fewer heads (GQA). Returns [B, H, T, D]."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, DenseMask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.for_window(window),
                                              enable_gqa=gqa, dropout_p=dropout_p)
    if dropout_p:
        raise ValueError("attention dropout with packed sequences needs the dense mask kernel")
    if isinstance(mask, FlexMask):
        return _flex(q, k, v, mask.for_window(window), gqa)
    if isinstance(mask, VarlenMask):
        from torch.nn.attention.varlen import varlen_attn

        gqa_kw = {"enable_gqa": True} if gqa else {}
        if gqa and not compat.has("varlen_enable_gqa"):  # torch 2.11's varlen_attn
            k, v = compat.expand_kv_heads(k, v, q.shape[1], head_dim=1)
            gqa_kw = {}
        B, H, T, D = q.shape
        flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (q, k, v)]
        left = -1 if window is None else window - 1
        out = varlen_attn(*flat, mask.cu_seqlens, mask.cu_seqlens, mask.max_len, mask.max_len,
                          window_size=(left, 0), **gqa_kw)
        return out.reshape(B, T, H, D).transpose(1, 2)
    raise TypeError(f"unknown attention mask {type(mask).__name__}")
