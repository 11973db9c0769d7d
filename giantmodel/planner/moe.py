"""Mixture-of-Experts and multi-head latent attention in the cost models.

What an MoE block changes, per rank, as giantmodel.models.common.moe and
giantmodel.parallel.expert run it:

* parameters: the routed experts (``feed_forward.experts.w1/w3/w2``, stacked
  ``[E, in, out]``) are split over ``ep`` on dim 0 and not by tp; their
  gradients and optimizer states are sharded like the ZeRO stage over the
  (dp x cp) / ep ranks that hold the same experts (``edp``); everything
  else as a dense block;
* total against active parameters: a token runs ``top_k`` of the E routed
  experts plus the shared experts, so the model FLOPs (and MFU, as
  Megatron-Core counts it) use 6 x the active parameters plus attention;
* activations (:func:`giantmodel.planner.terms.moe_ffn_terms`): the router's
  fp32 copy of its input and its scores ([N, E]), the routing ids, weights
  and sort indices, the dispatched token copies ([N k, h]), each expert's
  SwiGLU intermediates for the rows it receives, the combine's [N, k, h]
  expert outputs. Dropless routing is costed at balanced loads, so each
  rank's experts receive N k rows whatever ep is (N tokens on each of the
  ep ranks, k / ep of each to every rank); a capacity factor below 1 caps
  them at capacity_factor x N k;
* time: the routed experts run as grouped GEMMs of N k / E' rows per expert
  (E' = E / ep experts receiving ep x N k / E rows each) at
  ``grouped_gemm_efficiency``; the dispatch and combine all-to-alls move each
  routed row out and back (2 in forward, 2 in backward) over the links the ep
  group spans.

* gradient sync: the routed experts' gradients are reduced over the ranks
  that hold the same experts (``edp``: dp x cp / ep ranks, ep x tp apart,
  as ``ParallelDims``' expert mesh lays them out), the other parameters'
  over dp x cp (:func:`grad_sync_groups`).

Pipeline stages hold the blocks the model has in their layer range, dense
or MoE (:func:`stage_block_counts`, :func:`stage_block_params`, equal to the
stage the trainer builds), and every per-block term is charged per block
kind (:func:`rank_block_kinds`, :func:`block_config`): a rank holding k
dense and j MoE blocks keeps k dense blocks' activations (the dense FFN's
saved tensors) and j MoE blocks' (the router, dispatch and expert terms
above), the dense block's weight casts and the MoE block's local ones, and
under ZeRO-2/3 gathered-parameter and reduce buffers sized by the largest
block on that rank; the expert GEMMs and the dispatch/combine all-to-all
are timed for its MoE blocks only, its dense blocks as a dense model's.
DeepSeek-V3's first three blocks (``first_k_dense``) and Qwen3-MoE's
``mlp_only_layers`` / ``decoder_sparse_step`` are costed so.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

from giantmodel.planner.terms import DTYPE_BYTES, routed_rows_per_token

EXPERT_LEAVES = ("experts.w1", "experts.w2", "experts.w3")


def is_expert(name: str) -> bool:
    """Whether a parameter name is a routed expert's stacked weight (split over ep)."""
    return name.endswith(EXPERT_LEAVES)


def sparse_layer_config(m):
    """``m`` with every layer an MoE layer (to build one MoE block on meta)."""
    one = copy.deepcopy(m)
    one.moe.first_k_dense, one.moe.dense_layers, one.moe.sparse_step = 0, [], 1
    return one


def dense_layer_config(m):
    """``m`` with every feed-forward dense (the blocks an MoE model keeps dense)."""
    one = copy.copy(m)
    one.moe = None
    return one


def layer_counts(m) -> tuple[int, int]:
    """(dense blocks, MoE blocks) of the model."""
    if m.moe is None:
        return m.num_layers, 0
    sparse = len(m.moe.sparse_layers(m.num_layers))
    return m.num_layers - sparse, sparse


def expert_numel(m) -> int:
    """Parameters of one routed expert (a SwiGLU of expert_ffn_hidden_size)."""
    return 3 * m.hidden_size * m.moe.expert_width(m.ffn_hidden_size)


def inactive_params(m) -> int:
    """Routed-expert parameters a token does not use: (E - top_k) experts per MoE block."""
    if m.moe is None:
        return 0
    return layer_counts(m)[1] * (m.moe.num_experts - m.moe.top_k) * expert_numel(m)


def stage_block_counts(m, stage_layers: Sequence[int], stage: int) -> tuple[int, int]:
    """(dense, MoE) blocks of pipeline stage ``stage``, the stages holding
    ``stage_layers[s]`` consecutive blocks each, in order."""
    start = sum(stage_layers[:stage])
    blocks = range(start, start + stage_layers[stage])
    if m.moe is None:
        return len(blocks), 0
    sparse = sum(1 for i in blocks if m.moe.is_sparse(i))
    return len(blocks) - sparse, sparse


def stage_block_params(table, m, stage_layers: Sequence[int], stage: int) -> list:
    """The block parameters (``table``'s ``Param`` rows) of one pipeline
    stage, block by block in the model's order: the MoE block's
    (``table.layer``) for an MoE block, the dense block's
    (``table.dense_layer``) for a dense one."""
    start = sum(stage_layers[:stage])
    blocks = range(start, start + stage_layers[stage])
    if m.moe is None:
        return [p for _ in blocks for p in table.layer]
    return [p for i in blocks
            for p in (table.layer if m.moe.is_sparse(i) else table.dense_layer)]


def is_moe_block(m, layer: int) -> bool:
    """Whether block ``layer`` of ``m`` has an MoE feed-forward (never in a dense model)."""
    return m.moe is not None and m.moe.is_sparse(layer)


def block_config(m, sparse: bool):
    """The config one block of a kind is costed with: ``m`` for an MoE block
    (and for any block of a dense model), ``m`` with a dense feed-forward
    (:func:`dense_layer_config`: ``ffn_hidden_size`` wide, as the model
    builds it) for a dense block of an MoE model."""
    return m if sparse or m.moe is None else dense_layer_config(m)


def rank_block_kinds(m, layout, pp_rank: int) -> dict[tuple[bool, str], int]:
    """How many of pipeline rank ``pp_rank``'s blocks are of each kind:
    (MoE or not, recompute mode), over every stage the rank runs."""
    stages = layout.rank_stages(pp_rank)
    out: dict[tuple[bool, str], int] = {}
    if layout.recompute_layers is None:   # one mode: count each stage's kinds
        for s in stages:
            for sparse, n in zip((False, True), stage_block_counts(m, layout.stage_layers, s)):
                if n:
                    out[sparse, layout.recompute] = out.get((sparse, layout.recompute), 0) + n
        return out
    starts = [sum(layout.stage_layers[:s]) for s in range(layout.num_stages)]
    blocks = [i for s in stages for i in range(starts[s], starts[s] + layout.stage_layers[s])]
    for i, mode in zip(blocks, layout.layer_modes(pp_rank)):
        kind = (is_moe_block(m, i), mode)
        out[kind] = out.get(kind, 0) + 1
    return out


def block_sparsity(kinds: dict[tuple[bool, str], int], m) -> set[bool]:
    """Which block kinds (MoE or not) ``kinds`` (:func:`rank_block_kinds`)
    holds; a blockless rank answers with the model's kind (MoE for an MoE
    model), so that per-block figures of it stay defined."""
    return {sp for sp, _ in kinds} or {m.moe is not None}


def local_expert_params(m, layout) -> float:
    """Routed-expert parameters on one rank, averaged over the pipeline
    ranks: E / ep experts of each of the rank's MoE blocks."""
    if m.moe is None:
        return 0.0
    return layer_counts(m)[1] / layout.pp * (m.moe.num_experts // layout.ep) * expert_numel(m)


def grad_sync_groups(m, layout, trained: float, shard: int) -> list[tuple[float, int, int]]:
    """(parameters, group size, rank stride) of each gradient reduction of
    one rank: the routed experts over their own data-parallel group (the
    ``shard`` / ep ranks, ep x tp apart, that hold the same experts), the
    rest of the ``trained`` parameters over ``shard`` ranks tp apart.
    ``shard``: the dp x cp (or FSDP's dp_shard x cp) degree; LoRA trains no
    expert (adapters are on attention), so ``trained`` is then all in the
    second group."""
    experts = 0.0 if layout.lora_rank else min(trained, local_expert_params(m, layout))
    groups = [(trained - experts, shard, layout.tp)]
    if experts:
        groups.append((experts, max(1, shard // layout.ep), layout.tp * layout.ep))
    return groups


# -------------------------------------------------------------------- time
def attention_width(m) -> float:
    """Heads x the mean of the query/key and value widths: QK^T contracts over
    the first, AV over the second (equal without MLA)."""
    if m.mla is None:
        return m.num_heads * m.dim_per_head
    return m.num_heads * (m.mla.qk_head_dim + m.mla.v_head_dim) / 2


def mla_matmul_shapes(m) -> dict[str, tuple[float, float]]:
    """(k, n) of each MLA projection."""
    a, h, heads = m.mla, m.hidden_size, m.num_heads
    q_out = heads * a.qk_head_dim
    if a.q_lora_rank is None:
        shapes = {"wq": (h, q_out)}
    else:
        shapes = {"wq_a": (h, a.q_lora_rank), "wq_b": (a.q_lora_rank, q_out)}
    shapes.update({"wkv_a": (h, a.kv_lora_rank + a.qk_rope_head_dim),
                   "wkv_b": (a.kv_lora_rank, heads * (a.qk_nope_head_dim + a.v_head_dim)),
                   "wo": (heads * a.v_head_dim, h)})
    return shapes


def shared_matmul_shapes(m, t: int) -> dict[str, tuple[float, float]]:
    """(k, n) of the shared experts' SwiGLU on one tp rank: whole, whatever
    ``t`` (parallel.tensor does not split an MoE layer: every tp rank runs
    it on the whole, identical tokens)."""
    moe, h = m.moe, m.hidden_size
    if not moe.num_shared_experts:
        return {}
    fs = moe.shared_width(m.ffn_hidden_size)
    return {"w1": (h, fs), "w3": (h, fs), "w2": (fs, h)}


def grouped_gemm_time(hw, precision: str, rows_per_expert: float, experts: int,
                      k: float, n: float) -> float:
    """One grouped GEMM over ``experts`` problems of (rows_per_expert x k) @ (k x n).

    ``hw.grouped_gemm_efficiency`` stands for the large-problem share of peak
    (below dense GEMM's: one kernel schedules many problems, each expert's
    rows are padded to the 16-byte alignment torch._grouped_mm needs, and the
    per-expert problems are too small to keep a tile schedule full); on top of
    it each expert's rows fill 128-row tiles only partly (rows / ceil-to-128)
    and the k loop reaches half rate at ``matmul_k_knee``, as in dense GEMMs."""
    if rows_per_expert <= 0 or experts <= 0:
        return 0.0
    fill = rows_per_expert / (128 * math.ceil(rows_per_expert / 128))
    tiles = experts * math.ceil(rows_per_expert / 128) * math.ceil(n / 128)
    eff = (hw.grouped_gemm_efficiency * fill * tiles / (tiles + hw.matmul_tile_knee)
           * k / (k + hw.matmul_k_knee))
    flops = 2.0 * rows_per_expert * experts * k * n
    c = DTYPE_BYTES[precision]
    nbytes = c * (rows_per_expert * experts * (k + n) + experts * k * n)
    return max(flops / (hw.flops(precision) * eff),
               nbytes / (hw.memory_bw * hw.memory_efficiency))


def expert_gemm_time(m, layout, hw, tokens: float) -> float:
    """Forward time of one MoE block's routed experts on one rank: E / ep
    local experts, each receiving ep x tokens x rows-per-token / E rows."""
    moe, h = m.moe, m.hidden_size
    f = moe.expert_width(m.ffn_hidden_size)
    local = moe.num_experts // layout.ep
    rows = tokens * routed_rows_per_token(m) * layout.ep / moe.num_experts
    prec = layout.precision
    return (2 * grouped_gemm_time(hw, prec, rows, local, h, f)
            + grouped_gemm_time(hw, prec, rows, local, f, h))


def all_to_all_time(hw, cluster, nbytes: float, size: int, stride: int,
                    inter_share: float | None = None) -> float:
    """One all-to-all in which each of ``size`` ranks (``stride`` global ranks
    apart) sends ``nbytes`` spread evenly over the group: (size - 1) / size of
    it leaves the rank; the part bound for other nodes crosses each GPU's own
    NIC, the rest NVLink (or PCIe), both at ``link_efficiency``."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    gpn = cluster.gpus_per_node
    per_node = max(1, min(size, gpn // stride)) if stride < gpn else 1
    intra = nbytes * (per_node - 1) / size / (hw.intra_bw * hw.link_efficiency)
    share = (size - per_node) / size if inter_share is None else inter_share
    inter = nbytes * share / (hw.inter_bw * hw.link_efficiency)
    return max(intra, inter) + (size - 1) * hw.latency_s


def dispatch_combine_time(m, layout, hw, cluster, tokens: float,
                          dispatch_bytes: int | None = None,
                          node_limited: bool = False) -> tuple[float, float]:
    """(forward, backward) all-to-all seconds of one MoE block and micro-batch.
    Dispatch moves each routed row in fp32 (the gathered rows of the fp32
    normed stream, as giantmodel.parallel.expert sends them), combine in the
    compute dtype; backward sends the gradients the reverse ways in the same
    dtypes. The ep group is ep neighbouring dp x cp ranks, tp apart.
    ``dispatch_bytes``: another stack's dispatch dtype (bf16: 2, FP8: 1);
    ``node_limited``: another stack's node-deduplicated dispatch (below)."""
    if layout.ep <= 1:
        return 0.0, 0.0
    rows = tokens * m.moe.top_k
    c = DTYPE_BYTES[layout.precision]
    h = m.hidden_size
    inter = None
    if node_limited:
        # DeepSeek-V3's dispatch: a token crosses the network once per node it is
        # routed to (at most topk_group of them, n_group aligned with nodes), then
        # NVLink within the node: per token topk_group / top_k of its rows, less its own node's
        nodes = max(1, layout.ep * layout.tp // cluster.gpus_per_node)
        reach = min(m.moe.topk_group, nodes)
        inter = reach / m.moe.top_k * (nodes - 1) / nodes if nodes > 1 else 0.0
    one = (all_to_all_time(hw, cluster, rows * h * (dispatch_bytes or 4), layout.ep, layout.tp,
                           inter)
           + all_to_all_time(hw, cluster, rows * h * c, layout.ep, layout.tp, inter))
    return one, one
