"""Throughput model: per op, per layer, per stage, per step.

Every op costs max(FLOPs / achievable rate, bytes / achievable bandwidth);
collectives cost their bus volume over the slowest link they cross, with
hierarchical (intra-node, then inter-node) algorithms when a group spans
nodes. The step is the pipeline schedule over per-micro-batch stage times,
plus the gradient and parameter traffic the engine cannot hide, plus the
optimizer. What overlaps follows the engine (giantmodel.parallel):

* zero 0: gradients live in one flat buffer whose buckets are all-reduced
  from inside the last micro-batch's backward: only what exceeds that
  backward, and the last bucket, are exposed (under pipeline parallelism,
  whose schedules run backward themselves, all of it, after the schedule);
  the first bucket starts once backward has filled it, which under zero 1/2
  (whole parameters balanced over the owners) can be a large share;
* zero 1: the same buckets are reduce-scattered into their owners' shards,
  then the updated parameters are all-gathered once after the optimizer step
  (exposed);
* zero 2: buckets are reduce-scattered inside every micro-batch's backward,
  and the same all-gather follows the step;
* zero 3 / HSDP: FSDP2 with one unit per block and prefetch: per micro-batch
  the first unit's gather is exposed, then communication hides behind compute
  while compute is longer; zero 1/2 go to FSDP2 too where the flat buffers
  would pad, or on GPUs where their first bucket holds most of the gradients
  (``parallel.strategy.strategy_name``), zero 1 syncing once per step.
  Under pipeline parallelism torch's schedules hold FSDP2's reduce-scatters
  until after the last micro-batch: exposed, once per step;
* pipeline: point-to-point activations (the fp32 residual stream) on every
  stage boundary, over NVLink or the network depending on where the next
  stage sits: in series with compute under 1F1B and GPipe, hidden but on the
  fill and drain path under the multi-stage schedules (``p2p_overlapped``);
  the schedule's bubble is counted per stage, so a heavy last stage (the
  head) or first stage costs what it costs and no more;
* what is hidden is not free: a collective beside compute holds its NCCL
  channels' multiprocessors (``collective_sm_share``), so the compute runs
  that much slower while it lasts (:func:`beside_compute`);
* every micro-batch's backward folds its gradients into the step's fp32
  accumulators, a pass over memory (:func:`grad_accumulate_time`).

Model FLOPs (for TFLOP/s and MFU) follow Narayanan et al. 2021, eq. 3, with
the recompute pass left out and generalised to any MLP and attention width:

    F = 6 * B * s * (L * P_matmul + V * h) + 12 * B * s^2 * L * q

(B sequences of s tokens, L layers, P_matmul weights in each layer's
matmuls, V vocabulary, h hidden, q = heads x head_dim). For GPT-3 shapes
(P_matmul = 12h^2, q = h) this is 72*B*s*L*h^2 * (1 + s/(6h) + V/(12hL)).
MFU = F / step time / (GPUs x dense peak of the precision).

LoRA (a frozen base with adapters) computes no weight gradients for the
base: its matmuls cost forward + input gradient (4 FLOPs per weight and
token), its embedding no backward, and only the adapters are reduced across
data-parallel ranks and updated by the optimizer; F counts the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from giantmodel.core.hostmem import MMAP_CEILING_BYTES
from giantmodel.parallel.flat_buffer import layout_sizes
from giantmodel.planner.attention import attention_pairs, attention_time, rank_attention_skew
from giantmodel.planner.layout import Cluster, Layout
from giantmodel.planner.memory import (
    DTYPE_BYTES,
    MIB,
    active_matmul_params,
    block_local_numel,
    layer_activation_bytes,
    layout_strategy,
    lora_layer_shapes,
    offloads_to_host,
    on_accelerator,
    own_buffer_geometry,
    param_table,
    stage_params,
    zero3_kept_numel,
)
from giantmodel.planner.moe import (
    attention_width,
    block_config,
    dispatch_combine_time,
    expert_gemm_time,
    grad_sync_groups,
    layer_counts,
    mla_matmul_shapes,
    rank_block_kinds,
    shared_matmul_shapes,
    stage_block_counts,
)
from giantmodel.planner.roofline import gemm_time, matmul_rate, mem_time  # noqa: F401 (matmul_rate: re-exported)
from giantmodel.planner.terms import (
    family_extra_bytes,
    gated_working_bytes,
    norm_working_bytes,
    sp_recomputed_matmuls,
)


@dataclass
class PerfOptions:
    """Behaviours of the training code that change the step time."""

    flash_bwd_factor: float = 2.5
    """Backward / forward time of fused attention (it recomputes QK^T)."""
    selective_matmuls: tuple[str, ...] = ()
    """Block matmuls (``wq wk wv wo w1 w2 w3``) whose forward a ``selective`` policy
    re-runs in backward. This engine's policy keeps every matmul output (none);
    other stacks differ: torchtitan's op-level policy saves every matmul output
    except every second one (``wk wo w3`` in a LLaMA block), so a plan compared
    with such a run says so here."""
    cp_masked_attention: bool | None = None
    """Whether context-parallel attention runs each local chunk against the keys up to its
    end under an explicit mask, which SDPA cannot skip: a cp rank then computes
    (2cp + 1) / (2cp) of its share of the causal triangle's FLOPs. None follows
    ``parallel/context.py``: masked only with attention dropout; otherwise each chunk is a
    fully visible part and a causal diagonal block on fused kernels, exactly its share."""
    dispatch_bytes: int | None = None
    """Bytes per element of the MoE dispatch all-to-all; None follows ``parallel/expert.py``,
    which sends the fp32 normed rows (Megatron-Core dispatches in bf16, DeepSeek-V3 in FP8)."""
    moe_comm_overlap: bool = False
    """Whether the source's stack runs the dispatch/combine all-to-all beside another
    micro-batch's compute (DeepSeek's DualPipe, Megatron-Core's overlapped EP communication):
    then only what outlasts that compute, and the multiprocessors it holds, cost time. This
    engine runs them in series."""
    node_limited_dispatch: bool = False
    """Whether the source's dispatch sends a token over the network once per node it is routed
    to and forwards it over NVLink there (DeepSeek-V3's node-limited routing, with expert
    groups aligned to nodes); this engine's all-to-all sends every routed row."""
    gemm_speedup: float = 1.0
    """Rate of the block GEMMs (dense and grouped) against the profile's, e.g. 2 for FP8 GEMMs
    on Hopper (twice the bf16 tensor-core peak); attention and memory-bound work unchanged."""


# ----------------------------------------------------------------- ops
def collective_time(hw, cluster: Cluster, kind: str, nbytes: float, size: int,
                    stride: int) -> float:
    """Time of one collective over a group of ``size`` ranks whose members are
    ``stride`` ranks apart. ``nbytes`` is the full (unsharded) buffer. Ring
    bus volumes: all-reduce 2(n-1)/n, all-gather / reduce-scatter (n-1)/n;
    across nodes: intra-node reduce-scatter, inter-node step on 1/k of the
    data per GPU (every GPU drives its own NIC), intra-node all-gather."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    gpn = cluster.gpus_per_node
    per_node = max(1, min(size, gpn // stride)) if stride < gpn else 1
    nodes = -(-size // per_node)
    intra = hw.intra_bw * hw.link_efficiency
    inter = hw.inter_bw * hw.link_efficiency
    if nodes == 1:
        return factor * (size - 1) / size * nbytes / intra + factor * (size - 1) * hw.latency_s
    t = 0.0
    if per_node > 1:
        t += factor * (per_node - 1) / per_node * nbytes / intra
    t += factor * (nodes - 1) / nodes * nbytes / per_node / inter
    return t + factor * (per_node + nodes - 2) * hw.latency_s


def p2p_time(hw, cluster: Cluster, nbytes: float, stride: int) -> float:
    same_node = stride < cluster.gpus_per_node
    bw = (hw.intra_bw if same_node else hw.inter_bw) * hw.link_efficiency
    return nbytes / bw + hw.latency_s


# -------------------------------------------------------------- layers
@dataclass
class LayerTime:
    fwd: float
    bwd: float
    recompute: float
    comm: float
    """Exposed TP/CP collective time included in fwd/bwd/recompute."""

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.recompute


def _tp_cp_comm(m, layout: Layout, hw, cluster: Cluster) -> tuple[float, float, float]:
    """(forward, backward, selective re-run) collective seconds of one block.
    Tensor parallelism: per sub-block (attention, MLP) the row-parallel output
    is all-reduced (reduce-scattered under sp) in the compute dtype; under sp
    the fp32 norm output is all-gathered first. Backward mirrors it with the
    fp32 input gradient. Context parallelism all-gathers K/V (compute dtype)
    and reduce-scatters their gradients."""
    t, cp, c = layout.tp, layout.cp, DTYPE_BYTES[layout.precision]
    tokens = layout.micro_batch * layout.seq_len / cp
    h = m.hidden_size
    kv = m.kv_heads * m.dim_per_head
    fwd = bwd = regather = 0.0
    if t > 1:
        if layout.sp:
            gather_f = collective_time(hw, cluster, "all_gather", tokens * h * 4, t, 1)
            fwd = 2 * (gather_f + collective_time(hw, cluster, "reduce_scatter", tokens * h * c, t, 1))
            bwd = 2 * (collective_time(hw, cluster, "all_gather", tokens * h * c, t, 1)
                       + collective_time(hw, cluster, "reduce_scatter", tokens * h * 4, t, 1))
            regather = 2 * gather_f
        else:
            fwd = 2 * collective_time(hw, cluster, "all_reduce", tokens * h * c, t, 1)
            bwd = 2 * collective_time(hw, cluster, "all_reduce", tokens * h * 4, t, 1)
            regather = fwd   # selective re-runs the all-reduces (full-size results)
    if cp > 1:
        kv_bytes = layout.micro_batch * layout.seq_len * 2 * kv / t * c
        gather = collective_time(hw, cluster, "all_gather", kv_bytes, cp, t)
        fwd += gather
        bwd += collective_time(hw, cluster, "reduce_scatter", kv_bytes, cp, t)
        regather += gather
    return fwd, bwd, regather


def layer_time(m, layout: Layout, hw, cluster: Cluster, opts: PerfOptions,
               mode: str | None = None) -> LayerTime:
    """One block, one micro-batch, under recompute ``mode`` (default: the layout's)."""
    mode = mode or layout.recompute
    t, cp, prec = layout.tp, layout.cp, layout.precision
    tokens = layout.micro_batch * layout.seq_len / cp
    # one GEMM per weight, as the blocks run them (wq, wk and wv apart; w1 and w3 apart)
    gemm = sum(gemm_time(hw, prec, tokens, k, n) for k, n in _block_matmul_shapes(m, t).values())
    if m.moe is not None:   # the routed experts (the router is fp32, in the shapes)
        gemm += expert_gemm_time(m, layout, hw, tokens)
    gemm /= opts.gemm_speedup
    attn, attn_b = attention_time(m, layout, hw, opts)
    acts = layer_activation_bytes(m, prec, "none", layout.micro_batch, layout.seq_len, t,
                                  layout.sp, cp)
    for name, nbytes in family_extra_bytes(m, prec, layout.micro_batch, layout.seq_len, t,
                                           layout.sp, cp, on_accelerator(hw)).items():
        acts.setdefault(name, nbytes)
    # the norms' fp32 working tensors: written in forward, rebuilt in backward, not kept
    acts.update(norm_working_bytes(m, prec, layout.micro_batch, layout.seq_len, t,
                                   layout.sp, cp))
    # and the gated activation's act(gate): written, read by the product, rebuilt in backward
    acts.update(gated_working_bytes(m, prec, layout.micro_batch, layout.seq_len, t,
                                    layout.sp, cp))
    none = sum(acts.values())
    elem = mem_time(hw, 2.0 * none)   # each tensor written once, read once
    comm_f, comm_b, regather = _tp_cp_comm(m, layout, hw, cluster)
    if m.moe is not None:   # dispatch + combine; selective keeps the dispatched rows
        a2a_f, a2a_b = dispatch_combine_time(m, layout, hw, cluster, tokens, opts.dispatch_bytes,
                                             opts.node_limited_dispatch)
        if opts.moe_comm_overlap:   # beside the other micro-batch's block compute
            a2a_f = beside_compute(hw, a2a_f, gemm + attn)
            a2a_b = beside_compute(hw, a2a_b, 2 * gemm + attn_b)
        comm_f, comm_b = comm_f + a2a_f, comm_b + a2a_b
    adapters = _adapter_gemm_time(m, layout, hw, tokens)
    fwd = gemm + adapters + attn + elem + comm_f
    # backward: input and weight gradients; a frozen base (LoRA) needs the
    # input gradients only, its adapters both
    base_bwd = gemm if layout.lora_rank else 2 * gemm
    bwd = base_bwd + 2 * adapters + attn_b + 2 * elem + comm_b
    if mode == "full":
        rec, rec_comm = fwd, comm_f
    elif mode == "selective":
        kept = sum(layer_activation_bytes(m, prec, "selective", layout.micro_batch,
                                          layout.seq_len, t, layout.sp, cp).values())
        rec, rec_comm = mem_time(hw, 2.0 * max(0.0, none - kept)) + regather, regather
        shapes = _block_matmul_shapes(m, t)
        rerun = set(opts.selective_matmuls) | set(sp_recomputed_matmuls(m, t, layout.sp))
        rec += sum(gemm_time(hw, prec, tokens, *shapes[name])
                   for name in sorted(rerun) if name in shapes)
    else:
        rec, rec_comm = 0.0, 0.0
    return LayerTime(fwd, bwd, rec, comm_f + comm_b + rec_comm)


def _adapter_gemm_time(m, layout: Layout, hw, tokens: float) -> float:
    """Forward time of one block's LoRA adapters (A x, then B (A x))."""
    if not layout.lora_rank:
        return 0.0
    shapes = lora_layer_shapes(param_table(m), layout)
    return sum(gemm_time(hw, layout.precision, tokens, a[1], a[0])
               + gemm_time(hw, layout.precision, tokens, b[1], b[0])
               for a, b in zip(shapes[::2], shapes[1::2]))


# DTensor-dispatched aten ops, counted on this engine's TP plan
# (giantmodel.parallel.tensor) with planner.measure.DTensorOpCounter, torch
# 2.13 (tests/test_planner_ranks.py checks them): F.linear on a [B, T, k]
# DTensor runs view, t, mm, _unsafe_view forward and t x4, mm x2, view x2
# backward (12); a bias 10 more (addmm, expand, its gradient's sum, views).
# The input gradients of linears sharing an input (wq wk wv; w1 w3) are
# partial DTensors summed: 2 adds per attention, 1 per SwiGLU. Autocast casts
# each parameter and its gradient (3 ops) and each summed gradient (1).
# Recompute (full or selective) re-runs the forward: 4 ops per linear and 4
# per parameter (6 under autocast). Under sp an RMSNorm on the sequence-
# sharded residual is 24 ops (pow, mean, add, rsqrt, mul x2, gradients), a
# LayerNorm about 4, and the two residual adds run on DTensors (4 with their
# gradients). Every DTensor parameter's gradient costs one op per micro-batch
# (detached when created, added to after).
LINEAR_DTENSOR_OPS = 12
NORM_DTENSOR_OPS = {"llama": 24, "gpt": 4}


def _block_tp_tensors(m) -> tuple[int, int, int]:
    """(linears, their parameters, partial input gradients summed) of one block."""
    if m.arch == "llama":
        return 7, 7, 3
    return 4, 8, 2


# DTensor ops per block, forward + backward, counted on the project's plan
# (tests/test_planner_ranks.py). LLaMA's linears run on local shards
# (giantmodel.parallel.sp_linear): only its sequence-parallel norms and
# residual adds dispatch on DTensors. GPT's MLP keeps the colwise/rowwise
# plan: its two linears and their biases dispatch.
_SP_NORM_OPS = {"llama": (36, 10), "gpt": (54, 10)}       # (ops, extra under autocast)
_SP_RECOMPUTE_OPS = {"llama": (21, 4), "gpt": (43, 8)}
_MLP_PLAN_OPS = (32, 8)
_MLP_RECOMPUTE_OPS = (14, 4)


def block_dtensor_ops(m, tp: int, sp: bool, precision: str, mode: str) -> float:
    """DTensor ops of one block and micro-batch, forward + backward (and the
    forward re-run under recompute), without the per-parameter gradient op
    (:func:`dtensor_params`); 0 at tp 1."""
    if tp <= 1:
        return 0.0
    arch = "llama" if m.arch == "llama" else "gpt"
    cast = int(precision != "fp32")
    recompute = mode in ("full", "selective")
    ops = 0
    if arch == "gpt":
        ops += _MLP_PLAN_OPS[0] + cast * _MLP_PLAN_OPS[1]
        if recompute and not sp:
            ops += _MLP_RECOMPUTE_OPS[0] + cast * _MLP_RECOMPUTE_OPS[1]
    if sp:
        ops += _SP_NORM_OPS[arch][0] + cast * _SP_NORM_OPS[arch][1]
        if recompute:
            ops += _SP_RECOMPUTE_OPS[arch][0] + cast * _SP_RECOMPUTE_OPS[arch][1]
    return float(ops)


def dtensor_ops(m, layout: Layout) -> tuple[float, float]:
    """(embedding, head + final norm + loss) DTensor ops of one micro-batch,
    forward + backward, on a tensor-parallel rank; 0 at tp 1."""
    if layout.tp <= 1:
        return 0.0, 0.0
    head = LINEAR_DTENSOR_OPS + 4   # output head; log-softmax, nll loss and their backward
    if layout.sp:
        head += NORM_DTENSOR_OPS.get(m.arch, NORM_DTENSOR_OPS["llama"])
    return 2.0, float(head)   # embedding lookup and its backward


def dtensor_params(m, layout: Layout, pp_rank: int) -> int:
    """DTensor parameters on one tensor-parallel pipeline rank: every block
    linear (and norm, under sp), the embedding and the head where they live."""
    if layout.tp <= 1:
        return 0
    per_block = _block_tp_tensors(m)[1]
    if layout.sp:
        per_block += 2 * (1 if m.arch == "llama" else 2)
    stages = layout.rank_stages(pp_rank)
    n = sum(layout.layer_mode_counts(pp_rank).values()) * per_block
    n += 1 if 0 in stages else 0
    n += 1 + (1 if layout.sp else 0) if layout.num_stages - 1 in stages else 0
    return n


def edge_fractions(layout: Layout) -> tuple[float, float]:
    """Forward share of the embedding's and of the head's time: a frozen
    (LoRA) embedding has no backward, a frozen head no weight gradient."""
    return (1.0, 0.5) if layout.lora_rank else (1 / 3, 1 / 3)


def _block_matmul_shapes(m, t: int) -> dict[str, tuple[float, float]]:
    """(k, n) of each block matmul on one tensor-parallel rank, by weight name
    (an MoE block's shared experts and router; its routed experts apart,
    :func:`giantmodel.planner.moe.expert_gemm_time`)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    q, kv = m.num_heads * m.dim_per_head, m.kv_heads * m.dim_per_head
    if m.mla is not None:
        shapes = mla_matmul_shapes(m)
    else:
        shapes = {"wq": (h, q / t), "wk": (h, kv / t), "wv": (h, kv / t), "wo": (q / t, h)}
    if m.moe is not None:
        # the router is fp32 and small: costed at the compute dtype's rate with the rest
        return {**shapes, **shared_matmul_shapes(m, t), "router": (h, m.moe.num_experts)}
    shapes.update({"w1": (h, f / t), "w2": (f / t, h)})
    if m.arch == "llama":
        shapes["w3"] = (h, f / t)
    return shapes


def edge_times(m, layout: Layout, hw, cluster: Cluster) -> tuple[float, float]:
    """(embedding, head + loss) forward+backward time per micro-batch."""
    t, prec = layout.tp, layout.precision
    c = DTYPE_BYTES[prec]
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    h, v = m.hidden_size, m.vocab_size
    frozen = bool(layout.lora_rank)
    emb = mem_time(hw, (1 if frozen else 3) * tokens * h * 4)
    if t > 1:  # vocab-parallel embedding: partial rows are all-reduced
        emb += collective_time(hw, cluster, "all_reduce", tokens * h * 4, t, 1)
    head = (2 if frozen else 3) * gemm_time(hw, prec, tokens, h, v / t)
    logits = tokens * v / t
    if hw.loss_elem_s:   # measured (a CPU): the loss per logit, fwd + bwd, fresh buffers included
        head += logits * hw.loss_elem_s
    else:
        head += mem_time(hw, logits * (2 * c + 24))  # logits, fp32 softmax fwd + bwd
    return emb, head


# ---------------------------------------------------------------- step
@dataclass
class PerfReport:
    step_s: float
    tokens_per_sec: float
    tflops_per_gpu: float
    mfu: float
    comm_share: float
    bubble_share: float
    scaling_efficiency: float
    stage_s: list[float] = field(default_factory=list)
    """Forward + backward time per micro-batch of each pipeline rank."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per step by part: compute, bubble, exposed comm, optimizer."""


def model_flops_per_step(m, global_batch: int, seq_len: int) -> float:
    """Model FLOPs of one step: 6 x the matmul weights a token runs through
    (MoE: the active ones, top_k routed experts, shared experts and router,
    as Megatron-Core counts them) plus the head, plus attention."""
    # attention: Narayanan et al.'s 12 s^2 per layer and head width is 24 x
    # the s^2 / 2 causal pairs; a window counts the pairs it scores
    return (6.0 * global_batch * seq_len * (active_matmul_params(m) + m.vocab_size * m.hidden_size)
            + 24.0 * global_batch * attention_pairs(m, seq_len) * m.num_layers
            * attention_width(m))


def lora_flops_per_step(m, layout: Layout, global_batch: int) -> float:
    """What LoRA changes in :func:`model_flops_per_step`: the frozen weights'
    matmuls run forward and input-gradient (4 FLOPs per weight and token, not
    6), the adapters all three."""
    table = param_table(m)
    tokens = global_batch * layout.seq_len
    p_mm = table.layer_linear_numel(1) - _bias_numel(table)
    adapters = sum(math.prod(s) for s in lora_layer_shapes(table, replace(layout, tp=1)))
    return tokens * (-2.0 * (m.num_layers * p_mm + m.vocab_size * m.hidden_size)
                     + 6.0 * m.num_layers * adapters)


def _bias_numel(table) -> int:
    return sum(p.shape[0] for p in table.layer if p.name.endswith("bias")
               and p.name.split(".")[-2] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))


def _fill_drain_divisor(layout: Layout) -> float:
    """How many times shorter than 1F1B's the schedule's fill and drain are:
    interleaving by v virtual stages; ZB-H1 about a third; ZBV about a sixth."""
    if layout.schedule == "interleaved_1f1b":
        return float(layout.virtual)
    if layout.schedule == "zero_bubble":
        return 3.0
    if layout.schedule == "zbv":
        return 6.0
    return 1.0


@dataclass
class StageTime:
    fwd: float
    bwd: float
    """Backward including recompute, per micro-batch."""

    @property
    def total(self) -> float:
        return self.fwd + self.bwd


def stage_times(m, layout: Layout, hw, cluster: Cluster, opts: PerfOptions) -> list[StageTime]:
    """Forward and backward time per micro-batch of each pipeline rank: its
    blocks (each under its own recompute mode), the embedding / head on the
    ranks that hold them, and, where the schedule waits on them, the
    point-to-point transfers of every stage it runs (:func:`hop_time`)."""
    # each block timed as its kind: a dense block of an MoE model runs its
    # dense FFN, no expert GEMMs and no dispatch/combine (giantmodel.planner.moe)
    kinds = [rank_block_kinds(m, layout, r) for r in range(layout.pp)]
    times = {kind: layer_time(block_config(m, kind[0]), layout, hw, cluster, opts, kind[1])
             for rank in kinds for kind in rank}
    emb, head = edge_times(m, layout, hw, cluster)
    hop = 0.0 if p2p_overlapped(layout, hw) else hop_time(m, layout, hw, cluster)
    dt_emb, dt_head = dtensor_ops(m, layout)
    accumulate = grad_accumulate_time(m, layout, hw)
    dt_block = {mode: block_dtensor_ops(m, layout.tp, layout.sp, layout.precision, mode)
                for _, mode in times}
    out = []
    for r in range(layout.pp):
        stages = layout.rank_stages(r)
        f = b = 0.0
        ops = 0.0
        for kind, n in kinds[r].items():
            f += n * times[kind].fwd
            b += n * (times[kind].bwd + times[kind].recompute)
            ops += n * dt_block[kind[1]]
        skew_f, skew_b = rank_attention_skew(m, layout, hw, opts, r)
        f, b = f + skew_f, b + skew_b
        emb_f, head_f = edge_fractions(layout)
        if 0 in stages:
            f += emb * emb_f
            b += emb * (1 - emb_f)
            ops += dt_emb
        if layout.num_stages - 1 in stages:
            f += head * head_f
            b += head * (1 - head_f)
            ops += dt_head
        if layout.pp > 1:
            f += hop * len(stages)
            b += hop * len(stages)
        b += accumulate
        f, b = _with_host_time(hw, f, b, ops * hw.dtensor_op_s)
        out.append(StageTime(f, b))
    return out


def grad_accumulate_time(m, layout: Layout, hw) -> float:
    """Per micro-batch on each rank: folding backward's fresh gradients into the
    step's accumulators, one memory-bound pass over the rank's trained
    parameters. Zero 0/1's flat buffers and FSDP2's unsharded gradients while
    their sync waits for the last micro-batch are fp32 accumulators that
    autograd adds into in place (read both, write one: 12 bytes a parameter);
    zero 2's flat path copies each gradient into its bucket's scratch (8) and
    adds the owner's chunk to its shard; without data parallelism autograd adds
    from the second micro-batch on. FSDP2 reducing every micro-batch copies the
    gradients into its reduce-scatter buffer instead (:func:`_fsdp_exposed`)."""
    n = layout.dp * layout.cp
    strategy = layout_strategy(param_table(m), layout, hw)
    if strategy == "none":
        per = 12.0 * (layout.n_micro - 1) / layout.n_micro
    elif strategy == "own":
        per = 8.0 + 12.0 / n if layout.zero == 2 else 12.0
    elif layout.pp > 1 or layout.zero == 1:
        per = 12.0
    else:
        return 0.0
    trained = _trained_params(m, layout, _local_params(m, layout))
    return per * trained / (hw.memory_bw * hw.stream_efficiency)


def hop_time(m, layout: Layout, hw, cluster: Cluster) -> float:
    """One stage boundary's point-to-point transfer of one micro-batch: the fp32
    residual stream, sequence-sharded under sp, to the next pipeline rank."""
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    return p2p_time(hw, cluster, tokens * m.hidden_size * 4 / (layout.tp if layout.sp else 1),
                    layout.world // layout.pp)


def p2p_overlapped(layout: Layout, hw) -> bool:
    """Whether the schedule hides its stage-to-stage transfers behind compute.
    torch's multi-stage runtime (interleaved 1F1B, zero bubble, ZBV) posts every
    receive ahead of its use and waits on sends only at the end of the step;
    Schedule1F1B and GPipe wait on each batch of sends and receives before the
    next compute. On a CPU host the transfers run on the ranks' own cores."""
    return (layout.schedule in ("interleaved_1f1b", "zero_bubble", "zbv")
            and offloads_to_host(hw))


def _with_host_time(hw, fwd: float, bwd: float, host: float) -> tuple[float, float]:
    """Add the host's dispatch time (a third in forward, as a linear's ops
    are): on a CPU 'device' the same core runs it and the kernels; a GPU's
    host runs ahead, so it costs only where it outlasts the kernels."""
    host_f, host_b = host / 3, host * 2 / 3
    if offloads_to_host(hw):
        return max(fwd, host_f), max(bwd, host_b)
    return fwd + host_f, bwd + host_b


def _stage_activation_bytes(m, layout: Layout, stage: int) -> float:
    """Bytes one pipeline stage's blocks keep for one micro-batch under the
    layout's recompute, each block as its kind (dense or MoE)."""
    dense, sparse = stage_block_counts(m, layout.stage_layers, stage)
    return sum(n * sum(layer_activation_bytes(block_config(m, kind), layout.precision,
                                              layout.recompute, layout.micro_batch,
                                              layout.seq_len, layout.tp, layout.sp,
                                              layout.cp).values())
               for kind, n in ((False, dense), (True, sparse)) if n)


def _local_params(m, layout: Layout) -> float:
    """Parameters on one rank, averaged over the pipeline ranks: each block
    its kind's local shard (an MoE block E / ep experts, a dense block its
    dense FFN), the embedding, head and final norm."""
    table = param_table(m)
    blocks = sum(n * block_local_numel(table, layout, sparse)
                 for sparse, n in zip((False, True), layer_counts(m)) if n)
    return (blocks + sum(_numel(p, layout.tp) for p in table.embed + table.head + table.final)
            ) / layout.pp


def _trained_params(m, layout: Layout, local: float) -> float:
    """Parameters with gradients on one rank: all of them, or (LoRA) the
    adapters alone, which are all the engine reduces and updates."""
    if not layout.lora_rank:
        return local
    per_layer = sum(math.prod(s) for s in lora_layer_shapes(param_table(m), layout))
    return m.num_layers / layout.pp * per_layer


def beside_compute(hw, comm: float, compute: float) -> float:
    """What ``comm`` seconds of collectives add to a window of ``compute``
    seconds they run beside: the part that outlasts the compute, or, while the
    compute is longer, the compute their kernels displace. An NCCL collective
    holds one thread block per channel on its own multiprocessors for as long
    as it runs (``collective_sm_share`` of them), and the kernels beside it
    get the rest."""
    return max(0.0, comm - compute, hw.collective_sm_share * min(comm, compute))


def dp_times(m, layout: Layout, hw, cluster: Cluster, bwd_per_mb: float,
             fwd_bwd_per_mb: float) -> tuple[float, float]:
    """(exposed data-parallel communication, optimizer step) per step; see the
    module docstring for what overlaps what. On a CPU host nothing overlaps:
    the collectives run on the same cores as the ranks' compute."""
    if not on_accelerator(hw):   # a CPU 'device': no spare engine to hide comm behind
        bwd_per_mb = fwd_bwd_per_mb = 0.0
    table = param_table(m)
    local = _local_params(m, layout)
    trained = _trained_params(m, layout, local)
    n = layout.dp * layout.cp
    stride = layout.tp
    shard = layout.dp_shard * layout.cp
    bucket = min(layout.bucket_mb * MIB, trained * 4)
    exposed = 0.0
    strategy = layout_strategy(table, layout, hw)
    if n > 1 and strategy == "own":
        kind = "all_reduce" if layout.zero == 0 else "reduce_scatter"
        groups = grad_sync_groups(m, layout, trained, n)   # experts over their own dp group
        reduce = sum(collective_time(hw, cluster, kind, p * 4, size, st) for p, size, st in groups)
        tail = collective_time(hw, cluster, kind, bucket, n, stride)
        # the buckets go in order from the first one backward fills, which
        # is complete only once backward has produced its share of the
        # gradients; under pipeline parallelism the schedule runs backward
        # itself and the buckets are reduced after it (parallel.zero: overlap off)
        _, first = own_buffer_geometry(table, layout)
        per_window = reduce if layout.pp > 1 else \
            beside_compute(hw, reduce, bwd_per_mb * (1.0 - first)) + tail
        exposed = per_window * (layout.n_micro if layout.zero == 2 else 1)
        if layout.zero >= 1:   # updated parameters gathered after the step
            exposed += sum(collective_time(hw, cluster, "all_gather", p * 4, size, st)
                           for p, size, st in groups)
        exposed += layout.n_micro * fresh_scratch_time(m, layout, hw)
    elif n > 1:
        exposed = _fsdp_exposed(m, layout, hw, cluster, bwd_per_mb, fwd_bwd_per_mb,
                                local, trained)
        if layout.dp_replicate > 1:
            exposed += collective_time(hw, cluster, "all_reduce", trained * 4 / shard,
                                       layout.dp_replicate, stride * shard)
    opt_params = trained / (n if layout.zero >= 1 else 1)
    if hw.adamw_rate:
        opt = opt_params / hw.adamw_rate
    else:
        opt = mem_time(hw, 32 * opt_params)   # read p, g, m, v; write p, m, v; grad norm
    return exposed, opt


def _fsdp_exposed(m, layout: Layout, hw, cluster: Cluster, bwd_per_mb: float,
                  fwd_bwd_per_mb: float, local: float, trained: float) -> float:
    """Exposed FSDP2 traffic per step. Zero 3 gathers in forward, re-gathers
    in backward what was not kept gathered (parallel.keep_gathered_numel);
    zero 2 gathers once per micro-batch, and zero 1 once per step (gradient
    sync off until the last micro-batch). Gathers hide behind forward but for
    the first unit, reduce-scatters behind backward but for the last. Under
    pipeline parallelism torch's schedules hold every reduce-scatter until
    after the last micro-batch, where nothing hides it, and zero 1/2 gather
    once per step."""
    table = param_table(m)
    c = DTYPE_BYTES[layout.precision]
    n_dp = layout.dp_shard * layout.cp
    stride = layout.tp
    unit = table.layer_numel(layout.tp)
    deferred = layout.pp > 1
    kept, _ = zero3_kept_numel(m, layout)
    passes = 2 - min(1.0, kept / local) if layout.zero == 3 else 1
    gather = passes * collective_time(hw, cluster, "all_gather", local * c, n_dp, stride)
    reduce = sum(collective_time(hw, cluster, "reduce_scatter", p * 4, size, st)
                 for p, size, st in grad_sync_groups(m, layout, trained, n_dp))
    first = collective_time(hw, cluster, "all_gather", unit * c, n_dp, stride)
    last = collective_time(hw, cluster, "reduce_scatter", unit * 4, n_dp, stride)
    # FSDP2 copies each gather's shards in and the unsharded result out, and
    # the gradients into and out of the reduce-scatter buffer
    gather_copies = mem_time(hw, 2 * local * passes * c)
    reduce_copies = mem_time(hw, 2 * trained * 4)
    gathers = layout.n_micro if layout.zero == 3 or (layout.zero == 2 and not deferred) else 1
    if deferred:
        syncs, tail = 0, reduce + reduce_copies
    else:
        syncs, tail = (1 if layout.zero == 1 else layout.n_micro), 0.0
    in_backward = beside_compute(hw, reduce + reduce_copies, bwd_per_mb) + last
    fwd_per_mb = max(0.0, fwd_bwd_per_mb - bwd_per_mb)
    if layout.zero == 3:
        # forward and backward gathers share the micro-batch with the reduce
        per_mb = gather + gather_copies + (0.0 if deferred else reduce + reduce_copies)
        return layout.n_micro * (first + beside_compute(hw, per_mb, fwd_bwd_per_mb)) + tail
    return (gathers * (first + beside_compute(hw, gather + gather_copies, fwd_per_mb))
            + syncs * in_backward + tail)


def fresh_scratch_time(m, layout: Layout, hw) -> float:
    """Page faults of zero 2's bucket scratch, per micro-batch, on a CPU host.

    The engine frees the scratch buffers between micro-batches (they would
    only add to the next forward's peak). A buffer above glibc's largest
    mmap threshold goes back to the kernel then, and the next backward
    faults in a fresh one: one buffer of the largest bucket's size, two
    when a bucket still reduces while the next fills (a finished bucket's
    buffer is reused). Below the threshold the heap keeps the pages."""
    if layout.zero != 2 or on_accelerator(hw) or not hw.fresh_memory_bw or layout.lora_rank:
        return 0.0
    n = layout.dp * layout.cp
    table = param_table(m)
    if layout_strategy(table, layout, hw) != "own":
        return 0.0
    shapes = stage_params(table, 0, layout.num_stages, layout.stage_layers[0], layout.tp,
                          layout.ep, m=m, stage_layers=layout.stage_layers)
    flat = layout_sizes([math.prod(s) for s in shapes], owners=n,
                        bucket_numel=int(layout.bucket_mb * MIB) // 4)
    scratch = 4 * flat.largest   # fp32 gradients
    if scratch < MMAP_CEILING_BYTES:
        return 0.0
    return min(2, flat.buckets) * scratch / hw.fresh_memory_bw


def _numel(p, tp: int) -> int:
    return math.prod(p.local_shape(tp))


def estimate_time(m, layout: Layout, hw, cluster: Cluster, global_batch: int,
                  opts: PerfOptions | None = None) -> PerfReport:
    opts = opts or PerfOptions()
    st = stage_times(m, layout, hw, cluster, opts)
    totals = [s.total for s in st]
    t_mb = max(totals)
    m_count = layout.n_micro
    # 1F1B with uneven stages: the slowest rank sets the steady state; fill and
    # drain pass once through every other rank (shortened by the schedule).
    pipe = m_count * t_mb + (sum(totals) - t_mb) / _fill_drain_divisor(layout)
    if layout.pp > 1 and p2p_overlapped(layout, hw):
        # hidden in the steady state, the transfers still lie on the fill and
        # drain path: the first micro-batch's forward to the last rank, its
        # backward back
        pipe += 2 * (layout.pp - 1) * hop_time(m, layout, hw, cluster)
    bubble = pipe - m_count * t_mb
    slow = st[totals.index(t_mb)]
    if layout.offload_activations and offloads_to_host(hw):
        act_bytes = 2 * max(_stage_activation_bytes(m, layout, s)
                            for s in range(layout.num_stages))
        pipe += m_count * max(0.0, act_bytes / hw.host_bw - 0.7 * t_mb)
    dp_exposed, opt = dp_times(m, layout, hw, cluster, slow.bwd, t_mb)
    # one op per DTensor parameter's gradient and micro-batch
    accumulate = m_count * max(dtensor_params(m, layout, r) for r in range(layout.pp))
    opt += accumulate * hw.dtensor_op_s
    step = pipe + dp_exposed + opt
    tokens = global_batch * layout.seq_len
    flops = model_flops_per_step(m, global_batch, layout.seq_len)
    if layout.lora_rank:
        flops += lora_flops_per_step(m, layout, global_batch)
    world = layout.world
    peak = hw.flops(layout.precision)
    comm_per_mb = 0.0
    r = totals.index(t_mb)
    for (sparse, mode), n in rank_block_kinds(m, layout, r).items():
        comm_per_mb += n * layer_time(block_config(m, sparse), layout, hw, cluster, opts,
                                      mode).comm
    layer_comm = comm_per_mb * m_count
    single = _single_gpu_tokens_per_sec(m, layout, hw, cluster, opts)
    tps = tokens / step
    return PerfReport(
        step_s=step, tokens_per_sec=tps, tflops_per_gpu=flops / step / world / 1e12,
        mfu=flops / step / world / peak, comm_share=(dp_exposed + layer_comm) / step,
        bubble_share=bubble / step, scaling_efficiency=tps / (world * single),
        stage_s=totals,
        breakdown={"compute": m_count * t_mb - layer_comm, "tp_cp_comm": layer_comm,
                   "bubble": bubble, "dp_comm_exposed": dp_exposed, "optimizer": opt})


def _single_gpu_tokens_per_sec(m, layout: Layout, hw, cluster: Cluster, opts: PerfOptions) -> float:
    """One GPU, same micro-batch and recompute, no parallelism and no
    communication (whether or not the model would fit)."""
    one = replace(layout, tp=1, pp=1, dp=1, dp_shard=1, cp=1, sp=False, zero=0, virtual=1,
                  n_micro=1, stage_layers=(m.num_layers,), offload_activations=False)
    t = stage_times(m, one, hw, Cluster(1, 1), opts)[0].total
    return layout.micro_batch * layout.seq_len / t
