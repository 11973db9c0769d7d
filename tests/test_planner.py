"""Planner: profiles, CLI entry points, search, errors, pipeline report."""

from __future__ import annotations

import argparse
import json
import math
import time

import pytest
import yaml

from giantmodel.config.errors import ConfigError
from giantmodel.planner import commands
from giantmodel.planner.hardware import BUILTIN, get_profile
from giantmodel.planner.layout import Cluster
from giantmodel.planner.memory import memory_report
from giantmodel.planner.perf import collective_time

LLAMA_13B = ["model.arch=llama", "model.name=llama-13b", "model.hidden_size=5120",
             "model.num_layers=40", "model.num_heads=40", "model.num_kv_heads=40",
             "model.ffn_hidden_size=13824", "model.vocab_size=32000", "model.max_seq_len=2048",
             "train.seq_len=2048", "train.global_batch_size=512", "train.micro_batch_size=1",
             "precision=bf16"]


def _args(kind: str, argv: list[str]):
    p = argparse.ArgumentParser()
    (commands.add_plan_arguments if kind == "plan" else commands.add_estimate_arguments)(p)
    return p.parse_args(argv)


def test_builtin_profiles_and_user_yaml(tmp_path):
    for name in ("h100-sxm", "h100-pcie", "h200", "a100-80g", "a100-40g", "a800", "v100-32g",
                 "v100-16g"):
        assert name in BUILTIN
    assert get_profile("cpu").memory_bytes > 0
    f = tmp_path / "hw.yaml"
    f.write_text(yaml.safe_dump({"mygpu": {
        "peak_flops": {"fp32": 1e13, "bf16": 1e14, "fp16": 1e14}, "memory_bytes": 24e9,
        "memory_bw": 1e12, "intra_link": "pcie4", "intra_bw": 25e9, "inter_bw": 12.5e9}}))
    assert get_profile("mygpu", f).memory_bytes == 24e9
    with pytest.raises(ConfigError, match="valid names: .*a100-80g"):
        get_profile("a100-81g")
    f.write_text(yaml.safe_dump({"bad": {"peak_flop": {}}}))
    with pytest.raises(ConfigError, match="did you mean 'peak_flops'"):
        get_profile("bad", f)


def test_hierarchical_all_reduce_is_bounded_by_the_network():
    hw = get_profile("a100-80g")
    size = 1e9
    one_node = collective_time(hw, Cluster(1, 8), "all_reduce", size, 8, 1)
    two_nodes = collective_time(hw, Cluster(2, 8), "all_reduce", size, 16, 1)
    # inside a node NVLink dominates; across nodes each GPU moves 1/8 of the
    # data over its own NIC, 12x slower than NVLink
    assert one_node == pytest.approx(2 * 7 / 8 * size / (300e9 * 0.8) + 14 * 10e-6, rel=1e-6)
    assert two_nodes > one_node
    assert two_nodes < one_node + 2 * size / 8 / (25e9 * 0.8)


def test_estimate_json_keys(capsys):
    rc = commands.run_estimate(_args("estimate", ["--gpu", "a100-80g", "--nodes", "1",
                                                  "--gpus-per-node", "8", "--json",
                                                  "parallel.tp=2", "parallel.pp=2",
                                                  "train.global_batch_size=32",
                                                  "train.micro_batch_size=2", *LLAMA_13B[:9]]))
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    for path in ("memory.peak_bytes_per_rank", "memory.breakdown", "time.step_s",
                 "throughput.tokens_per_sec", "throughput.tflops_per_gpu", "throughput.mfu"):
        a, b = path.split(".")
        assert b in d[a], path
    assert d["memory"]["peak_bytes_per_rank"] == max(r["peak_bytes"] for r in d["memory"]["per_rank"])
    assert 0 < d["throughput"]["mfu"] < 1
    assert len(d["pipeline"]["stages"]) == 2


def test_estimate_rejects_layout_that_cannot_divide_the_model():
    with pytest.raises(ConfigError, match="model.num_heads=40 is not divisible by parallel.tp=3"):
        commands.run_estimate(_args("estimate", ["--gpu", "a100-80g", "--gpus-per-node", "3",
                                                 "parallel.tp=3", *LLAMA_13B]))
    with pytest.raises(ConfigError, match="unknown GPU 'b200'"):
        commands.run_estimate(_args("estimate", ["--gpu", "b200"]))
    with pytest.raises(ConfigError, match="plan needs the hardware"):
        commands.run_plan(_args("plan", LLAMA_13B))
    with pytest.raises(ConfigError, match="either --gpu or --profile"):
        commands.run_plan(_args("plan", ["--gpu", "a100-80g", "--profile", "x.yaml"]))


@pytest.mark.timeout(60)
def test_plan_llama_13b_two_nodes_fast_and_fits(tmp_path, capsys):
    from giantmodel.config import load_config
    from giantmodel.planner import memory, search

    for cache in (memory._STATES, memory._ACTS, memory._TABLES, search._SPLITS):
        cache.clear()   # time a cold search, as a fresh `giantmodel plan` runs it
    out = tmp_path / "best.yaml"
    start = time.monotonic()
    rc = commands.run_plan(_args("plan", ["--gpu", "a100-80g", "--nodes", "2",
                                          "--gpus-per-node", "8", "--top", "3", "--json",
                                          "--out", str(out), *LLAMA_13B]))
    elapsed = time.monotonic() - start
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    best = d["top"][0]
    assert best["memory"]["fits"]
    assert best["memory"]["required_bytes_per_rank"] <= best["memory"]["capacity_bytes"]
    speeds = [r["throughput"]["tokens_per_sec"] for r in d["top"]]
    assert speeds == sorted(speeds, reverse=True)
    # the written YAML loads with the trainer's loader and has the best layout
    cfg = load_config(out, validate=False)
    assert cfg.parallel.tp == best["layout"]["tp"] and cfg.recompute == best["layout"]["recompute"]
    from dataclasses import asdict

    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.planner.layout import resolve_layout
    assert ParallelDims.from_config(cfg, 16).world_size == 16
    # every planned field comes back from the YAML; a pipelined candidate's too
    def fields(layout):
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(layout).items()}

    assert fields(resolve_layout(cfg, Cluster(2, 8))) == {
        k: v for k, v in best["layout"].items() if k not in ("dp_replicate", "world")}
    from giantmodel.planner.search import apply_layout, search
    base = commands.load_for_planning(None, LLAMA_13B)
    piped = next(c.layout for c in search(base, get_profile("a100-80g"), Cluster(2, 8))
                 if c.layout.pp > 1 and c.layout.virtual > 1)
    assert fields(resolve_layout(apply_layout(base, piped), Cluster(2, 8))) == fields(piped)
    assert elapsed < 10, f"plan took {elapsed:.1f} s"


def test_plan_reports_smallest_cluster_when_nothing_fits():
    # 13B x 16 bytes of model states = 208 GB: 5 GPUs of 40 GB hold 41.7 GB each, too
    # many; 6 hold 34.7 GB each plus buffers and reserve, which fits when the
    # bf16 weights are cast at each use; kept through the step (the default,
    # 2 bytes per parameter more: 39 GB of states on 6), it takes 7
    for cast, n in (("use", 6), ("step", 7)):
        with pytest.raises(ConfigError, match=rf"smallest cluster that would fit is {n} x 1 a100"):
            commands.run_plan(_args("plan", ["--gpu", "a100-40g", "--nodes", "1",
                                             "--gpus-per-node", "1", *LLAMA_13B,
                                             f"train.weight_cast={cast}"]))


def test_recompute_and_zero_reduce_memory_monotonically():
    from dataclasses import replace

    from giantmodel.planner.commands import load_for_planning
    from giantmodel.planner.layout import resolve_layout

    cfg = load_for_planning(None, LLAMA_13B + ["parallel.zero=0"])
    hw, cluster = get_profile("a100-80g"), Cluster(2, 8)
    base = resolve_layout(cfg, cluster)
    acts = [memory_report(cfg.model, replace(base, recompute=r), hw).worst.components["activations"]
            for r in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]
    states = [sum(memory_report(cfg.model, replace(base, zero=z, dp_shard=16), hw).worst
                  .components[k] for k in ("params", "grads", "optimizer")) for z in (0, 1, 2, 3)]
    assert states == sorted(states, reverse=True) and states[3] < states[0] / 10


def test_pipeline_report_suggests_a_better_split():
    from giantmodel.planner.commands import load_for_planning
    from giantmodel.planner.layout import resolve_layout
    from giantmodel.planner.report import pipeline_report

    # a large vocabulary makes the last stage heavy; an even split is imbalanced
    cfg = load_for_planning(None, LLAMA_13B[:9] + [
        "model.vocab_size=256000", "model.num_layers=16", "parallel.pp=4", "parallel.tp=2",
        "parallel.pp_layers=[4,4,4,4]", "train.global_batch_size=64", "train.seq_len=2048"])
    layout = resolve_layout(cfg, Cluster(1, 8))
    rep = pipeline_report(cfg.model, layout, get_profile("a100-80g"), Cluster(1, 8))
    times = [s["time_s"] for s in rep["stages"]]
    assert times[-1] == max(times) and rep["imbalance"] > 1.05
    assert sum(rep["suggested_pp_layers"]) == 16
    assert rep["suggested_pp_layers"][-1] < 4 and rep["suggested_imbalance"] < rep["imbalance"]


def test_layer_recompute_plan_is_least_that_fits():
    from dataclasses import replace

    from giantmodel.planner.commands import load_for_planning
    from giantmodel.planner.layer_recompute import layer_recompute_plan
    from giantmodel.planner.layout import resolve_layout

    # micro-batches of 16: 8 now fit on every rank without recompute
    cfg = load_for_planning(None, LLAMA_13B + ["parallel.tp=4", "parallel.pp=4", "parallel.zero=1",
                                               "train.micro_batch_size=16"])
    hw, cluster = get_profile("a100-80g"), Cluster(2, 8)
    layout = resolve_layout(cfg, cluster)
    plans = layer_recompute_plan(cfg.model, layout, hw, cluster)
    none = memory_report(cfg.model, replace(layout, recompute="none"), hw)
    sel = memory_report(cfg.model, replace(layout, recompute="selective"), hw)
    for p, r_none, r_sel in zip(plans, none.ranks, sel.ranks):
        assert p["required_bytes"] <= hw.memory_bytes
        if r_none.required <= hw.memory_bytes:   # fits as is: recompute nothing
            assert p["plan"] == {"none": p["layers"], "selective": 0, "full": 0}
        else:
            assert p["plan"]["none"] < p["layers"]
        if p["plan"]["selective"] == p["layers"]:  # the all-selective corner is the global mode
            assert p["required_bytes"] == pytest.approx(r_sel.required)
    # pipeline rank 0 holds the most micro-batches: it needs the most recompute
    assert plans[0]["plan"]["none"] <= plans[-1]["plan"]["none"]
    assert any(0 < p["plan"]["none"] < p["layers"] for p in plans)


@pytest.mark.slow
def test_hwbench_writes_a_profile_the_planner_reads(tmp_path, monkeypatch, capsys):
    from giantmodel.planner import hardware, hwbench
    from giantmodel.planner.hardware import load_profile_file
    from giantmodel.planner.perf import matmul_rate

    p = argparse.ArgumentParser()
    hwbench.add_arguments(p)
    out = tmp_path / "host.yaml"
    # --config: DTensor's overhead is timed on that model's block, at its micro-batch
    job = tmp_path / "job.yaml"
    job.write_text("model: {arch: llama, hidden_size: 64, num_layers: 6, num_heads: 4, "
                   "num_kv_heads: 2, ffn_hidden_size: 128, vocab_size: 1000, max_seq_len: 32}\n"
                   "train: {seq_len: 32, micro_batch_size: 2, global_batch_size: 2}\n")
    blocks = []
    real = hwbench.dtensor_op_overhead
    monkeypatch.setattr(hwbench, "dtensor_op_overhead",
                        lambda device, block=None: blocks.append(block) or real(device, block=block))
    assert hwbench.main(p.parse_args(["--sizes", "16,64", "--mem-mb", "8", "--attn-seq", "64",
                                      "--name", "host", "--out", str(out),
                                      "--config", str(job)])) == 0
    (model, tokens), = blocks
    assert (model.hidden_size, model.ffn_hidden_size, model.num_layers, model.vocab_size,
            tokens) == (64, 128, 2, 256, 64)
    prof = load_profile_file(out)["host"]
    curve = prof.matmul_curve["fp32"]
    assert [n for n, _ in curve] == [16.0, 64.0] and curve[0][1] <= curve[1][1]
    assert prof.peak_flops["fp32"] == curve[-1][1] and prof.memory_bw > 1e8
    assert 0 < prof.attention_efficiency <= 1 and 0 < prof.memory_efficiency <= 1
    # the curve is what GEMMs get: interpolated between sizes, capped above
    assert matmul_rate(prof, "fp32", 16, 16, 16) == pytest.approx(curve[0][1])
    assert curve[0][1] <= matmul_rate(prof, "fp32", 32, 32, 32) <= curve[1][1]
    assert matmul_rate(prof, "fp32", 4096, 4096, 4096) == curve[-1][1]
    # --profile FILE and --gpu measured both plan with it
    assert get_profile("host", out).memory_bytes > 0
    capsys.readouterr()
    rc = commands.run_estimate(_args("estimate", ["--profile", str(out), "--json"]))
    assert rc == 0 and json.loads(capsys.readouterr().out)["gpu"] == "host"
    monkeypatch.setattr(hardware, "MEASURED_PROFILE_FILE", tmp_path / "none.yaml")
    with pytest.raises(ConfigError, match="run `giantmodel bench hw` first"):
        get_profile("measured")
    monkeypatch.setattr(hardware, "MEASURED_PROFILE_FILE", out)
    assert get_profile("measured").name == "host"
    with pytest.raises(ConfigError, match="--device must be cpu or cuda"):
        hwbench.main(p.parse_args(["--device", "tpu"]))
    with pytest.raises(ConfigError, match="--sizes must increase"):
        hwbench.main(p.parse_args(["--sizes", "64,16"]))


def test_selective_keeps_less_than_none():
    """The issue's case: a GPT-3-175B-shaped layer at tp 8 with sp, micro-batch 1
    (selective used to keep more than none), and the tiny shapes of the tests."""
    from giantmodel.config.model import ModelConfig
    from giantmodel.planner.memory import layer_activation_bytes

    gpt3 = ModelConfig(arch="gpt", hidden_size=12288, num_layers=96, num_heads=96,
                       ffn_hidden_size=4 * 12288, vocab_size=51200, max_seq_len=2048)
    llama = ModelConfig(arch="llama", hidden_size=8192, num_layers=80, num_heads=64,
                        num_kv_heads=8, ffn_hidden_size=28672, max_seq_len=4096)
    for m, seq in ((gpt3, 2048), (llama, 4096)):
        for prec in ("fp32", "bf16"):
            for tp, sp, cp in ((1, False, 1), (8, False, 1), (8, True, 1), (2, True, 2)):
                b = {mode: sum(layer_activation_bytes(m, prec, mode, 1, seq, tp, sp, cp).values())
                     for mode in ("none", "selective", "full")}
                assert b["none"] > b["selective"] > b["full"], (m.arch, prec, tp, sp, cp, b)


def test_selective_matmuls_cost_their_forward_once_more():
    """A selective policy that re-runs named matmuls (torchtitan's op policy) costs
    exactly their forward GEMMs on top of this engine's selective; other modes and
    the default options are unchanged."""
    from giantmodel.config.model import ModelConfig
    from giantmodel.planner.layout import Layout
    from giantmodel.planner.perf import PerfOptions, gemm_time, layer_time

    m = ModelConfig(arch="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    ffn_hidden_size=14336, vocab_size=128256, max_seq_len=8192)
    lay = Layout(tp=2, pp=1, dp=4, dp_shard=4, cp=1, sp=True, zero=3, virtual=1,
                 schedule="1f1b", micro_batch=1, n_micro=1, seq_len=8192, precision="bf16",
                 recompute="selective", offload_activations=False, stage_layers=(32,))
    hw, cluster = get_profile("h100-sxm"), Cluster(1, 8)
    plain = layer_time(m, lay, hw, cluster, PerfOptions())
    # (wo and w2 are re-run by this engine's own policy under sp: named
    # again, they cost nothing more)
    titan = layer_time(m, lay, hw, cluster,
                       PerfOptions(selective_matmuls=("wk", "wo", "w1", "w3")))
    extra = sum(gemm_time(hw, "bf16", 8192, k, n)
                for k, n in ((4096, 1024 / 2), (4096, 14336 / 2), (4096, 14336 / 2)))
    assert titan.recompute == pytest.approx(plain.recompute + extra)
    assert (titan.fwd, titan.bwd) == (plain.fwd, plain.bwd)
    for mode in ("none", "full"):
        assert layer_time(m, lay, hw, cluster, PerfOptions(selective_matmuls=("wk",)), mode) \
            == layer_time(m, lay, hw, cluster, PerfOptions(), mode)


def test_selective_matmuls_that_are_rerun_are_not_kept():
    """A policy that re-runs wk, wo and w3 (torchtitan's op-level selective) keeps
    this engine's selective activations less exactly those three outputs; the
    other modes do not change."""
    from giantmodel.config.model import ModelConfig
    from giantmodel.planner.memory import layer_activation_bytes

    m = ModelConfig(arch="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    ffn_hidden_size=14336, vocab_size=128256, max_seq_len=8192)
    args = ("bf16", "selective", 2, 8192)
    plain = layer_activation_bytes(m, *args)
    titan = layer_activation_bytes(m, *args, recomputed=("wk", "wo", "w3"))
    assert set(plain) - set(titan) == {"attention.wk_out", "attention.wo_out",
                                       "feed_forward.w3_out"}
    tokens = 2 * 8192
    assert sum(plain.values()) - sum(titan.values()) == 2 * tokens * (1024 + 4096 + 14336)
    for mode in ("none", "full"):
        assert layer_activation_bytes(m, "bf16", mode, 2, 8192, recomputed=("wk",)) \
            == layer_activation_bytes(m, "bf16", mode, 2, 8192)


def test_pipeline_transfers_overlap_only_under_the_multi_stage_runtime():
    """1F1B waits on each stage's sends and receives, so every hop adds to the
    stage time; the interleaved runtime posts receives early and waits on sends
    at the end of the step, so only the fill and drain pay for them."""
    from dataclasses import replace

    from giantmodel.config.model import ModelConfig
    from giantmodel.planner.layout import Layout
    from giantmodel.planner.perf import PerfOptions, estimate_time, hop_time, stage_times

    m = ModelConfig(arch="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    ffn_hidden_size=14336, vocab_size=32000, max_seq_len=4096)
    cluster = Cluster(4, 8)
    one = Layout(tp=8, pp=4, dp=1, dp_shard=1, cp=1, sp=True, zero=0, virtual=1,
                 schedule="1f1b", micro_batch=1, n_micro=16, seq_len=4096, precision="bf16",
                 recompute="none", offload_activations=False, stage_layers=(8,) * 4)
    inter = replace(one, virtual=2, schedule="interleaved_1f1b", stage_layers=(4,) * 8)
    fast, slow = get_profile("h100-sxm"), replace(get_profile("h100-sxm"), inter_bw=1e9)
    opts = PerfOptions()
    for lay, hops in ((one, 1), (inter, 0)):
        added = [b.total - a.total for a, b in zip(stage_times(m, lay, fast, cluster, opts),
                                                   stage_times(m, lay, slow, cluster, opts))]
        extra = 2 * (hop_time(m, lay, slow, cluster) - hop_time(m, lay, fast, cluster))
        assert added == pytest.approx([hops * lay.virtual * extra] * 4)
    step = {hw.inter_bw: estimate_time(m, inter, hw, cluster, 64, opts).step_s for hw in (fast, slow)}
    fill_drain = 2 * 3 * (hop_time(m, inter, slow, cluster) - hop_time(m, inter, fast, cluster))
    assert step[slow.inter_bw] - step[fast.inter_bw] == pytest.approx(fill_drain)
    # on a CPU host the transfers share the ranks' cores: never hidden
    cpu = get_profile("cpu")
    assert stage_times(m, inter, cpu, cluster, opts) != stage_times(
        m, inter, replace(cpu, inter_bw=cpu.inter_bw / 10), cluster, opts)


def test_flat_buffer_sizing_is_greedy_and_fast_at_thousands_of_ranks():
    """The planner sizes ZeRO-1/2 flat buffers for every candidate layout: the
    owner assignment must stay the engine's greedy one (largest first, least
    loaded, lowest rank on ties) and take well under a second at dp 2048
    (it took 52 s per layout for LLaMA-65B, so `plan` ran out of time)."""
    import random

    from giantmodel.parallel.flat_buffer import _owner_loads, layout_sizes

    def greedy(sizes, owners):
        loads, owner_of = [0] * owners, [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
            r = min(range(owners), key=lambda k: (loads[k], k))
            owner_of[i], loads[r] = r, loads[r] + sizes[i]
        return owner_of, loads

    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.choice([1, 8, 8, 100, rng.randint(1, 1000)]) for _ in range(rng.randint(0, 30))]
        owners = rng.randint(1, 9)
        assert _owner_loads(sizes, owners) == greedy(sizes, owners)
    layer = [8192 * 8192] * 4 + [8192 * 22016] * 3 + [8192] * 2   # one LLaMA-65B block
    t0 = time.process_time()
    flat = layout_sizes(layer * 80, owners=2048, bucket_numel=25 * 2 ** 20 // 4)
    assert time.process_time() - t0 < 5.0
    assert flat.total >= sum(layer) * 80 and flat.owned <= flat.shard


def test_recompute_layers_config_checks():
    from giantmodel.config import load_config

    cfg = load_config(overrides=["model.num_layers=3", "recompute_layers=[full,none,selective]"])
    assert cfg.recompute_layers == ["full", "none", "selective"]
    with pytest.raises(ConfigError, match="recompute_layers.*3 entries.*num_layers is 2"):
        load_config(overrides=["model.num_layers=2", "recompute_layers=[full,none,none]"])
    with pytest.raises(ConfigError, match="recompute_layers"):
        load_config(overrides=["model.num_layers=1", "recompute_layers=[some]"])


@pytest.mark.timeout(120)
def test_plan_writes_every_choice_and_the_yaml_runs(tmp_path, capsys):
    """A memory-tight plan picks a per-block recompute mix; the YAML it
    writes resolves to exactly the planned layout and trains a step."""
    from dataclasses import asdict

    import torch

    from giantmodel.config import load_config
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.planner.commands import load_for_planning
    from giantmodel.planner.hardware import profile_to_dict
    from giantmodel.planner.layout import resolve_layout
    from giantmodel.planner.search import search

    tiny = ["model.arch=llama", "model.hidden_size=128", "model.num_layers=4",
            "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_hidden_size=256",
            "model.vocab_size=512", "model.max_seq_len=256", "train.seq_len=256",
            "train.global_batch_size=1", "train.micro_batch_size=1", "precision=fp32"]
    cfg = load_for_planning(None, tiny)
    hw = get_profile("cpu")
    # room for the model states and about two blocks' activations: a mix must fit
    layout = resolve_layout(cfg, Cluster(1, 1))
    full = memory_report(cfg.model, layout, hw)
    acts = full.worst.components["activations"]
    hw.memory_bytes = full.worst.required - acts * 0.55
    hw.reserved_bytes = full.worst.components["reserved"]
    prof = tmp_path / "tight.yaml"
    prof.write_text(yaml.safe_dump({"tight": profile_to_dict(hw)}))
    out = tmp_path / "plan.yaml"
    assert commands.run_plan(_args("plan", ["--profile", str(prof), "--nodes", "1",
                                            "--gpus-per-node", "1", "--out", str(out), "--json",
                                            *tiny])) == 0
    best = json.loads(capsys.readouterr().out)["top"][0]["layout"]
    assert best["recompute_layers"] is not None and len(set(best["recompute_layers"])) > 1
    written = load_config(out, validate=False)
    again = resolve_layout(written, Cluster(1, 1))
    assert {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(again).items()} == {
        k: v for k, v in best.items() if k not in ("dp_replicate", "world")}
    top = search(cfg, get_profile("tight", prof), Cluster(1, 1))[0]
    assert memory_report(cfg.model, top.layout, get_profile("tight", prof)).fits
    # and it trains: the per-block modes are applied by the engine
    import layout_harness as H

    from giantmodel.core.precision import Precision

    engine = H.build_engine(written, ParallelDims.from_config(written, 1))
    wrapped = [type(b).__name__ for b in engine.parts[0].layers.values()]
    assert wrapped.count("CheckpointWrapper") == sum(m != "none" for m in written.recompute_layers)
    ids = torch.randint(0, 512, (1, 256))
    loss = engine.forward_backward([{"input_ids": ids, "labels": ids}], Precision("fp32", "cpu"))
    assert loss > 0


def test_zero_paper_memory_example():
    """Rajbhandari et al. 2020 (ZeRO), Figure 1: 7.5B parameters, Adam with
    fp16 mixed precision (K = 12), 64 data-parallel GPUs."""
    from giantmodel.planner.memory import model_state_bytes

    shapes = [(7_500_000_000,)]
    got = [sum(model_state_bytes(shapes, z, 64, "mixed", zero1="even").values()) / 1e9
           for z in (0, 1, 2, 3)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]
    assert math.isclose(got[1], 4 * 7.5 + 12 * 7.5 / 64)


def test_layout_follows_pipeline_microbatches_and_tied_head_copies():
    from giantmodel.planner.commands import load_for_planning
    from giantmodel.planner.layout import resolve_layout
    from giantmodel.planner.memory import param_table, stage_params

    cfg = load_for_planning(None, LLAMA_13B + ["parallel.pp=4", "parallel.pp_microbatches=8"])
    layout = resolve_layout(cfg, Cluster(2, 8))   # dp = 4: 128 sequences per dp rank
    assert (layout.n_micro, layout.micro_batch) == (8, 16)
    cfg = load_for_planning(None, ["model.tie_embeddings=true"])
    table = param_table(cfg.model)
    first = stage_params(table, 0, 2, 2, 1)
    last = stage_params(table, 1, 2, 2, 1)
    # with two stages the last one keeps its own copy of the tied embedding
    emb = (cfg.model.vocab_size, cfg.model.hidden_size)
    assert first.count(emb) == 1 and last.count(emb) == 1


def test_zero2_scratch_faults_are_charged_on_cpu_above_the_mmap_ceiling():
    """The planner's bucket sizes are the engine's, and zero 2's scratch is
    charged for its page faults only where the engine really maps a fresh
    one: a CPU host, own zero 2, a bucket above glibc's mmap ceiling."""
    import dataclasses
    import random

    import torch

    from giantmodel.config import load_config
    from giantmodel.parallel.flat_buffer import FlatLayout, layout_sizes
    from giantmodel.planner.layout import resolve_layout
    from giantmodel.planner.perf import fresh_scratch_time

    rng = random.Random(1)
    for _ in range(50):
        sizes = [rng.randint(1, 5000) for _ in range(rng.randint(1, 25))]
        owners, bucket = rng.randint(1, 4), rng.randint(100, 20_000)
        engine = FlatLayout([torch.empty(n) for n in sizes], owners=owners, bucket_numel=bucket)
        planned = layout_sizes(sizes, owners=owners, bucket_numel=bucket)
        assert planned.largest == max(b.size for b in engine.buckets)
        assert planned.buckets == len(engine.buckets)

    model = ["model.arch=llama", "model.hidden_size=384", "model.num_layers=4",
             "model.num_heads=6", "model.num_kv_heads=2", "model.ffn_hidden_size=1024",
             "model.vocab_size=8192", "model.max_seq_len=256", "train.seq_len=256",
             "train.micro_batch_size=2", "precision=fp32"]
    cpu = dataclasses.replace(get_profile("cpu"), fresh_memory_bw=4e9)
    cluster = Cluster(1, 2)

    def charged(*extra, hw=cpu):
        cfg = load_config(overrides=model + list(extra), validate=False)
        return fresh_scratch_time(cfg.model, resolve_layout(cfg, cluster), hw)

    # the 8192 x 384 embedding and head cannot be split between two owners:
    # every bucket merges into one of about 48 MiB, mapped afresh each micro-batch
    t = charged("parallel.dp=2", "parallel.zero=2")
    assert 48 * 2 ** 20 / 4e9 <= t <= 2 * 52 * 2 ** 20 / 4e9
    assert charged("parallel.dp=2", "parallel.zero=1") == 0.0
    assert charged("parallel.dp=2", "parallel.zero=3") == 0.0
    assert charged("parallel.dp=2", "parallel.zero=2", hw=dataclasses.replace(
        cpu, fresh_memory_bw=None)) == 0.0
    assert charged("parallel.dp=2", "parallel.zero=2", hw=dataclasses.replace(
        BUILTIN["h100-sxm"], fresh_memory_bw=4e9)) == 0.0


def _llama_8b_layout(**kw):
    from giantmodel.config.model import ModelConfig
    from giantmodel.planner.layout import Layout

    m = ModelConfig(arch="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    ffn_hidden_size=14336, vocab_size=32000, max_seq_len=4096)
    base = dict(tp=1, pp=1, dp=64, dp_shard=64, cp=1, sp=False, zero=3, virtual=1,
                schedule="1f1b", micro_batch=1, n_micro=1, seq_len=4096, precision="bf16",
                recompute="none", offload_activations=False, stage_layers=(32,))
    return m, Layout(**(base | kw))


def test_overlapped_collectives_slow_the_compute_beside_them():
    """An NCCL collective holds its channels' multiprocessors while it runs:
    hidden communication still displaces compute; on a CPU host nothing
    overlaps and the share is 0."""
    from dataclasses import replace

    from giantmodel.planner.perf import beside_compute, estimate_time

    a100 = get_profile("a100-80g")
    share = a100.collective_sm_share
    assert share == pytest.approx(24 / 108)
    assert get_profile("h100-sxm").collective_sm_share == pytest.approx(24 / 132)
    assert get_profile("cpu").collective_sm_share == 0.0
    assert beside_compute(a100, 1.0, 4.0) == pytest.approx(share)    # hidden, not free
    assert beside_compute(a100, 5.0, 2.0) == pytest.approx(3.0)      # outlasts the compute
    assert beside_compute(a100, 0.0, 2.0) == 0.0
    assert beside_compute(get_profile("cpu"), 1.0, 4.0) == 0.0
    m, lay = _llama_8b_layout()
    cluster = Cluster(8, 8)
    free = replace(a100, collective_sm_share=0.0)
    before = estimate_time(m, lay, free, cluster, 64)
    after = estimate_time(m, lay, a100, cluster, 64)
    assert after.step_s > before.step_s
    # at most the share of the whole step's compute
    assert after.step_s < before.step_s + share * before.breakdown["compute"]


def test_gradient_accumulation_is_a_pass_over_memory_per_micro_batch():
    """Zero 0/1 add every micro-batch's gradients into fp32 buffers (12 bytes a
    parameter), zero 2 copies them into bucket scratch, a lone rank adds from
    the second micro-batch on; FSDP2 reducing every micro-batch pays in its
    reduce-scatter copies instead."""
    from dataclasses import replace

    from giantmodel.planner.memory import layout_strategy, param_table
    from giantmodel.planner.perf import PerfOptions, grad_accumulate_time, stage_times

    cpu = get_profile("cpu")
    m, z0 = _llama_8b_layout(dp=8, dp_shard=1, zero=0, n_micro=4)
    z2 = replace(z0, zero=2, dp_shard=8)
    alone = replace(z0, dp=1)
    table = param_table(m)
    assert layout_strategy(table, z0, cpu) == layout_strategy(table, z2, cpu) == "own"
    params = sum(math.prod(p.local_shape(1)) for p in table.embed + table.head + table.final) \
        + m.num_layers * table.layer_numel(1)
    bw = cpu.memory_bw * cpu.stream_efficiency
    assert grad_accumulate_time(m, z0, cpu) == pytest.approx(12 * params / bw)
    assert grad_accumulate_time(m, z2, cpu) == pytest.approx((8 + 12 / 8) * params / bw)
    assert grad_accumulate_time(m, alone, cpu) == pytest.approx(12 * 3 / 4 * params / bw)
    synced = replace(z0, zero=3, dp_shard=8)
    assert grad_accumulate_time(m, synced, cpu) == 0.0
    # charged in each micro-batch's backward
    fast = replace(cpu, stream_efficiency=1e12)
    cluster = Cluster(1, 8)
    slow, quick = (stage_times(m, z0, hw, cluster, PerfOptions())[0] for hw in (cpu, fast))
    assert slow.fwd == quick.fwd
    assert slow.bwd - quick.bwd == pytest.approx(12 * params / bw, rel=1e-3)


def test_host_overhead_is_read_from_back_to_back_pairs(monkeypatch):
    """A host that slows down while it measures must not show up as DTensor
    overhead: each run is paired with a plain one next to it."""
    from giantmodel.planner import hwbench

    clock = [0.0]
    slowdown = [1.0]

    def work(seconds):
        def f():
            clock[0] += seconds * slowdown[0]
            slowdown[0] *= 1.05   # the host drifts slower call by call
        return f

    monkeypatch.setattr(hwbench.time, "perf_counter", lambda: clock[0])
    extra = hwbench._paired_extra(work(3.0), work(1.0), "cpu", pairs=7, calls=1)
    # 2 s extra at the pairs' median slowdown, never the drift between blocks
    assert 2.0 < extra < 2.0 * 1.05 ** 12
