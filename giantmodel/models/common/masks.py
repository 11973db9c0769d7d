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
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from giantmodel.core import compat


@dataclass
class DenseMask:
    """Boolean ``[B, 1, T, T]``: True where query t may attend key s."""

    mask: torch.Tensor


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


def flex_document_mask(document_ids: torch.Tensor) -> FlexMask:
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids

    def mask_mod(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (kv_idx <= q_idx)

    B, T = docs.shape
    # Uncompiled, create_block_mask evaluates mask_mod densely over B x T x T
    # (a [B, T, T] temporary per call); compiled it never materialises that.
    # Dynamo reads ``docs`` as a graph input, so one compile serves every
    # batch of the same shape. The CPU keeps the eager builder: compiling
    # needs a C++ toolchain and only the CUDA flex kernel is fast anyway.
    return FlexMask(create_block_mask(mask_mod, B, None, T, T, device=docs.device,
                                      _compile=docs.is_cuda))


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
            kernel = "varlen" if half and _varlen_available() else "flex"
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
                     dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(QK^T/sqrt(d)) V under ``mask``; q/k/v are [B, H, T, D], k/v
    possibly with fewer heads (GQA). Returns [B, H, T, D]."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, DenseMask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.mask, enable_gqa=gqa,
                                              dropout_p=dropout_p)
    if dropout_p:
        raise ValueError("attention dropout with packed sequences needs the dense mask kernel")
    if isinstance(mask, FlexMask):
        return _flex(q, k, v, mask.block_mask, gqa)
    if isinstance(mask, VarlenMask):
        from torch.nn.attention.varlen import varlen_attn

        gqa_kw = {"enable_gqa": True} if gqa else {}
        if gqa and not compat.has("varlen_enable_gqa"):  # torch 2.11's varlen_attn
            k, v = compat.expand_kv_heads(k, v, q.shape[1], head_dim=1)
            gqa_kw = {}
        B, H, T, D = q.shape
        flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (q, k, v)]
        out = varlen_attn(*flat, mask.cu_seqlens, mask.cu_seqlens, mask.max_len, mask.max_len,
                          window_size=(-1, 0), **gqa_kw)
        return out.reshape(B, T, H, D).transpose(1, 2)
    raise TypeError(f"unknown attention mask {type(mask).__name__}")
