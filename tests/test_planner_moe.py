"""The planner on Mixture-of-Experts models: parameter counts against the
built model, each rank's expert shard, active FLOPs, the dispatch/combine
all-to-all, and ep in the layout search."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from giantmodel.config.mla import MLAConfig
from giantmodel.config.model import ModelConfig
from giantmodel.config.moe import MoEConfig
from giantmodel.config.schema import JobConfig
from giantmodel.metrics.flops import flops_per_token
from giantmodel.models import build_model
from giantmodel.models.common.moe import moe_layers
from giantmodel.planner.hardware import get_profile
from giantmodel.planner.layout import Cluster, Layout
from giantmodel.planner.memory import (
    memory_report,
    model_active_param_count,
    model_param_count,
)
from giantmodel.planner.perf import PerfOptions, layer_time, model_flops_per_step
from giantmodel.planner.search import search


def _mixtral() -> ModelConfig:
    return ModelConfig(arch="llama", family="mixtral", name="tiny-mixtral", hidden_size=64,
                       num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                       vocab_size=256, max_seq_len=128,
                       moe=MoEConfig(num_experts=4, top_k=2))


def _qwen3_moe() -> ModelConfig:
    return ModelConfig(arch="llama", family="qwen3_moe", name="tiny-qwen3-moe", hidden_size=64,
                       num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
                       ffn_hidden_size=96, vocab_size=256, max_seq_len=128,
                       moe=MoEConfig(num_experts=8, top_k=3, norm_topk_prob=False,
                                     expert_ffn_hidden_size=32, dense_layers=[1]))


def _deepseek_v3() -> ModelConfig:
    return ModelConfig(arch="llama", family="deepseek_v3", name="tiny-deepseek-v3",
                       hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=None,
                       head_dim=24, ffn_hidden_size=128, vocab_size=256, max_seq_len=128,
                       mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                                     qk_rope_head_dim=8, v_head_dim=16),
                       moe=MoEConfig(num_experts=8, top_k=2, router="sigmoid", n_group=4,
                                     topk_group=2, routed_scaling_factor=2.5,
                                     expert_ffn_hidden_size=32, num_shared_experts=1,
                                     first_k_dense=1))


FAMILIES = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_total_and_active_params_equal_the_built_model(family):
    m = FAMILIES[family]()
    m.validate()
    model = build_model(m, device="meta")
    total = sum(p.numel() for p in model.parameters())
    # a token runs top_k of the E routed experts of every MoE layer
    skipped = sum(sum(p.numel() for p in layer.experts.parameters())
                  * (m.moe.num_experts - m.moe.top_k) // m.moe.num_experts
                  for layer in moe_layers(model))
    assert moe_layers(model) and skipped > 0
    assert model_param_count(m) == total
    assert model_active_param_count(m) == total - skipped


def _layout(m, **kw) -> Layout:
    base = dict(tp=1, pp=1, dp=4, dp_shard=4, cp=1, sp=False, zero=0, virtual=1,
                schedule="1f1b", micro_batch=1, n_micro=1, seq_len=128, precision="bf16",
                recompute="none", offload_activations=False, stage_layers=(m.num_layers,))
    return Layout(**{**base, **kw})


def _expert_numel(m) -> int:
    model = build_model(m, device="meta")
    return sum(p.numel() for layer in moe_layers(model) for p in layer.experts.parameters())


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_expert_memory_halves_from_ep1_to_ep2(zero):
    # every layer sparse: the planner's per-stage count is then exact
    m = replace(_mixtral(), num_layers=2)
    hw = get_profile("h100-sxm")
    experts = _expert_numel(m)   # every block is MoE
    states = {}
    for ep in (1, 2):
        rank = memory_report(m, _layout(m, zero=zero, ep=ep), hw).ranks[0].components
        states[ep] = {k: rank[k] for k in ("params", "grads", "optimizer")}
    # the other weights are the same at both degrees: the whole difference is
    # half the experts, in each state's bytes per element, sharded as the
    # stage shards it (zero 1: optimizer over edp = 4 / ep ranks; zero 3: all)
    per_elem = {"params": 4, "grads": 4, "optimizer": 8}
    for key, b in per_elem.items():
        diff = states[1][key] - states[2][key]
        sharded = (zero >= 1 and key == "optimizer") or zero == 3
        # ep1: experts / 4 per rank when sharded over 4; ep2: experts / 2 over 2 ranks
        want = b * experts / 2 if not sharded else 0
        assert diff == pytest.approx(want, rel=0.02, abs=64), (key, states)
    if zero == 0:
        assert states[2]["params"] < states[1]["params"]


def test_active_flops_below_six_times_total():
    for make in FAMILIES.values():
        m = make()
        # a one-token sequence: the weights' FLOPs, attention next to nothing
        per_token = model_flops_per_step(m, 1, 1)
        assert per_token < 6 * model_param_count(m)
        # active weights and the head at least (norms and the embedding are not matmuls)
        assert per_token > 6 * (model_active_param_count(m) - m.vocab_size * m.hidden_size) * 0.95
        # the trainer's MFU counts the same active parameters and attention
        assert flops_per_token(m, 128) == pytest.approx(model_flops_per_step(m, 1, 128) / 128,
                                                        rel=0.02)


def test_all_to_all_only_with_ep():
    m = _deepseek_v3()
    hw, cluster, opts = get_profile("h100-sxm"), Cluster(1, 8), PerfOptions()
    comm = {ep: layer_time(m, _layout(m, ep=ep), hw, cluster, opts).comm for ep in (1, 2, 4)}
    assert comm[1] == 0.0
    assert 0.0 < comm[2] < comm[4]
    # across nodes the all-to-all rides the network, slower than NVLink
    wide = layer_time(m, _layout(m, dp=16, dp_shard=16, ep=16), hw, Cluster(2, 8), opts).comm
    assert wide > comm[4] * 2


def test_plan_picks_ep_when_experts_dominate():
    # 64 experts of 8192 wide in every layer: 26B expert weights against
    # 0.1B of attention and embeddings; replicated on 8 GPUs (ep1) they
    # cost 16 bytes each (no fit) or are gathered at every step (zero 3)
    m = ModelConfig(arch="llama", family="mixtral", name="expert-heavy", hidden_size=2048,
                    num_layers=8, num_heads=16, num_kv_heads=4, ffn_hidden_size=8192,
                    vocab_size=4096, max_seq_len=2048,
                    moe=MoEConfig(num_experts=64, top_k=2))
    cfg = JobConfig(model=m, precision="bf16")
    cfg.train.global_batch_size, cfg.train.seq_len, cfg.train.micro_batch_size = 64, 2048, 1
    hw = get_profile("h100-sxm")
    cands = search(cfg, hw, Cluster(1, 8), time_budget_s=15.0)
    assert cands, "no layout fits"
    best = cands[0].layout
    assert best.ep > 1, best.describe()
    assert math.prod((best.dp, best.cp)) % best.ep == 0
    assert f"ep{best.ep}" in best.describe()
