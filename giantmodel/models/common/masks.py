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
is applied where it attends (:func:`masked_attention`'s ``window``): on the
CPU the blocked kernel reads the document ids block by block (no T x T
mask; the dense mask is built only if a full-attention layer asks for it),
passed to the varlen kernel as ``window_size``, or built into a flex
BlockMask (once per mask and window). Unpacked rows longer than the window
take :func:`sliding_attention`, whose masks depend only on shapes and are
built once per process, never per step; no dense T x T mask exists for a
windowed layer on either device.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from giantmodel.core import compat


class DenseMask:
    """Boolean ``[B, 1, T, T]``: True where query t may attend key s. Built
    from ``document_ids`` on first use: on the CPU a sliding layer long
    enough for the blocked kernel (:func:`banded_cpu`) reads the ids
    instead, so a model whose layers are all windowed (Mistral) never
    builds the T x T mask."""

    def __init__(self, mask: torch.Tensor | None = None,
                 document_ids: torch.Tensor | None = None):
        if mask is None and document_ids is None:
            raise ValueError("DenseMask needs a mask or the document ids")
        self._mask = mask
        self.document_ids = document_ids
        """[B, T] ids the mask is made of (None when given a mask)."""
        self.windowed: dict = {}
        """window -> the mask ANDed with that window's band (built on first use)."""

    @property
    def mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = dense_document_mask(self.document_ids)
        return self._mask

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
    ``window - 1`` before (:class:`_BandedCPU`, :func:`banded_cpu`); else
    (and with attention dropout) SDPA with the [rows, span] band, cached."""
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda and not dropout_p:
        half = q.dtype in (torch.float16, torch.bfloat16)
        if half and _varlen_available() and _varlen_window():
            return _varlen_sliding(q, k, v, window)
        block = _sliding_block_mask(q.shape[2], k.shape[2], window, str(q.device))
        return _flex(q, k, v, block, gqa)
    if q.device.type == "cpu" and not dropout_p and banded_cpu(q.shape[2], window):
        return _BandedCPU.apply(q, k, v, window)
    band = window_band(q.shape[2], k.shape[2], window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=gqa,
                                          dropout_p=dropout_p)


def banded_cpu(rows: int, window: int) -> bool:
    """Whether :func:`sliding_attention` (and :func:`masked_attention` for
    packed rows) take the blocked CPU kernel for ``rows`` queries: whenever
    the window is shorter than the rows. It never builds a [rows, span]
    mask, where SDPA with the dense band converts it to an additive mask in
    the compute dtype and keeps it for backward in every layer (at 8,192
    tokens, 256 MiB a layer in fp32), so it always holds less. Time, on 2
    shared Xeon vCPUs (``benchmarks/sliding_window.py --core``, fastest of
    15, fp32 forward + backward): faster from 4x the window (0.46-0.72x the
    dense band's time); between 1.25x and 3x within noise of it either way
    (0.82-1.9x in one run, 0.84-0.93x in a quieter one), where the memory
    decides. The planner reads it."""
    return rows > window


@functools.lru_cache(maxsize=32)
def _block_mask(rows: int, span: int, window: int, dtype: torch.dtype,
                device: str) -> torch.Tensor:
    """Additive [1, 1, rows, span] mask of one query block against its keys
    (lower-right aligned, as :func:`window_band`): at most three shapes per
    sequence (the first block, the inner ones, a short last one)."""
    with torch.inference_mode(False):
        band = _window_band(rows, span, window, device)
        mask = torch.zeros(band.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~band, float("-inf"))[None, None]


def _blocks(rows: int, span: int, window: int):
    """(query slice, key slice) per block of ``window`` queries: queries are
    the last ``rows`` of the key span, so query r sits at key r + span -
    rows and sees that key and the ``window - 1`` before it."""
    offset = span - rows
    for start in range(0, rows, window):
        end = min(start + window, rows)
        lo = max(0, start + offset - window + 1)
        yield slice(start, end), slice(lo, end + offset)


def _mask_of(qs: slice, ks: slice, window: int, q: torch.Tensor, span: int,
             docs: torch.Tensor | None) -> torch.Tensor:
    """Additive mask of one block: the cached band, or with ``docs`` [B, span]
    (packed rows) the band ANDed with "same document", [B, 1, rows, keys]:
    a block's size, built on the fly in forward and again in backward."""
    nq, nk = qs.stop - qs.start, ks.stop - ks.start
    if docs is None:
        return _block_mask(nq, nk, window, q.dtype, str(q.device))
    offset = span - q.shape[2]
    q_docs = docs[:, qs.start + offset:qs.stop + offset]
    allowed = (q_docs[:, :, None] == docs[:, None, ks]) & window_band(nq, nk, window, q.device)
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    return mask.masked_fill_(~allowed, float("-inf"))[:, None]


class _BandedCPU(torch.autograd.Function):
    """Sliding-window attention on the CPU, one block of ``window`` queries
    at a time against its own keys and the ``window - 1`` before (views,
    never copies), through the CPU flash kernel: the work is rows x (2w - 1),
    not rows x span, and no [rows, span] mask exists. ``docs`` [B, span]
    (packed rows): a query also sees only keys of its own document; a query
    always sees itself, so no row of a block is fully masked. Saved for
    backward: q, k, v, the output (the same storage the output projection
    keeps: it is written in the [B, T, H, D] layout that projection reads)
    and the log-sum-exp, what full attention saves. Forward and backward
    write each block's result straight into the outputs, so beyond them
    they hold one block's temporaries at a time."""

    @staticmethod
    def forward(ctx, q, k, v, window: int, docs=None):
        B, H, rows, D = q.shape
        span = k.shape[2]
        # [B, H, rows, D] over [B, rows, H, D] memory, as SDPA returns it
        out = q.new_empty(B, rows, H, D).transpose(1, 2)
        lses = []
        for qs, ks in _blocks(rows, span, window):
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, qs], k[:, :, ks], v[:, :, ks], 0.0, False,
                attn_mask=_mask_of(qs, ks, window, q, span, docs))
            out[:, :, qs] = o
            lses.append(lse)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, docs = ctx.saved_tensors
        w, (B, H, rows, D), span = ctx.window, q.shape, k.shape[2]
        dq = q.new_empty(B, rows, H, D).transpose(1, 2)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for qs, ks in _blocks(rows, span, w):
            dqb, dkb, dvb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs],
                lse[:, :, qs], 0.0, False, attn_mask=_mask_of(qs, ks, w, q, span, docs))
            dq[:, :, qs] = dqb
            dk[:, :, ks] += dkb  # neighbouring blocks' keys overlap by window - 1
            dv[:, :, ks] += dvb
        return dq, dk, dv, None, None


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
    return DenseMask(document_ids=document_ids)


_compiled_flex = None


def _flex(q, k, v, block_mask, gqa: bool, score_mod=None):
    # flex_attention is only fast compiled; compile it once per process.
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    if score_mod is None:
        return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    return _compiled_flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)


@functools.lru_cache(maxsize=8)
def _softcap_mod(cap: float):
    # One function object per cap: the compiled flex kernel guards on it, so
    # a new closure per call would recompile every step.
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float,
                      window: int | None = None, mask=None,
                      dropout_p: float = 0.0, flex: bool = True) -> torch.Tensor:
    """Causal attention with the scores soft-capped before the softmax
    (Gemma 2's ``attn_logit_softcapping``: s -> tanh(s / cap) * cap), which
    SDPA and the flash kernels cannot do. ``q`` [B, H, rows, D] is the last
    rows of ``k``'s span (lower-right aligned, as :func:`window_band`);
    ``window`` and ``mask`` (a :class:`DenseMask` or :class:`FlexMask`) as in
    :func:`masked_attention`. CUDA without dropout: flex attention with the
    cap as its ``score_mod``; otherwise (or ``flex=False``) the math path,
    scores computed explicitly (the softmax in fp32, as Hugging Face's eager
    Gemma 2)."""
    rows, span = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, VarlenMask):
        raise ValueError("soft-capped attention takes a dense or flex document mask, not varlen")
    if flex and q.is_cuda and not dropout_p and not isinstance(mask, DenseMask):
        # window=span: a band as wide as the span is the plain causal mask
        block = (mask.for_window(window) if mask is not None
                 else _sliding_block_mask(rows, span, window or span, str(q.device)))
        return _flex(q, k, v, block, gqa, _softcap_mod(float(softcap)))
    allowed = (mask.for_window(window) if mask is not None
               else window_band(rows, span, window or span, q.device))
    if gqa:
        k, v = compat.expand_kv_heads(k, v, q.shape[1], head_dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask,
                     dropout_p: float = 0.0, window: int | None = None) -> torch.Tensor:
    """softmax(QK^T/sqrt(d)) V under ``mask``, and within the last ``window``
    keys of each query when set; q/k/v are [B, H, T, D], k/v possibly with
    fewer heads (GQA). Returns [B, H, T, D]. A windowed layer on the CPU
    takes the blocked kernel with the document ids (:func:`banded_cpu`)."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, DenseMask):
        T = q.shape[2]
        if (window is not None and q.device.type == "cpu" and not dropout_p
                and mask.document_ids is not None and banded_cpu(T, window)
                and k.shape[2] == T):
            return _BandedCPU.apply(q, k, v, window, mask.document_ids)
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
