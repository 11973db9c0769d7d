"""Memory model, per rank: model states, activations, buffers.

Model states are counted from the model built on the meta device, parameter by
parameter, with the exact tensor-parallel shard shapes, FSDP2's dim-0 shards
(zero 2/3) and giantmodel.parallel.data's whole-parameter ownership (zero 1),
so they match what the parallel engine allocates byte for byte.

Activations are the tensors autograd keeps for backward in *this project's*
blocks (giantmodel.models.common), listed one by one in ``layer_terms``: the
residual stream is in the compute dtype, norms keep their input and an fp32
rstd, the fused q|k|v and gate|up GEMMs keep their one input (its sequence
shard under sp), each tensor once. The layout of Korthikanti et al. 2022
(34*s*b*h + 5*a*s^2*b per layer in fp16) is the cross-check; flash
attention removes the s^2 term.

Recompute modes follow giantmodel.parallel.recompute: ``selective`` runs
each block under an op-level policy that saves matmul outputs, the fused
attention output and reducing-collective results and recomputes everything
else (norms, rotary, casts, the MLP activation, all-gathers); ``full``
checkpoints whole blocks and keeps only each block's input. Either way the
checkpoint keeps the block input.

Weights (zero 0/1): the fused linears keep their compute-dtype casts from
one optimizer step to the next (``train.weight_cast=step``), whatever the
block recomputes; the other linears' autocast copies are kept until
backward by the blocks that do not recompute. Under zero 2/3, FSDP2's
mixed-precision policy gathers bf16 parameters and no cast is needed. A
LoRA base kept in bf16 or NF4 has no casts (giantmodel.planner.frozen); its
adapters, fp32 leaves, do.

Parameters (each one's shape and tp/ep split, one block's from the model
built on the meta device, a pipeline stage's list) are counted in
giantmodel.planner.params and re-exported here.

An MoE model's blocks are charged per kind (giantmodel.planner.moe): a
rank's dense blocks with the dense FFN's saved tensors and casts, its MoE
blocks with the router's, the dispatch's and the experts' (E / ep of them),
and ZeRO-2/3's gathered and reduce buffers by the largest block it holds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from giantmodel.models.common.masks import banded_cpu
from giantmodel.parallel.flat_buffer import layout_sizes, padding_and_first_bucket
from giantmodel.parallel.fsdp import kept_gathered
from giantmodel.parallel.strategy import strategy_name
from giantmodel.planner.frozen import (
    base_copy_numel,
    bf16_residual,
    frozen_param_bytes,
)
from giantmodel.planner.head import (
    head_edge_bytes,
    head_loss_impl,
    head_transient_bytes,
    head_weight_copy,
)
from giantmodel.planner.layout import Layout
from giantmodel.planner.moe import (
    block_config,
    block_sparsity,
    is_moe_block,
    rank_block_kinds,
)
from giantmodel.planner.params import (  # noqa: F401  (re-exported: callers import them here)
    _TABLES,
    Param,
    ParamTable,
    _model_key,
    _tp_dim,
    active_matmul_params,
    linear_numel,
    model_active_param_count,
    model_param_count,
    param_table,
    stage_param_list,
    stage_params,
)
from giantmodel.planner.terms import (  # noqa: F401  (re-exported)
    DTYPE_BYTES,
    Term,
    cp_masked_attention,
    cp_none_terms,
    layer_terms,
    selective_terms,
    softcap_score_bytes,
    term_bytes,
)

MIB = 1024 ** 2

# Fragmentation allowance on top of what the caching allocator hands out for
# activations and transient buffers (their sizes vary step to step).
FRAGMENTATION = 0.08


# ------------------------------------------------------------------ params
# Param, ParamTable and a stage's parameter list live in planner/params.py;
# re-exported here, where the planner's callers and tests import them.

def shard_numel(shape: tuple[int, ...], degree: int, rank: int = 0) -> int:
    """Elements of ``rank``'s dim-0 shard (FSDP2 chunking: ceil-sized chunks,
    the last ranks may get fewer or none)."""
    if degree == 1:
        return math.prod(shape)
    rows = shape[0]
    chunk = -(-rows // degree)
    mine = max(0, min(chunk, rows - rank * chunk))
    return mine * math.prod(shape[1:])


def owner_numel(shapes: list[tuple[int, ...]], degree: int, rank: int = 0) -> int:
    """Elements whose optimizer state ``rank`` keeps under this project's
    ZeRO-1: whole parameters, largest first, each to the least-loaded rank
    (ties to the lower index), as giantmodel.parallel.data assigns them."""
    if degree == 1:
        return sum(math.prod(s) for s in shapes)
    sizes = [math.prod(s) for s in shapes]
    load = [0] * degree
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(degree), key=lambda k: (load[k], k))
        load[r] += sizes[i]
    return load[rank]


@dataclass(frozen=True)
class StateBytes:
    """Bytes per element of each model state for a precision style."""

    param: int
    grad: int
    optim: int

    @staticmethod
    def for_style(style: str) -> StateBytes:
        # autocast (this project): fp32 params used directly under autocast,
        # fp32 grads, Adam m and v in fp32.  mixed (Megatron/DeepSpeed, the ZeRO
        # paper): fp16 params and grads, fp32 master + m + v in the optimizer.
        if style == "autocast":
            return StateBytes(4, 4, 8)
        if style == "mixed":
            return StateBytes(2, 2, 12)
        if style == "fp32":
            return StateBytes(4, 4, 8)
        raise ValueError(f"unknown precision style {style!r}")


def model_state_bytes(shapes: list[tuple[int, ...]], zero: int, shard_degree: int,
                      style: str = "autocast", rank: int = 0,
                      zero1: str = "owner", strategy: str = "own",
                      bucket_mb: float = 25.0) -> dict[str, int]:
    """Params, grads and optimizer states on one rank, by ZeRO stage:
    1 shards optimizer states, 2 also gradients, 3 also parameters.

    ``strategy`` is the engine's data-parallel strategy for the layout
    (:func:`giantmodel.parallel.strategy.strategy_name`). "own" (zero 0/1/2
    on flat buffers) counts what the engine allocates: whole-parameter
    ownership per bucket, buffers padded to equal owner chunks
    (:func:`giantmodel.parallel.flat_buffer.layout_sizes`); zero 2 keeps whole
    parameters, as in the ZeRO paper. "fsdp" (zero 3, HSDP, zero 2 under
    pipelines) shards dim 0 as FSDP2 does; its zero 2 keeps the parameters
    sharded at rest (the copy gathered from forward to backward is counted
    as working weights). ``zero1="even"`` is the ZeRO paper's even split,
    which style "mixed" (Megatron/DeepSpeed bytes per element) follows."""
    b = StateBytes.for_style(style)
    sizes = [math.prod(s) for s in shapes]
    full = sum(sizes)
    if zero == 0 or shard_degree == 1 or strategy == "none":
        params = grads = opt = full
    elif strategy == "own" and zero1 == "owner":
        flat = layout_sizes(sizes, owners=shard_degree, rank=rank,
                            bucket_numel=int(bucket_mb * 2**20) // b.grad)
        params = flat.total if style != "mixed" else full
        grads = flat.shard if zero == 2 else flat.total
        opt = flat.owned
    else:
        shard = sum(shard_numel(s, shard_degree, rank) for s in shapes)
        params = shard if zero >= (3 if style == "mixed" or strategy == "own" else 2) else full
        grads = shard if zero >= 2 else full
        opt = shard
    return {
        "params": b.param * params,
        "grads": b.grad * grads,
        "optimizer": b.optim * opt,
    }


# ------------------------------------------------------------- activations
_ACTS: dict[tuple, dict[str, float]] = {}


def layer_activation_bytes(m, precision: str, mode: str, micro_batch: int, seq_len: int,
                           tp: int = 1, sp: bool = False, cp: int = 1,
                           lora: tuple[int, tuple[str, ...]] | None = None,
                           recomputed: tuple[str, ...] = (), dense_window: bool = False
                           ) -> dict[str, float]:
    """Bytes one block keeps for backward for one micro-batch, by tensor name.
    ``seq_len`` is the full sequence; each cp rank holds seq_len / cp tokens.
    ``lora``: (rank, adapted paths) of a frozen base (:func:`layer_terms`).
    ``recomputed``: block matmuls (``wq`` ... ``w3``) whose outputs a selective
    policy re-runs instead of keeping (another stack's policy; this engine's
    keeps them all). ``dense_window``: a sliding window runs as SDPA with a dense band (the
    CPU, unless the sequence is long enough for the blocked kernel,
    :func:`dense_band`), which turns the boolean band into a [s, s] additive
    mask in the compute dtype and keeps it (one per block, broadcast over
    the batch)."""
    key = (_model_key(m), m.dropout, precision, mode, micro_batch, seq_len, tp, sp, cp, lora,
           recomputed, dense_window)
    if key not in _ACTS:
        _ACTS[key] = _layer_activation_bytes(m, precision, mode, micro_batch, seq_len, tp, sp,
                                             cp, lora, recomputed)
        if dense_window and mode == "none" and dense_band(m, seq_len) and cp == 1:
            _ACTS[key]["attention.window_mask"] = DTYPE_BYTES[precision] * seq_len ** 2
    return dict(_ACTS[key])


def windowed(m, seq_len: int) -> bool:
    """Whether the sliding window is shorter than the sequence (else plain causal)."""
    return m.sliding_window is not None and m.sliding_window < seq_len


def dense_band(m, seq_len: int) -> bool:
    """Whether the CPU runs the window as SDPA with a dense [s, s] band:
    windowed, but too short for the blocked kernel, which saves only what
    full attention saves and caches masks of a block's size."""
    return windowed(m, seq_len) and not banded_cpu(seq_len, m.sliding_window)


def _matmul_output(name: str) -> str:
    """The saved-tensor name of a block matmul's output (``wk`` -> attention.wk_out)."""
    return f"{'attention' if name in ('wq', 'wk', 'wv', 'wo') else 'feed_forward'}.{name}_out"


def _layer_activation_bytes(m, precision, mode, micro_batch, seq_len, tp, sp, cp, lora,
                            recomputed=()):
    tokens = micro_batch * seq_len / cp
    terms = layer_terms(m, precision, lora)
    # the residual stream is in the compute dtype (a bf16 frozen base's too)
    block_input = Term("block.input", DTYPE_BYTES[precision] * m.hidden_size, "seq")
    if mode == "full":  # the checkpoint keeps the block input (the residual)
        return {"block.input": term_bytes(block_input, tokens, tp, sp, cp)}
    if mode == "selective":
        dropped = {_matmul_output(n) for n in recomputed}
        terms = [block_input] + [t for t in selective_terms(m, precision, tp, sp, cp)
                                 if t.name not in dropped and t.name != "block.input"]
    out = {t.name: term_bytes(t, tokens, tp, sp, cp) for t in terms}
    if cp > 1 and mode == "none":
        out.update(cp_none_terms(m, precision, micro_batch, seq_len, tp, cp, lora))
    return out


def edge_activation_bytes(m, precision: str, micro_batch: int, seq_len: int, tp: int, sp: bool,
                          cp: int, first: bool, last: bool,
                          frozen: bool = False, loss_impl: str = "plain") -> dict[str, float]:
    """Embedding (first stage) and final norm + head + loss (last stage) tensors
    kept for backward for one micro-batch; logits are vocab-parallel under tp.
    ``frozen`` (LoRA): the final RMSNorm and the head keep nothing for their
    weights' gradients. ``loss_impl``: the resolved train.loss_impl
    (:func:`giantmodel.planner.head.head_loss_impl`)."""
    tokens = micro_batch * seq_len / cp
    h = m.hidden_size
    out = {}
    if first:
        out["embedding.ids"] = tokens * 8
        if m.arch == "llama":  # the RoPE rows for this sequence, shared by all layers
            out["rope_table"] = seq_len / cp * m.dim_per_head * 4
    if last:
        seq_div = tp if sp else 1
        # the norm keeps the compute-dtype residual and an fp32 rstd (and mean)
        norm = DTYPE_BYTES[precision] * h + (4 if m.arch == "llama" else 8)
        out["final_norm"] = tokens * norm / seq_div
        out.update(head_edge_bytes(m, precision, tokens, tp, frozen, loss_impl))
    return out


def loss_transient_bytes(m, precision: str, micro_batch: int, seq_len: int, tp: int,
                         cp: int, loss_impl: str = "plain", frozen: bool = False) -> float:
    """Extra bytes while the loss runs (:func:`giantmodel.planner.head.head_transient_bytes`)."""
    return head_transient_bytes(m, precision, micro_batch * seq_len / cp, tp, frozen, loss_impl)


# --------------------------------------------------------- in-flight counts
def inflight_microbatches(layout: Layout, pp_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in
    units of one micro-batch through all of that rank's layers."""
    pp, m, v = layout.pp, layout.n_micro, layout.virtual
    if pp == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved_1f1b" and v > 1:
        # Megatron's warm-up: (pp - r - 1) * 2 + (v - 1) * pp chunks, plus the one running
        chunks = min(m * v, (pp - pp_rank - 1) * 2 + (v - 1) * pp + 1)
        return chunks / v
    if layout.schedule == "zbv":
        return float(min(m, pp))  # the V layout balances memory across ranks
    return float(min(m, pp - pp_rank))


# ------------------------------------------------------------------ report
def on_accelerator(hw) -> bool:
    """Whether ``hw`` (None: the planner's default GPU) is an accelerator,
    whose copy and communication engines run beside compute; a CPU 'device'
    runs them on the ranks' own cores."""
    return hw is None or hw.intra_link != "shm"


def offloads_to_host(hw) -> bool:
    """Activation offload moves tensors only off an accelerator: on a CPU
    'device' they already live in host memory and stay where they are."""
    return on_accelerator(hw)


def offload_resident_bytes(rank_bytes: float, n_layers: int, prefetch_layers: int) -> float:
    """Device bytes of offloaded activations at the peak, per
    giantmodel.parallel.offload as it is: forward keeps nothing on the device,
    but backward keeps every block's fetched copy until the micro-batch's
    backward ends, so the micro-batch in backward comes back whole (the others
    in flight stay on the host). When offload frees each block's copies after
    its backward, this becomes about ``prefetch_layers + 1`` blocks."""
    del prefetch_layers   # not yet a bound: copies are kept to the end of backward
    return rank_bytes


@dataclass
class RankMemory:
    pp_rank: int
    components: dict[str, float]
    per_layer: dict[str, float]
    """Bytes one layer keeps for one micro-batch, by saved tensor."""
    layers: int
    inflight: float

    @property
    def peak(self) -> float:
        return sum(v for k, v in self.components.items()
                   if k not in ("fragmentation", "reserved"))

    @property
    def required(self) -> float:
        return sum(self.components.values())


@dataclass
class MemoryReport:
    ranks: list[RankMemory] = field(default_factory=list)
    capacity: float = 0.0

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.required)

    @property
    def peak_bytes_per_rank(self) -> float:
        return max(r.peak for r in self.ranks)

    @property
    def required_bytes_per_rank(self) -> float:
        return self.worst.required

    @property
    def fits(self) -> bool:
        return self.required_bytes_per_rank <= self.capacity


_STATES: dict[tuple, tuple[dict[str, int], int]] = {}

def lora_layer_shapes(table: ParamTable, layout: Layout) -> list[tuple[int, ...]]:
    """Local shapes of one block's adapters: A [r, in], B [out, r]; tensor
    parallelism splits B with a column-parallel base and A with a row-parallel one."""
    r, tp = layout.lora_rank, layout.tp
    shapes = []
    for path in layout.lora_paths:
        out, inp = next(p.shape for p in table.layer if p.name == f"{path}.weight")
        if _tp_dim(f"{path}.weight") == 0:
            shapes += [(r, inp), (out // tp, r)]
        else:
            shapes += [(r, inp // tp), (out, r)]
    return shapes


def _lora_states(table: ParamTable, layout: Layout, stages: tuple[int, ...], n_layers: int,
                 shard_degree: int, style: str, strategy: str, m=None) -> dict[str, float]:
    """LoRA: the frozen base holds parameters only -- own ZeRO leaves it out
    of its flat buffers, FSDP2 shards it like any parameter -- in the dtypes
    the objective keeps (:mod:`giantmodel.planner.frozen`: bf16 under bf16,
    NF4 when quantised); the adapters hold parameters, gradients and
    optimizer state."""
    adapters = lora_layer_shapes(table, layout) * n_layers
    states = model_state_bytes(adapters, layout.zero, shard_degree, style, 0,
                               strategy=strategy, bucket_mb=layout.bucket_mb)
    states["params"] = states["params"] + lora_frozen_bytes(table, layout, stages, style,
                                                            strategy, m)
    return states


def _lora_sharded(layout: Layout, style: str, strategy: str) -> bool:
    """Whether FSDP2 shards the frozen base (its parameters are DTensors)."""
    shard_degree = layout.dp_shard * layout.cp
    return shard_degree > 1 and (layout.zero >= 3 if style == "mixed" else strategy == "fsdp")


def lora_frozen_bytes(table: ParamTable, layout: Layout, stages: tuple[int, ...],
                      style: str = "autocast", strategy: str = "own", m=None) -> float:
    """Bytes of a LoRA model's frozen base on the pipeline rank holding
    ``stages`` (``m``: the model, whose stages may mix dense and MoE blocks)."""
    sharded = _lora_sharded(layout, style, strategy)
    degree = layout.dp_shard * layout.cp

    def numel(p: Param) -> int:
        shape = p.local_shape(layout.tp)
        return shard_numel(shape, degree) if sharded else math.prod(shape)

    named = [pb for s in stages for pb in stage_param_list(table, s, layout.num_stages,
                                                           layout.stage_layers[s], m,
                                                           layout.stage_layers)]
    return frozen_param_bytes([p for p, _ in named], [b for _, b in named], layout,
                              StateBytes.for_style(style).param, sharded, numel)


def _rank_states(m, table: ParamTable, layout: Layout, stages: tuple[int, ...],
                 style: str, hw=None) -> tuple[dict[str, int], int]:
    """Model-state bytes and unsharded local parameter count of one pipeline
    rank (cached: they do not depend on batch shape or recompute)."""
    ns = layout.num_stages
    shard_degree = layout.dp_shard * layout.cp
    key = (_model_key(m), stages, tuple(layout.stage_layers[s] for s in stages), ns, layout.tp,
           layout.zero, shard_degree, style, layout.dp_replicate, layout.pp, layout.bucket_mb,
           layout.ep,
           layout.lora_rank, layout.lora_paths, layout.lora_nf4, on_accelerator(hw),
           # a frozen base's dtypes (giantmodel.planner.frozen)
           (layout.precision, layout.sp) if layout.lora_rank else None,
           # which of a stage's blocks are dense depends on where it starts
           tuple(layout.stage_layers) if m.moe is not None else None)
    if key not in _STATES:
        shapes: list[tuple[int, ...]] = []
        experts: list[tuple[int, ...]] = []
        for s in stages:
            # each stage's own blocks: dense ones where an MoE model keeps them
            shapes += stage_params(table, s, ns, layout.stage_layers[s], layout.tp,
                                   experts=False, m=m, stage_layers=layout.stage_layers)
            experts += stage_params(table, s, ns, layout.stage_layers[s], layout.tp, layout.ep,
                                    experts=True, m=m, stage_layers=layout.stage_layers)
        strategy = layout_strategy(table, layout, hw)
        if layout.lora_rank:
            n_layers = sum(layout.stage_layers[s] for s in stages)
            states = _lora_states(table, layout, stages, n_layers, shard_degree, style,
                                  strategy, m)
            shapes += experts
        else:
            states = model_state_bytes(shapes, layout.zero, shard_degree, style, 0,
                                       strategy=strategy, bucket_mb=layout.bucket_mb)
            if experts:
                # each rank's ep shard, its states sharded over the edp ranks holding it
                own = model_state_bytes(experts, layout.zero, max(1, shard_degree // layout.ep),
                                        style, 0, strategy=strategy, bucket_mb=layout.bucket_mb)
                states = {k: states[k] + own[k] for k in states}
            shapes += experts
            if strategy == "fsdp" and layout.pp > 1:
                # torch's pipeline schedules turn FSDP2's gradient sync off
                # until the last micro-batch: each unit accumulates unsharded
                # gradients (fp32, the reduce dtype) through the whole step
                states["grads"] = 4 * sum(math.prod(s) for s in shapes)
        _STATES[key] = (states, sum(math.prod(s) for s in shapes))
    states, full = _STATES[key]
    return dict(states), full


def layout_strategy(table: ParamTable, layout: Layout, hw=None) -> str:
    """The engine's data-parallel strategy for ``layout`` on ``hw`` (None: a
    GPU) (:func:`giantmodel.parallel.strategy.strategy_name`, with the largest
    padding and first bucket any pipeline rank's flat buffers would have: the
    engine takes the maximum over ranks, so that every stage shards alike).
    A frozen base (LoRA) keeps the flat buffers, as in the engine."""
    pad, first = own_buffer_geometry(table, layout)
    return strategy_name(zero=layout.zero, dp_cp=layout.dp * layout.cp,
                         hybrid=layout.dp_replicate > 1, pp=layout.pp, padding=pad,
                         first_bucket=first, comm_overlaps=on_accelerator(hw))


def own_buffer_geometry(table: ParamTable, layout: Layout) -> tuple[float, float]:
    """(padding, share of the gradients in the first bucket) of zero 1/2's
    flat buffers (each stage's blocks as their kind, in order), the largest
    over the pipeline ranks
    (:func:`giantmodel.parallel.flat_buffer.padding_and_first_bucket`); (0, 0)
    for zero 0, one data-parallel rank or a frozen base."""
    n = layout.dp * layout.cp
    pad = first = 0.0
    if layout.zero in (1, 2) and n > 1 and not layout.lora_rank:
        bucket = int(layout.bucket_mb * MIB) // 4
        for r in range(layout.pp):
            sizes = tuple(math.prod(shape) for s in layout.rank_stages(r)
                          for shape in stage_params(table, s, layout.num_stages,
                                                    layout.stage_layers[s], layout.tp,
                                                    layout.ep, stage_layers=layout.stage_layers))
            p, f = _geometry(sizes, n, bucket)
            pad, first = max(pad, p), max(first, f)
    return pad, first


@functools.lru_cache(maxsize=4096)
def _geometry(sizes: tuple[int, ...], owners: int, bucket_numel: int) -> tuple[float, float]:
    # a search asks for the same stage at the same degree many times
    return padding_and_first_bucket(list(sizes), owners=owners, bucket_numel=bucket_numel)


def block_local_numel(table: ParamTable, layout: Layout, sparse: bool) -> int:
    """Local (post-tp, post-ep) parameters of one block of a kind: the MoE
    block's (E / ep experts) or, for a dense block of an MoE model, the
    dense block's (``ParamTable.dense_layer``); ``table``: the model's."""
    if sparse or not table.dense_layer:
        return table.layer_numel(layout.tp, layout.ep)
    return table.dense_layer_numel(layout.tp)


def rank_block_activations(m, layout: Layout, kinds: dict[tuple[bool, str], int], hw,
                           recomputed: tuple[str, ...] = ()
                           ) -> dict[tuple[bool, str], dict[str, float]]:
    """Bytes one block keeps for one micro-batch, by saved tensor, for each
    (MoE or not, recompute mode) of a rank's blocks (``kinds``:
    :func:`giantmodel.planner.moe.rank_block_kinds`), and for each of its
    kinds under no recompute and the layout's mode (the transient and the
    reported per-layer figures read those). A dense block of an MoE model
    keeps the dense FFN's tensors, an MoE block the router's, the
    dispatch's and the experts'."""
    b, s = layout.micro_batch, layout.seq_len
    lora = (layout.lora_rank, layout.lora_paths) if layout.lora_rank else None
    modes = {md for _, md in kinds} | {"none", layout.recompute}
    out = {}
    for sparse in block_sparsity(kinds, m):
        cfg = block_config(m, sparse)
        for mode in modes:
            acts = layer_activation_bytes(cfg, layout.precision, mode, b, s, layout.tp,
                                          layout.sp, layout.cp, lora, recomputed,
                                          not on_accelerator(hw))
            if mode == "none" and layout.cp == 1:
                # Gemma 2's capped scores on the math path (no recompute keeps them)
                capped = softcap_score_bytes(cfg, layout.precision, b, s, layout.tp,
                                             on_accelerator(hw))
                acts.update({k: v for k, v in capped.items() if k not in acts})
            out[sparse, mode] = acts
    return out


def _block_weight_copies(m, table: ParamTable, layout: Layout, kinds: dict[tuple[bool, str], int],
                         hw, style: str, local_full: int, head_copy: bool) -> float:
    """Working weights of one pipeline rank: autocast keeps a low-precision
    copy of each linear weight until backward (zero 0/1; not for blocks a
    full recompute re-runs), each block its own kind's (a dense block its
    dense FFN, an MoE block its local experts); FSDP2 keeps unsharded
    params from forward to backward under zero 2, and prefetches about two
    blocks under zero 3, the largest the rank holds."""
    c = DTYPE_BYTES[layout.precision]
    if layout.zero == 3:
        kept, every = zero3_kept_numel(m, layout)
        largest = max(block_local_numel(table, layout, sp) for sp in block_sparsity(kinds, m))
        # kept blocks are all gathered when backward starts; the others are
        # gathered about two at a time (prefetch)
        return kept * c + (0 if every else 2 * largest * c)
    if layout.zero == 2:
        return local_full * c
    if c < 4 and layout.lora_rank:
        return _lora_weight_copies(m, table, layout, kinds, head_copy, style, hw) * c
    if c < 4:
        head = table.head_linear_numel(layout.tp) if head_copy else 0
        return head * c + sum(
            k * layer_weight_copies(block_config(m, sparse), layout.precision, layout.tp, mode,
                                    layout.ep, layout.weight_cast == "step")
            for (sparse, mode), k in kinds.items())
    return 0


def rank_memory(m, layout: Layout, pp_rank: int, hw, style: str = "autocast",
                prefetch_layers: int = 1, recomputed: tuple[str, ...] = ()) -> RankMemory:
    table = param_table(m)
    stages = layout.rank_stages(pp_rank)
    ns = layout.num_stages
    states, local_full = _rank_states(m, table, layout, tuple(stages), style, hw)
    comp: dict[str, float] = dict(states)
    n_layers = sum(layout.stage_layers[st] for st in stages)
    # each block charged as its kind: dense or MoE (giantmodel.planner.moe)
    kinds = rank_block_kinds(m, layout, pp_rank)
    present = block_sparsity(kinds, m)
    loss_impl = head_loss_impl(layout, hw)
    head_copy = ns - 1 in stages and head_weight_copy(loss_impl)
    comp["working_weights"] = _block_weight_copies(m, table, layout, kinds, hw, style,
                                                   local_full, head_copy)
    if layout.zero >= 2:
        # unsharded grads of one block before reduce-scatter, the largest the
        # rank holds (only the adapters' under LoRA)
        trained = (sum(math.prod(s) for s in lora_layer_shapes(table, layout))
                   if layout.lora_rank else max(block_local_numel(table, layout, sp)
                                                for sp in present))
        comp["comm_buffers"] = 2 * trained * 4
    else:
        comp["comm_buffers"] = min(2 * layout.bucket_mb * MIB, comp["grads"])
    b, s = layout.micro_batch, layout.seq_len
    by_kind = rank_block_activations(m, layout, kinds, hw, recomputed)

    def total(sparse: bool, mode: str) -> float:
        return sum(by_kind[sparse, mode].values())

    # the rank's heaviest block stands for "one layer" in reports
    per_layer = by_kind[max(sorted(present), key=lambda sp: total(sp, layout.recompute)),
                        layout.recompute]
    inflight = inflight_microbatches(layout, pp_rank)
    rank_bytes = sum(k * total(*kind) for kind, k in kinds.items())
    if layout.offload_activations and offloads_to_host(hw):
        acts = offload_resident_bytes(rank_bytes, n_layers, prefetch_layers)
    else:
        acts = rank_bytes * inflight
    edges = edge_activation_bytes(m, layout.precision, b, s, layout.tp, layout.sp, layout.cp,
                                  first=0 in stages, last=ns - 1 in stages,
                                  frozen=bool(layout.lora_rank), loss_impl=loss_impl)
    edge_inflight = {k: v * (inflight if k == "embedding.ids" else 1.0) for k, v in edges.items()}
    if not on_accelerator(hw) and dense_band(m, s) and n_layers:
        # the boolean band the CPU path builds once per shape and caches
        edge_inflight["attention.window_band"] = float(s * s)
    comp["activations"] = acts
    comp["embedding_head_activations"] = sum(edge_inflight.values())
    # one block re-run during backward (full), or what the selective policy
    # re-creates for one block: the largest such block of the rank
    transient = max([total(sp, "none") for sp, md in kinds if md == "full"]
                    + [total(sp, "none") - total(sp, "selective")
                       for sp, md in kinds if md == "selective"], default=0.0)
    if ns - 1 in stages:
        transient = max(transient, loss_transient_bytes(m, layout.precision, b, s, layout.tp,
                                                        layout.cp, loss_impl,
                                                        bool(layout.lora_rank)))
    comp["backward_transient"] = transient
    if layout.n_micro == 1 and layout.pp == 1:
        # No gradient accumulation: the step frees gradients (set_to_none), so
        # backward allocates them while it frees activations; the two peaks
        # do not add up.
        comp["grads_not_yet_allocated"] = -min(
            comp["grads"], acts + comp["embedding_head_activations"] + transient)
    comp["optimizer_step"] = optimizer_step_bytes(layout, hw, comp, style)
    comp["fragmentation"] = FRAGMENTATION * (acts + comp["embedding_head_activations"] + transient
                                             + comp["working_weights"] + comp["comm_buffers"])
    comp["reserved"] = hw.reserved_bytes if hw is not None else 0.0
    return RankMemory(pp_rank, comp, per_layer, n_layers, inflight)


def layer_weight_copies(m, precision: str, tp: int, mode: str, ep: int = 1,
                        keep_casts: bool = True) -> float:
    """Bytes of compute-dtype weight copies one block holds through a step
    (zero 0/1, no LoRA): the fused path's casts, kept once per step whatever
    the recompute mode (``keep_casts``, train.weight_cast=step; none with
    use), and autocast's copies of the other linears, kept until backward
    by a block that does not recompute."""
    c = DTYPE_BYTES[precision]
    if c == 4:
        return 0.0
    table = param_table(m)
    fused = cast_weight_numel(m, table, tp)
    rest = table.layer_linear_numel(tp, ep) - fused if mode == "none" else 0
    return float(c * ((fused if keep_casts else 0) + rest))


def cast_weight_numel(m, table: ParamTable, tp: int) -> int:
    """Elements, per block on a rank, of the linear weights whose
    compute-dtype casts the fused path keeps from one optimizer step to the
    next (giantmodel.models.common.fused.cast_weight): attention's q, k, v
    and o, and a gated MLP's gate, up and down, with or without tensor
    parallelism (giantmodel.parallel.sp_linear). MLA, routed experts and
    GPT's MLP run their own linears: autocast casts those per call."""
    paths = set()
    if m.mla is None:
        paths |= {"attention.wq", "attention.wk", "attention.wv", "attention.wo"}
    if m.arch == "llama" and m.moe is None:
        paths |= {"feed_forward.w1", "feed_forward.w3", "feed_forward.w2"}
    return sum(math.prod(p.local_shape(tp)) for p in table.layer
               if p.name.endswith(".weight") and p.name.rpartition(".")[0] in paths)


def _lora_weight_copies(m, table: ParamTable, layout: Layout,
                        kinds: dict[tuple[bool, str], int], last: bool, style: str, hw) -> int:
    """Compute-dtype weight copies a LoRA model (zero 0/1) holds through
    backward, in elements: every adapter weight (trainable fp32 leaves:
    autocast casts each once per forward and caches it) and the frozen
    linears autocast casts at each call, of the blocks that do not
    recompute; the casts the fused path keeps for the step, of every block;
    the head where it is a DTensor or was not cast
    (:func:`giantmodel.planner.frozen.base_copy_numel`). ``kinds``: the
    rank's blocks by (MoE or not, recompute mode), each its kind's base."""
    sharded = _lora_sharded(layout, style, layout_strategy(table, layout, hw))
    adapters = sum(math.prod(s) for s in lora_layer_shapes(table, layout))
    out = 0
    for (sparse, mode), k in kinds.items():
        cfg = block_config(m, sparse)
        per_use, per_step = base_copy_numel(cfg, param_table(cfg).layer, layout, sharded)
        out += k * (per_step + (adapters + per_use if mode == "none" else 0))
    if last and (layout.tp > 1 or not bf16_residual(layout, sharded)):
        out += table.head_linear_numel(layout.tp)
    return out


def optimizer_step_bytes(layout: Layout, hw, comp: dict[str, float], style: str) -> float:
    """What the optimizer step needs beyond the backward peak. Multi-tensor
    (foreach) AdamW builds sqrt(v) for all of a group's parameters at once:
    4 bytes per element it updates, allocated after backward has freed the
    activations and autocast's weight copies. The fused kernel (``auto`` on
    CUDA and CPU) needs none."""
    if layout.optim_impl != "foreach":
        return 0.0
    temp = 4 * comp["optimizer"] / StateBytes.for_style(style).optim
    freed = (comp["working_weights"] + comp["activations"] + comp["embedding_head_activations"]
             + comp["backward_transient"] + comp.get("grads_not_yet_allocated", 0.0))
    return max(0.0, temp - freed)


def zero3_kept_numel(m, layout: Layout) -> tuple[float, bool]:
    """(elements a zero 3 rank keeps gathered from forward to backward, whether that is
    every unit): the engine's rule (:func:`giantmodel.parallel.fsdp.kept_gathered`)
    applied to this rank's shards; nothing under pipeline parallelism."""
    if layout.zero != 3 or layout.pp > 1 or not layout.keep_gathered_numel:
        return 0.0, False
    table = param_table(m)
    # each block its own kind's shard, in model order (dense blocks of an MoE model as dense)
    sparse = [is_moe_block(m, i) for i in range(m.num_layers)]
    size = {sp: block_local_numel(table, layout, sp) for sp in set(sparse)}
    blocks = [size[sp] for sp in sparse]
    edges = sum(math.prod(p.local_shape(layout.tp)) for p in table.embed + table.head + table.final)
    keep, keep_edges = kept_gathered(blocks, edges, layout.keep_gathered_numel)
    kept = sum(n for n, k in zip(blocks, keep) if k) + (edges if keep_edges else 0)
    return float(kept), keep_edges


def memory_report(m, layout: Layout, hw, style: str = "autocast",
                  recomputed: tuple[str, ...] = ()) -> MemoryReport:
    """Every pipeline rank's peak; ``recomputed`` as in :func:`layer_activation_bytes`."""
    ranks = [rank_memory(m, layout, r, hw, style, recomputed=recomputed)
             for r in range(layout.pp)]
    return MemoryReport(ranks, hw.memory_bytes if hw is not None else float("inf"))
