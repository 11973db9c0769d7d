"""Throughput model: per op, per layer, per stage, per step.

Every op costs max(FLOPs / achievable rate, bytes / achievable bandwidth);
collectives cost their bus volume over the slowest link they cross, with
hierarchical (intra-node, then inter-node) algorithms when a group spans
nodes. The step is the pipeline schedule over per-micro-batch stage times,
plus the gradient and parameter traffic that is not hidden behind compute,
plus the optimizer.

Model FLOPs (for TFLOP/s and MFU) follow Narayanan et al. 2021, eq. 3, with
the recompute pass left out and generalised to any MLP and attention width:

    F = 6 * B * s * (L * P_matmul + V * h) + 12 * B * s^2 * L * q

(B sequences of s tokens, L layers, P_matmul weights in each layer's
matmuls, V vocabulary, h hidden, q = heads x head_dim). For GPT-3 shapes
(P_matmul = 12h^2, q = h) this is 72*B*s*L*h^2 * (1 + s/(6h) + V/(12hL)).
MFU = F / step time / (GPUs x dense peak of the precision).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from giantmodel.planner.layout import Cluster, Layout
from giantmodel.planner.memory import DTYPE_BYTES, layer_activation_bytes, param_table


@dataclass
class PerfOptions:
    """Behaviours of the training code that change the step time."""

    overlap_grad_reduce: bool = False
    """zero 0/1 gradient reduction overlaps the backward (Megatron/DDP do);
    this project's DataParallel reduces after the backward, so False."""
    flash_bwd_factor: float = 2.5
    """Backward / forward time of fused attention (it recomputes QK^T)."""


# ----------------------------------------------------------------- ops
def gemm_time(hw, precision: str, m: float, k: float, n: float) -> float:
    c = DTYPE_BYTES[precision]
    flops = 2.0 * m * k * n
    shape = min(m, k, n)
    eff = hw.matmul_efficiency * shape / (shape + hw.matmul_knee)
    t_math = flops / (hw.flops(precision) * eff)
    t_mem = c * (m * k + k * n + m * n) / (hw.memory_bw * hw.memory_efficiency)
    return max(t_math, t_mem)


def mem_time(hw, nbytes: float) -> float:
    return nbytes / (hw.memory_bw * hw.memory_efficiency)


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


def layer_time(m, layout: Layout, hw, cluster: Cluster, opts: PerfOptions) -> LayerTime:
    t, cp, prec = layout.tp, layout.cp, layout.precision
    c = DTYPE_BYTES[prec]
    tokens = layout.micro_batch * layout.seq_len / cp
    h, f = m.hidden_size, m.ffn_hidden_size
    q, kv = m.num_heads * m.dim_per_head, m.kv_heads * m.dim_per_head
    mlp_in = (2 if m.arch == "llama" else 1) * f / t
    gemm = (gemm_time(hw, prec, tokens, h, (q + 2 * kv) / t) + gemm_time(hw, prec, tokens, q / t, h)
            + gemm_time(hw, prec, tokens, h, mlp_in) + gemm_time(hw, prec, tokens, f / t, h))
    attn_flops = 2.0 * layout.micro_batch * layout.seq_len ** 2 * q / (t * cp)
    attn = attn_flops / (hw.flops(prec) * hw.attention_efficiency)
    saved = sum(layer_activation_bytes(m, prec, "none", layout.micro_batch, layout.seq_len,
                                       t, layout.sp, cp).values())
    elem = mem_time(hw, 2.0 * saved)   # each saved tensor written once, read once
    tp_stride = 1
    tp_comm = 2 * collective_time(hw, cluster, "all_reduce", tokens * h * c, t, tp_stride)
    cp_comm = collective_time(hw, cluster, "all_gather", layout.micro_batch * layout.seq_len
                              * 2 * kv / t * c, cp, t)
    fwd = gemm + attn + elem + tp_comm + cp_comm
    bwd = 2 * gemm + opts.flash_bwd_factor * attn + 2 * elem + tp_comm + cp_comm
    if layout.recompute == "full":
        rec = fwd
    elif layout.recompute == "selective":
        rec = attn + elem
    else:
        rec = 0.0
    comm = 2 * (tp_comm + cp_comm) + (tp_comm + cp_comm if layout.recompute == "full" else 0)
    return LayerTime(fwd, bwd, rec, comm)


def edge_times(m, layout: Layout, hw, cluster: Cluster) -> tuple[float, float]:
    """(embedding, head + loss) forward+backward time per micro-batch."""
    t, prec = layout.tp, layout.precision
    c = DTYPE_BYTES[prec]
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    h, v = m.hidden_size, m.vocab_size
    emb = mem_time(hw, 3 * tokens * h * 4)
    if t > 1:  # vocab-parallel embedding: partial rows are all-reduced
        emb += collective_time(hw, cluster, "all_reduce", tokens * h * 4, t, 1)
    head = 3 * gemm_time(hw, prec, tokens, h, v / t)
    head += mem_time(hw, tokens * v / t * (2 * c + 24))  # logits, fp32 softmax fwd + bwd
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
    table = param_table(m)
    p_mm = table.layer_linear_numel(1) - _bias_numel(table)
    return (6.0 * global_batch * seq_len * (m.num_layers * p_mm + m.vocab_size * m.hidden_size)
            + 12.0 * global_batch * seq_len ** 2 * m.num_layers * m.num_heads * m.dim_per_head)


def _bias_numel(table) -> int:
    return sum(p.shape[0] for p in table.layer if p.name.endswith("bias")
               and p.name.split(".")[-2] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))


def _bubble_units(layout: Layout) -> float:
    pp = layout.pp
    if pp == 1:
        return 0.0
    if layout.schedule == "interleaved_1f1b":
        return (pp - 1) / layout.virtual
    if layout.schedule == "zero_bubble":
        return (pp - 1) / 3.0   # ZB-H1: about a third of 1F1B's bubble
    if layout.schedule == "zbv":
        return (pp - 1) / 6.0
    return float(pp - 1)


def stage_times(m, layout: Layout, hw, cluster: Cluster, opts: PerfOptions) -> list[float]:
    lt = layer_time(m, layout, hw, cluster, opts)
    emb, head = edge_times(m, layout, hw, cluster)
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    hop = 2 * p2p_time(hw, cluster, tokens * m.hidden_size * 4 / (layout.tp if layout.sp else 1),
                       layout.world // layout.pp)
    out = []
    for r in range(layout.pp):
        stages = layout.rank_stages(r)
        n = sum(layout.stage_layers[s] for s in stages)
        t = n * lt.total
        if 0 in stages:
            t += emb
        if layout.num_stages - 1 in stages:
            t += head
        if layout.pp > 1:
            t += hop * len(stages)
        out.append(t)
    return out


def dp_times(m, layout: Layout, hw, cluster: Cluster, compute_per_mb: float,
             opts: PerfOptions) -> tuple[float, float]:
    """(exposed data-parallel communication, optimizer step) per step."""
    table = param_table(m)
    per_stage = m.num_layers / layout.pp
    local = (per_stage * table.layer_numel(layout.tp)
             + (sum(_numel(p, layout.tp) for p in table.embed + table.head + table.final))
             / layout.pp)
    c = DTYPE_BYTES[layout.precision]
    n = layout.dp * layout.cp
    stride = layout.tp
    shard = layout.dp_shard * layout.cp
    if layout.zero <= 1:
        t = collective_time(hw, cluster, "all_reduce", local * 4, n, stride)
        exposed = max(0.0, t - 0.8 * compute_per_mb) if opts.overlap_grad_reduce else t
        if layout.zero == 1:
            exposed += collective_time(hw, cluster, "all_gather", local * 4, n, stride)
    else:
        gathers = 1 if layout.zero == 2 else 2
        per_mb = (gathers * collective_time(hw, cluster, "all_gather", local * c, shard, stride)
                  + collective_time(hw, cluster, "reduce_scatter", local * 4, shard, stride))
        exposed = layout.n_micro * max(0.0, per_mb - 0.9 * compute_per_mb)
        if layout.dp_replicate > 1:
            exposed += collective_time(hw, cluster, "all_reduce", local * 4 / shard,
                                       layout.dp_replicate, stride * shard)
        exposed += 2 * hw.latency_s * layout.n_micro
    opt_params = local / (n if layout.zero >= 1 else 1)
    if layout.offload_optimizer:
        gpn = cluster.gpus_per_node
        opt = opt_params / (hw.cpu_adam_rate / gpn) + 8 * opt_params / hw.host_bw
    else:
        opt = mem_time(hw, 32 * opt_params)   # read p, g, m, v; write p, m, v; grad norm
    return exposed, opt


def _numel(p, tp: int) -> int:
    import math
    return math.prod(p.local_shape(tp))


def estimate_time(m, layout: Layout, hw, cluster: Cluster, global_batch: int,
                  opts: PerfOptions | None = None) -> PerfReport:
    opts = opts or PerfOptions()
    stages = stage_times(m, layout, hw, cluster, opts)
    t_mb = max(stages)
    m_count = layout.n_micro
    pipe = (m_count + _bubble_units(layout)) * t_mb
    bubble = pipe - m_count * t_mb
    lt = layer_time(m, layout, hw, cluster, opts)
    act_bytes = 0.0
    if layout.offload_activations:
        per = sum(layer_activation_bytes(m, layout.precision, layout.recompute, layout.micro_batch,
                                         layout.seq_len, layout.tp, layout.sp, layout.cp).values())
        act_bytes = 2 * per * max(layout.stage_layers)
        pipe += m_count * max(0.0, act_bytes / hw.host_bw - 0.7 * t_mb)
    dp_exposed, opt = dp_times(m, layout, hw, cluster, t_mb, opts)
    step = pipe + dp_exposed + opt
    tokens = global_batch * layout.seq_len
    flops = model_flops_per_step(m, global_batch, layout.seq_len)
    world = layout.world
    peak = hw.flops(layout.precision)
    n_layers_max = max(sum(layout.stage_layers[s] for s in layout.rank_stages(r))
                       for r in range(layout.pp))
    layer_comm = n_layers_max * lt.comm * m_count
    single = _single_gpu_tokens_per_sec(m, layout, hw, cluster, opts)
    tps = tokens / step
    return PerfReport(
        step_s=step, tokens_per_sec=tps, tflops_per_gpu=flops / step / world / 1e12,
        mfu=flops / step / world / peak, comm_share=(dp_exposed + layer_comm) / step,
        bubble_share=bubble / step, scaling_efficiency=tps / (world * single),
        stage_s=stages,
        breakdown={"compute": m_count * t_mb - layer_comm, "tp_cp_comm": layer_comm,
                   "bubble": bubble, "dp_comm_exposed": dp_exposed, "optimizer": opt})


def _single_gpu_tokens_per_sec(m, layout: Layout, hw, cluster: Cluster, opts: PerfOptions) -> float:
    """One GPU, same micro-batch and recompute, no parallelism and no
    communication (whether or not the model would fit)."""
    from dataclasses import replace
    one = replace(layout, tp=1, pp=1, dp=1, dp_shard=1, cp=1, sp=False, zero=0, virtual=1,
                  n_micro=1, stage_layers=(m.num_layers,), offload_activations=False,
                  offload_optimizer=False)
    t = stage_times(m, one, hw, Cluster(1, 1), opts)[0]
    return layout.micro_batch * layout.seq_len / t
