"""Attention's share of the time model, block by block: the pairs a causal
or sliding-window core scores (Gemma's local layers a window's, its global
ones the whole causal triangle), the seconds of the fused kernel or of
soft-capped attention's math path (scores materialised), and how far a
pipeline rank's mix of local and global layers is from the mean block
:func:`giantmodel.planner.perf.layer_time` counts."""

from __future__ import annotations

from giantmodel.planner.layout import Layout
from giantmodel.planner.memory import DTYPE_BYTES, cp_masked_attention, on_accelerator
from giantmodel.planner.moe import attention_width
from giantmodel.planner.roofline import gemm_time, mem_time
from giantmodel.planner.terms import softcap_math


def attention_pairs(m, seq_len: int, layer: int | None = None) -> float:
    """(query, key) pairs one sequence's causal attention scores in block
    ``layer``, in the continuous form the FLOP counts use: s^2 / 2, or with
    a sliding window of w < s keys (min(w, position) keys per query)
    w s - w^2 / 2, which grows with the window, not with s. Gemma's
    ``full_attention`` layers have no window (ModelConfig.window_of).
    ``layer`` None: the mean over the model's blocks, so num_layers times
    it is the model's total (5 local layers to 1 global: mostly windows)."""
    if layer is not None:
        return _pairs(m.window_of(layer), seq_len)
    local = sum(m.window_of(i) is not None for i in range(m.num_layers))
    return (local * _pairs(m.sliding_window, seq_len)
            + (m.num_layers - local) * _pairs(None, seq_len)) / m.num_layers


def _pairs(window: int | None, seq_len: int) -> float:
    if window is None or window >= seq_len:
        return seq_len * seq_len / 2.0
    return window * seq_len - window * window / 2.0


# Bytes moved per [s, s] score by soft-capped attention's math path
# (giantmodel.models.common.masks.softcap_attention), c the compute dtype's:
# forward, the scores written by their matmul (c), five elementwise passes
# each reading and writing them (scale, / cap, tanh, * cap, masked fill: 10c
# and the 1-byte mask), the softmax read (c) and its fp32 output (4), and in
# bf16 the cast back (4 + c); backward each pass's gradient the same way,
# reading the saved output besides: about twice the forward.
def _softcap_fwd_bytes(c: int) -> float:
    return 12.0 * c + 5 + (4 + c if c < 4 else 0)


def attention_time(m, layout: Layout, hw, opts,
                   layer: int | None = None) -> tuple[float, float]:
    """Forward and backward seconds of one block's attention core, one
    micro-batch; ``layer`` as in :func:`attention_pairs` (None: the mean
    block). The fused kernel scores :func:`attention_pairs` (its backward
    ``flash_bwd_factor`` times the forward). Soft-capped scores on the math
    path (:func:`giantmodel.planner.terms.softcap_math`: a CPU, or attention
    dropout) compute every [s, s] score whatever the window, as two batched
    GEMMs (QK^T, PV; four in backward) and score-sized elementwise passes.
    ``opts``: the :class:`giantmodel.planner.perf.PerfOptions`."""
    t, cp, prec = layout.tp, layout.cp, layout.precision
    if softcap_math(m, on_accelerator(hw)):
        s, d = layout.seq_len, m.dim_per_head   # cp is refused with soft-capping
        rows = layout.micro_batch * m.num_heads / t * s
        mm = gemm_time(hw, prec, rows, d, s) + gemm_time(hw, prec, rows, s, d)
        passes = mem_time(hw, rows * s * _softcap_fwd_bytes(DTYPE_BYTES[prec]))
        return mm + passes, 2 * mm + 2 * passes
    flops = 4.0 * layout.micro_batch * attention_pairs(m, layout.seq_len, layer) \
        * attention_width(m) / (t * cp)
    masked = opts.cp_masked_attention
    if cp > 1 and (cp_masked_attention(m) if masked is None else masked):
        flops *= (2 * cp + 1) / (2 * cp)   # each chunk's rectangle up to its end
    fwd = flops / (hw.flops(prec) * hw.attention_efficiency)
    return fwd, opts.flash_bwd_factor * fwd


def rank_attention_skew(m, layout: Layout, hw, opts,
                        pp_rank: int) -> tuple[float, float]:
    """Forward and backward seconds pipeline rank ``pp_rank``'s attention
    takes beyond its blocks counted as mean blocks (:func:`layer_time`):
    Gemma's local and global layers need not split evenly over the stages
    (a 5:1 pattern over two stages of 13 blocks gives one 2 global layers,
    the other 3). Full recompute re-runs the forward in backward. Zero
    unless the layers differ (``layer_types``)."""
    if m.layer_types is None or m.sliding_window is None:
        return 0.0, 0.0
    mean_f, mean_b = attention_time(m, layout, hw, opts)
    by_kind = {}
    starts = [sum(layout.stage_layers[:s]) for s in range(layout.num_stages)]
    ids = [starts[s] + i for s in layout.rank_stages(pp_rank)
           for i in range(layout.stage_layers[s])]
    df = db = 0.0
    for layer, mode in zip(ids, layout.layer_modes(pp_rank), strict=True):
        kind = m.window_of(layer)
        if kind not in by_kind:
            by_kind[kind] = attention_time(m, layout, hw, opts, layer)
        f, b = by_kind[kind]
        df += f - mean_f
        db += b - mean_b + (f - mean_f if mode == "full" else 0.0)
    return df, db
