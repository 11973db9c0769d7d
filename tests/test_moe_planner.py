"""The planner's MoE terms that depend on where blocks and experts sit:
which blocks of a pipeline stage are dense, and the group the routed
experts' gradients are reduced over (their own data-parallel group)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from giantmodel.config.model import ModelConfig
from giantmodel.config.moe import MoEConfig
from giantmodel.core.loss import cross_entropy_sum
from giantmodel.core.pipeline_split import balanced_split
from giantmodel.models import build_model
from giantmodel.models.common.layers import RMSNorm
from giantmodel.models.common.moe import moe_layers
from giantmodel.parallel.flat_buffer import padding_and_first_bucket
from giantmodel.planner import perf
from giantmodel.planner.hardware import get_profile
from giantmodel.planner.head import head_loss_impl, head_weight_copy
from giantmodel.planner.layout import Cluster, Layout
from giantmodel.planner.measure import LiveStorageCounter
from giantmodel.planner.memory import MIB, memory_report, own_buffer_geometry, param_table
from giantmodel.planner.moe import (
    dense_layer_config,
    grad_sync_groups,
    rank_block_kinds,
    shared_matmul_shapes,
    stage_block_counts,
    stage_block_params,
)
from giantmodel.planner.perf import (
    PerfOptions,
    _local_params,
    collective_time,
    dp_times,
    edge_times,
    layer_time,
    stage_times,
)
from giantmodel.planner.report import pipeline_report, split_by_block_cost
from giantmodel.planner.roofline import mem_time
from giantmodel.planner.terms import moe_ffn_terms, moe_selective_terms, norm_working_bytes


def _model(**moe) -> ModelConfig:
    return ModelConfig(arch="llama", family="deepseek_v3", name="tiny-moe", hidden_size=64,
                       num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=256,
                       vocab_size=256, max_seq_len=128,
                       moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden_size=32, **moe))


def _layout(m, **kw) -> Layout:
    base = dict(tp=1, pp=1, dp=4, dp_shard=4, cp=1, sp=False, zero=0, virtual=1,
                schedule="1f1b", micro_batch=1, n_micro=1, seq_len=128, precision="bf16",
                recompute="none", offload_activations=False, stage_layers=(m.num_layers,))
    return Layout(**{**base, **kw})


@pytest.mark.parametrize("moe, stage_layers", [
    ({"first_k_dense": 1}, (2, 2)),          # DeepSeek-V3: dense blocks lead
    ({"dense_layers": [2]}, (1, 3)),         # Qwen3-MoE's mlp_only_layers
    ({"sparse_step": 2}, (1, 1, 1, 1)),      # decoder_sparse_step: every other block
])
def test_stage_blocks_equal_the_built_stage(moe, stage_layers):
    """Each stage's block parameters as the planner lists them equal those
    of the stage the trainer builds (keep_stage), dense blocks as dense."""
    m = _model(**moe)
    m.validate()
    table = param_table(m)
    start = 0
    for s, n in enumerate(stage_layers):
        model = build_model(m, device="meta")
        model.keep_stage(range(start, start + n), s == 0, s == len(stage_layers) - 1)
        built = sum(p.numel() for p in model.layers.parameters())
        dense, sparse = stage_block_counts(m, stage_layers, s)
        assert (dense, sparse) == (n - len(moe_layers(model)), len(moe_layers(model)))
        listed = stage_block_params(table, m, stage_layers, s)
        assert sum(p.local_shape(1)[0] * _rest(p) for p in listed) == built, (moe, s)
        start += n


def _rest(p) -> int:
    out = 1
    for d in p.shape[1:]:
        out *= d
    return out


def test_expert_gradients_sync_over_their_own_data_parallel_group():
    """ep2 of dp8 x tp2: the experts' gradients go over the 4 edp ranks, 4
    global ranks apart (ep x tp), the rest over all 8 dp ranks 2 apart; the
    costed all-reduce is the sum of the two."""
    m = replace(_model(), num_layers=2)
    layout = _layout(m, tp=2, dp=8, dp_shard=8, ep=2)
    model = build_model(m, device="meta")
    experts = sum(p.numel() for layer in moe_layers(model) for p in layer.experts.parameters())
    trained = 1e6 + experts / 2
    rest, own = grad_sync_groups(m, layout, trained, 8)
    assert rest == (pytest.approx(1e6), 8, 2)
    assert own == (pytest.approx(experts / 2), 4, 4)
    # LoRA trains adapters only: one group
    assert len(grad_sync_groups(m, replace(layout, lora_rank=8), trained, 8)) == 1
    # dp_times costs them: on a CPU host nothing overlaps, so the exposed
    # time is the reduction of each group plus the last bucket's
    cpu, cluster = get_profile("cpu"), Cluster(2, 8)
    local = _local_params(m, layout)
    exposed, _ = dp_times(m, layout, cpu, cluster, 0.0, 0.0)
    tail = collective_time(cpu, cluster, "all_reduce",
                           min(layout.bucket_mb * MIB, local * 4), 8, 2)
    groups = grad_sync_groups(m, layout, local, 8)
    split = sum(collective_time(cpu, cluster, "all_reduce", p * 4, size, st)
                for p, size, st in groups)
    whole = collective_time(cpu, cluster, "all_reduce", local * 4, 8, 2)
    assert exposed == pytest.approx(split + tail, rel=1e-9)
    assert split != pytest.approx(whole, rel=1e-3)   # not all of it over dp x cp


def test_a_dense_stage_is_costed_with_its_dense_blocks():
    """DeepSeek-V3's layout in small: the first blocks dense, the others
    MoE with many small experts and a shared one. Over pp2 the first
    stage holds the dense blocks: its parameters (and so its model states)
    are those the trainer builds for it, and its peak is below the MoE
    stage's (equal before, every block counted as MoE)."""
    m = replace(_model(first_k_dense=2, num_shared_experts=1), num_layers=4)
    m.moe = replace(m.moe, num_experts=16)
    m.validate()
    layout = _layout(m, pp=2, dp=1, dp_shard=1, n_micro=2, stage_layers=(2, 2))
    report = memory_report(m, layout, None)
    for s, (first, last) in enumerate([(True, False), (False, True)]):
        model = build_model(m, device="meta")
        model.keep_stage(range(2 * s, 2 * s + 2), first, last)
        built = sum(p.numel() for p in model.parameters())
        comp = report.ranks[s].components
        assert comp["params"] == 4 * built, (s, comp["params"], 4 * built)
        assert comp["optimizer"] == 8 * built
    dense, moe = (report.ranks[s] for s in (0, 1))
    assert dense.components["params"] < 0.7 * moe.components["params"]
    assert dense.peak < moe.peak


# ------------------------------------------ per-block-kind activations, casts and buffers
B, T = 2, 64


def _mixed(num_layers: int, first_k_dense: int) -> ModelConfig:
    """The tiny MoE model with its first blocks dense; the dense FFN (192
    wide) and the 8 experts (32 wide) have different weight counts."""
    m = replace(_model(first_k_dense=first_k_dense), num_layers=num_layers, ffn_hidden_size=192)
    m.validate()
    return m


def _held(m, precision: str) -> float:
    """What the planner has one micro-batch's forward leave alive on a single
    rank: activations, embedding/head tensors, weight casts (ids made outside)."""
    lay = _layout(m, dp=1, dp_shard=1, seq_len=T, micro_batch=B, precision=precision)
    c = memory_report(m, lay, get_profile("cpu")).ranks[0].components
    return (c["activations"] + c["embedding_head_activations"] + c["working_weights"]
            - B * T * 8)


def _live(m, precision: str) -> int:
    """Storages the forward and loss leave alive (planner.measure), as
    tests/test_planner_activations.py counts a dense model's."""
    torch.manual_seed(0)
    model = build_model(m, "cpu")
    model.init_buffers("cpu")
    ids = torch.randint(0, m.vocab_size, (B, T))
    live = LiveStorageCounter()
    with live, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss, _ = cross_entropy_sum(model(ids), ids)
    nbytes = live.live_bytes()
    loss.backward()
    return nbytes


def test_a_dense_block_of_an_moe_model_is_costed_as_measured():
    """A stage holding a dense block and an MoE block against one holding
    the MoE block alone: the difference, measured on what the forward
    keeps alive, is the dense block (its FFN's saved tensors and, in bf16,
    the casts of its fused linears), and the planner's is the same within
    2%. Charging the dense block as an MoE block (router, dispatched rows,
    experts) missed it by 10% in fp32."""
    mixed, moe_only = _mixed(2, 1), _mixed(1, 0)
    for precision in ("fp32", "bf16"):
        measured = _live(mixed, precision) - _live(moe_only, precision)
        predicted = _held(mixed, precision) - _held(moe_only, precision)
        assert abs(predicted / measured - 1) < 0.02, (precision, predicted, measured)


def _block_numel(m, layer: int, linear_only: bool = False) -> int:
    """Parameters (or the autocast-cast linear weights: not the fp32 router)
    of block ``layer`` of the built model."""
    block = build_model(m, device="meta").layers[str(layer)]
    return sum(p.numel() for name, p in block.named_parameters()
               if not linear_only or "router" not in name and "norm" not in name)


def test_a_mixed_stage_is_charged_per_block_kind():
    """pp2 over four blocks, the first dense: stage 0 holds dense + MoE,
    stage 1 MoE + MoE. Per micro-batch in flight, their activations differ
    by exactly one dense block less one MoE block (the dense FFN's input,
    gate, up and gated product, against the router, dispatch and expert
    terms of terms.moe_ffn_terms; attention and norms alike), and their
    bf16 weight casts by the dense block's linears less the MoE block's
    (its 8 experts whole at ep1), the head's copy apart."""
    m = _mixed(4, 1)
    lay = _layout(m, pp=2, dp=1, dp_shard=1, n_micro=2, stage_layers=(2, 2), seq_len=T,
                  micro_batch=B)
    r0, r1 = memory_report(m, lay, None).ranks
    h, f, c, tokens = m.hidden_size, m.ffn_hidden_size, 2, B * T
    dense_ffn = c * (h + 3 * f)   # feed_forward.input, w1_out, w3_out, w2_input
    moe_ffn = sum(t.bytes_per_token for t in moe_ffn_terms(m, "bf16"))
    got = r0.components["activations"] / r0.inflight - r1.components["activations"] / r1.inflight
    assert got == pytest.approx(tokens * (dense_ffn - moe_ffn), rel=1e-9)
    assert got != 0
    # weight casts (zero 0, no recompute: every linear of a block)
    head = c * m.vocab_size * h if head_weight_copy(head_loss_impl(lay, None)) else 0
    casts = r0.components["working_weights"] - (r1.components["working_weights"] - head)
    want = c * (_block_numel(m, 0, True) - _block_numel(m, 1, True))
    assert casts == want and want != 0


def test_zero3_buffers_follow_the_largest_block_on_the_stage():
    """ZeRO-3 over pp2, the first stage all dense: each stage's gathered
    (two blocks prefetched) and unsharded-gradient buffers are sized by its
    own largest block, the dense block on stage 0 and the MoE block on 1."""
    m = _mixed(4, 2)
    lay = _layout(m, pp=2, dp=2, dp_shard=2, zero=3, n_micro=2, stage_layers=(2, 2))
    ranks = memory_report(m, lay, None).ranks
    for rank, layer in ((ranks[0], 0), (ranks[1], 2)):
        n = _block_numel(m, layer)
        assert rank.components["working_weights"] == 2 * n * 2, layer
        assert rank.components["comm_buffers"] == 2 * n * 4, layer
    assert _block_numel(m, 0) != _block_numel(m, 2)


def test_dense_blocks_of_a_stage_run_no_experts_and_no_all_to_all():
    """ep2: stage 0's dense block costs the dense FFN's GEMMs and no
    dispatch/combine; against the same model with that block MoE, stage 0's
    forward is shorter by exactly one dense block's time less one MoE
    block's (whose all-to-all it no longer pays)."""
    mixed, all_moe = _mixed(4, 1), _mixed(4, 0)
    hw, cluster, opts = get_profile("h100-sxm"), Cluster(1, 8), PerfOptions()
    lay = _layout(mixed, pp=2, dp=4, dp_shard=4, ep=2, n_micro=2, stage_layers=(2, 2))
    dense_t = layer_time(dense_layer_config(mixed), lay, hw, cluster, opts)
    moe_t = layer_time(mixed, lay, hw, cluster, opts)
    assert dense_t.comm == 0.0 < moe_t.comm
    got = stage_times(mixed, lay, hw, cluster, opts)[0].fwd \
        - stage_times(all_moe, lay, hw, cluster, opts)[0].fwd
    assert got == pytest.approx(dense_t.fwd - moe_t.fwd, rel=1e-9)
    # stage 1 holds MoE blocks only in both
    assert stage_times(mixed, lay, hw, cluster, opts)[1].fwd == pytest.approx(
        stage_times(all_moe, lay, hw, cluster, opts)[1].fwd, rel=1e-12)


def test_block_kinds_follow_per_layer_recompute():
    """rank_block_kinds pairs each block's kind with its own recompute mode
    (model.recompute_layers), and with one mode counts each stage's kinds."""
    m = _mixed(4, 1)
    lay = _layout(m, pp=2, dp=1, dp_shard=1, n_micro=2, stage_layers=(2, 2),
                  recompute_layers=("full", "none", "none", "selective"))
    assert rank_block_kinds(m, lay, 0) == {(False, "full"): 1, (True, "none"): 1}
    assert rank_block_kinds(m, lay, 1) == {(True, "none"): 1, (True, "selective"): 1}
    one = replace(lay, recompute_layers=None, recompute="full", stage_layers=(3, 1))
    assert rank_block_kinds(m, one, 0) == {(False, "full"): 1, (True, "full"): 2}
    assert rank_block_kinds(m, one, 1) == {(True, "full"): 1}


def _moe_model(num_layers: int, **moe) -> ModelConfig:
    m = replace(_model(**moe), num_layers=num_layers, ffn_hidden_size=192)
    m.validate()
    return m


@pytest.mark.parametrize("moe", [
    {},                                                    # Qwen3/Mixtral: softmax, renormalised
    {"router": "sigmoid", "n_group": 4, "topk_group": 2,   # DeepSeek-V3's router and shared expert
     "routed_scaling_factor": 2.5, "num_shared_experts": 1, "seq_aux_loss_coeff": 1e-3},
    {"num_shared_experts": 1, "aux_loss_coeff": 1e-3, "z_loss_coeff": 1e-3, "norm_topk_prob": False},
])
def test_an_moe_block_is_costed_as_measured(moe):
    """Two MoE blocks less one, measured on what the forward keeps alive
    (the CPU's expert loop), against the planner's MoE block (attention,
    norms, router, dispatch, experts, combine, and in bf16 the block's
    weight casts) within 1%, in fp32 and bf16. The terms before missed the
    router's fp32 copy of its input (4 x hidden bytes a token), the sort
    order and its inverse, the renormalised weights and their cast, and
    counted the shared experts' SiLU output instead of their input: 3-7%
    of the whole block in fp32."""
    two, one = _moe_model(2, **moe), _moe_model(1, **moe)
    for precision in ("fp32", "bf16"):
        measured = _live(two, precision) - _live(one, precision)
        predicted = _held(two, precision) - _held(one, precision)
        assert abs(predicted / measured - 1) < 0.01, (precision, predicted, measured)


def test_the_norms_fp32_work_is_timed_though_not_kept():
    """Qwen3's block: every fused RMSNorm it runs (attention_norm, ffn_norm,
    and qk-norm's per-head q_norm and k_norm) keeps only its input and
    rstd, but its forward writes fp32 tensors of its input's size, measured
    here per norm: at least the two that backward rebuilds in bf16 (the
    input made fp32 and the normalised product; one in fp32). The time
    model's element-wise term counts exactly those two (one) per norm
    (terms.norm_working_bytes), and layer_time adds them: a time model
    that follows only the saved tensors (as after the norms stopped keeping
    them) drops every norm's working tensors from the block's time."""
    m = replace(_moe_model(1), family="qwen3_moe", qk_norm=True, head_dim=16)
    m.validate()
    for precision, copies in (("fp32", 1), ("bf16", 2)):
        want = norm_working_bytes(m, precision, B, T, 1, False, 1)
        seen = _norm_fp32_writes(m, precision)
        assert set(seen) == {k.removesuffix(".fp32_work") for k in want}, (seen, want)
        for norm, (numel, written) in seen.items():
            assert want[f"{norm}.fp32_work"] == B * T * copies * 4 * numel, norm
            assert written >= copies * 4 * numel, (norm, written, numel)
    hw, cluster, opts = get_profile("h100-sxm"), Cluster(1, 8), PerfOptions()
    lay = _layout(m, dp=1, dp_shard=1, seq_len=T, micro_batch=B)
    work = sum(norm_working_bytes(m, "bf16", B, T, 1, False, 1).values())
    timed = layer_time(m, lay, hw, cluster, opts)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(perf, "norm_working_bytes", lambda *a: {})
        saved_only = layer_time(m, lay, hw, cluster, opts)
    assert timed.fwd - saved_only.fwd == pytest.approx(mem_time(hw, 2 * work), rel=1e-9)
    assert timed.bwd - saved_only.bwd == pytest.approx(2 * mem_time(hw, 2 * work), rel=1e-9)


class _Fp32Writes(TorchDispatchMode):
    """Bytes of the fp32 tensors of ``numel`` elements the ops write."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.bytes = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 \
                and out.numel() == self.numel:
            self.bytes += out.numel() * 4
        return out


def _norm_fp32_writes(m, precision: str) -> dict[str, tuple[int, int]]:
    """Per RMSNorm of block 0 (named as the planner names it): its input's
    elements per token and the fp32 bytes per token its forward writes."""
    torch.manual_seed(0)
    model = build_model(m, "cpu")
    model.init_buffers("cpu")
    out = {}
    for name, mod in model.layers["0"].named_modules():
        if not isinstance(mod, RMSNorm):
            continue
        def pre(mod, args):
            mod._mode = _Fp32Writes(args[0].numel())
            mod._mode.__enter__()

        def post(mod, args, output, key=name):
            mod._mode.__exit__(None, None, None)
            out[key] = (args[0].numel() // (B * T), mod._mode.bytes // (B * T))

        mod.register_forward_pre_hook(pre)
        mod.register_forward_hook(post)
    ids = torch.randint(0, m.vocab_size, (B, T))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        model(ids)
    return out


def test_shared_experts_are_whole_on_every_tp_rank():
    """parallel.tensor's plan leaves an MoE layer unsplit (every tp rank
    runs its router, experts and shared experts on the whole tokens): the
    shared experts' parameters keep their shapes at tp2 and their GEMMs
    their sizes, where the planner split them as a dense MLP's."""
    m = _moe_model(1, num_shared_experts=1)
    shared = [p for p in param_table(m).layer if ".shared_experts." in p.name]
    assert shared and all(p.local_shape(2) == p.shape for p in shared)
    assert shared_matmul_shapes(m, 2) == shared_matmul_shapes(m, 1) != {}


def test_pipeline_report_times_each_block_as_its_kind():
    """estimate's per-stage times and suggested pp_layers: a stage of dense
    blocks is timed with the dense FFN (no experts, no all-to-all), not as
    MoE blocks, and the suggested split weighs each block at its own cost
    (here the cheap dense blocks share a stage with more of them)."""
    m = _mixed(6, 3)
    hw, cluster, opts = get_profile("h100-sxm"), Cluster(1, 8), PerfOptions()
    lay = _layout(m, pp=2, dp=4, dp_shard=4, ep=2, n_micro=2, stage_layers=(3, 3))
    rep = pipeline_report(m, lay, hw, cluster, opts)
    dense = layer_time(dense_layer_config(m), lay, hw, cluster, opts).total
    sparse = layer_time(m, lay, hw, cluster, opts).total
    emb, head = edge_times(m, lay, hw, cluster)
    got = [s["time_s"] for s in rep["stages"]]
    assert got == pytest.approx([3 * dense + emb, 3 * sparse + head], rel=1e-12)
    assert dense < sparse
    cost = [dense] * 3 + [sparse] * 3
    want = min(([k, 6 - k] for k in range(1, 6)),
               key=lambda s: max(sum(cost[:s[0]]) + emb, sum(cost[s[0]:]) + head))
    assert rep["suggested_pp_layers"] == want and want[0] > 3
    # blocks of one cost: the uniform split's rule
    assert split_by_block_cost([1.0] * 6, 2, 0.0, 0.5) == balanced_split(6, 2, 1.0, 0.0, 0.5)


def test_zero12_buffer_geometry_lists_each_block_as_its_kind():
    """The padding and first-bucket share of zero 1/2's flat buffers, which
    choose the engine's strategy, follow each pipeline rank's parameters as
    the trainer builds them, in registration order: DeepSeek-V3's dense
    blocks as dense (listing them as MoE blocks gave another geometry)."""
    m = replace(_model(first_k_dense=2, num_shared_experts=1), num_layers=4)
    m.moe = replace(m.moe, num_experts=16)
    m.validate()
    lay = _layout(m, pp=2, zero=1, n_micro=2, stage_layers=(2, 2), bucket_mb=0.05)
    table = param_table(m)
    bucket = int(lay.bucket_mb * MIB) // 4
    worst = (0.0, 0.0)
    for s, (first, last) in enumerate([(True, False), (False, True)]):
        model = build_model(m, device="meta")
        model.keep_stage(range(2 * s, 2 * s + 2), first, last)
        sizes = [p.numel() for p in model.parameters()]
        got = padding_and_first_bucket(sizes, owners=4, bucket_numel=bucket)
        worst = (max(worst[0], got[0]), max(worst[1], got[1]))
    assert own_buffer_geometry(table, lay) == pytest.approx(worst, rel=1e-12)
    as_moe = replace(m, moe=replace(m.moe, first_k_dense=0))
    assert own_buffer_geometry(param_table(as_moe), lay) != pytest.approx(worst, rel=1e-6)


def test_selective_keeps_every_expert_gemm_output_of_the_grouped_path():
    """In bf16 (the GPU's grouped GEMMs) selective recompute keeps the three
    expert GEMM outputs, the down projection's too (aten._grouped_mm is in
    the policy's matmuls); the fp32 loop writes that one in place."""
    m = _model()
    rows, h, f = 2, m.hidden_size, 32      # top-2, no capacity factor
    for precision, down in (("bf16", 2 * rows * h), ("fp32", 0)):
        kept = {t.name: t.bytes_per_token for t in moe_selective_terms(m, precision)}
        c = 2 if precision == "bf16" else 4
        assert kept["moe.experts.w1_out"] == kept["moe.experts.w3_out"] == c * rows * f
        assert kept.get("moe.experts.w2_out", 0) == down, kept
