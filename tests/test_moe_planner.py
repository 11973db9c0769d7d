"""The planner's MoE terms that depend on where blocks and experts sit:
which blocks of a pipeline stage are dense, and the group the routed
experts' gradients are reduced over (their own data-parallel group)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from giantmodel.config.model import ModelConfig
from giantmodel.config.moe import MoEConfig
from giantmodel.models import build_model
from giantmodel.models.common.moe import moe_layers
from giantmodel.planner.hardware import get_profile
from giantmodel.planner.layout import Cluster, Layout
from giantmodel.planner.memory import MIB, memory_report, param_table
from giantmodel.planner.moe import grad_sync_groups, stage_block_counts, stage_block_params
from giantmodel.planner.perf import _local_params, collective_time, dp_times


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
