"""Pipeline parallelism: every schedule, and pp combined with tp, sp, dp/ZeRO
and cp, against the single-process run (5 steps, fp32, gloo).

Several layouts share one ``run_ranks`` spawn: starting a rank costs seconds.
"""

from __future__ import annotations

import pytest
import torch

from giantmodel.config.errors import ConfigError
from giantmodel.parallel.pipeline_split import (balanced_split, head_cost, layer_cost,
                                                layers_per_stage, stage_ids_for_rank,
                                                stage_owner, validate_pipeline)
from giantmodel.testing import run_ranks

import layout_harness as H

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2)]


def _pp(schedule: str, virtual: int, *extra: str) -> list[str]:
    return ["parallel.pp=2", f"parallel.pp_schedule={schedule}",
            f"parallel.pp_virtual={virtual}", *extra]


def _check_all(cases: list, results: list) -> None:
    refs: dict = {}
    for (arch, overrides), result in zip(cases, results, strict=True):
        key = (arch, tuple(o for o in overrides if not o.startswith("parallel.")))
        if key not in refs:
            refs[key] = H.reference(arch, list(overrides))
        H.assert_matches(result, refs[key], f"{arch} {overrides}")


# ----------------------------------------------------------- stage layout
def stage_layout(rank: int, world: int, cases: list) -> list:
    """Which stages and parameters each rank holds, and eval under pp."""
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.parallel.engine import build_engine
    from giantmodel.train.precision import Precision

    out = []
    for arch, overrides in cases:
        cfg = H.make_config(arch, overrides)
        dims = ParallelDims.from_config(cfg, world)
        dims.build_mesh("cpu")
        engine = build_engine(cfg, dims, torch.device("cpu"))
        names = [sorted(n for n, _ in part.named_parameters()) for part in engine.parts]
        batches = H.local_microbatches(cfg, 11, engine.data_rank, engine.data_world)
        val = engine.eval_loss(batches, Precision("fp32", "cpu"))
        out.append({"stages": engine.stage_ids, "counts": engine.layer_counts,
                    "names": names, "eval": val})
    return out


def reference_eval(arch: str) -> float:
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.parallel.engine import build_engine
    from giantmodel.train.precision import Precision

    cfg = H.make_config(arch, [])
    engine = build_engine(cfg, ParallelDims(world_size=1), torch.device("cpu"))
    return engine.eval_loss(H.local_microbatches(cfg, 11, 0, 1), Precision("fp32", "cpu"))


def pp2_group(rank: int, world: int, cases: list, layout_cases: list) -> tuple:
    return H.run_cases(rank, world, cases), stage_layout(rank, world, layout_cases)


@pytest.mark.timeout(240)
def test_pp2_every_schedule_matches_single_process():
    cases = [(arch, _pp(s, v)) for arch in ("llama", "gpt") for s, v in SCHEDULES]
    layout_cases = [("llama", _pp("interleaved_1f1b", 2)), ("gpt", _pp("zbv", 2)),
                    ("llama", _pp("1f1b", 1))]
    results = run_ranks(pp2_group, 2, cases, layout_cases, timeout=220)
    _check_all(cases, results[0][0])

    interleaved, zbv, plain = zip(*(r[1] for r in results))
    # Looped placement: rank r runs stages r and r + pp; one layer each.
    assert [x["stages"] for x in interleaved] == [[0, 2], [1, 3]]
    assert interleaved[0]["names"][0][:2] == ["layers.0.attention.wk.weight",
                                              "layers.0.attention.wo.weight"]
    assert any(n.startswith("tok_embeddings") for n in interleaved[0]["names"][0])
    assert any(n.startswith("output") for n in interleaved[1]["names"][1])
    # V placement: rank 0 runs the first and the last stage.
    assert [x["stages"] for x in zbv] == [[0, 3], [1, 2]]
    assert any(n.startswith("pos_embeddings") for n in zbv[0]["names"][0])
    assert any(n.startswith("output") for n in zbv[0]["names"][1])
    for x in plain:
        assert x["counts"] == [2, 2]
    # Forward-only evaluation across stages equals the single-process loss.
    for arch, group in (("llama", interleaved), ("gpt", zbv), ("llama", plain)):
        ref = reference_eval(arch)
        for x in group:
            assert abs(x["eval"] - ref) <= 1e-5 * ref, (arch, x["eval"], ref)


@pytest.mark.timeout(240)
def test_pp2_with_tp_sp_dp_zero_cp_matches_single_process():
    cases = [
        ("llama", _pp("1f1b", 1, "parallel.tp=2")),
        ("llama", _pp("interleaved_1f1b", 2, "parallel.tp=2", "parallel.sp=true")),
        ("llama", _pp("1f1b", 1, "parallel.dp=2")),
        ("gpt", _pp("gpipe", 1, "parallel.dp=2", "parallel.zero=3")),
        ("llama", _pp("zbv", 2, "parallel.dp=2", "parallel.zero=1")),
        ("gpt", _pp("interleaved_1f1b", 2, "parallel.dp=2", "parallel.zero=2")),
        ("llama", _pp("1f1b", 1, "parallel.cp=2")),
    ]
    results = run_ranks(H.run_cases, 4, cases, timeout=220)
    _check_all(cases, results[0])


@pytest.mark.timeout(240)
def test_dp2_tp2_pp2_on_eight_ranks_matches_single_process():
    cases = [("llama", _pp("1f1b", 1, "parallel.dp=2", "parallel.tp=2"))]
    results = run_ranks(H.run_cases, 8, cases, timeout=220)
    _check_all(cases, results[0])


# ------------------------------------------------------ no process group
def test_balanced_split_counts_embedding_and_head():
    # Uniform layers, no extras: as even as possible, earlier stages take the rest.
    assert balanced_split(8, 4, 1.0) == [2, 2, 2, 2]
    assert balanced_split(7, 3, 1.0) == [3, 2, 2]
    # A head worth 2.5 layers pushes layers off the last stage.
    assert balanced_split(10, 2, 1.0, last_extra=2.5) == [6, 4]
    # An expensive first stage (embedding) loses layers instead.
    assert balanced_split(10, 3, 1.0, first_extra=3.0) == [2, 4, 4]
    # Every stage keeps at least one layer, even under a huge head.
    assert balanced_split(4, 4, 1.0, last_extra=100.0) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="cannot fill"):
        balanced_split(3, 4, 1.0)


def test_layers_per_stage_uses_cost_model_and_manual_override():
    cfg = H.make_config("llama", ["model.num_layers=8", "model.vocab_size=32768"])
    per_layer, head = layer_cost(cfg.model, cfg.train.seq_len), head_cost(cfg.model)
    assert head > 2 * per_layer  # the big vocabulary makes the head cost several layers
    counts = layers_per_stage(cfg, 2)
    assert sum(counts) == 8 and counts[0] > counts[1]
    cfg = H.make_config("llama", ["model.num_layers=8", "parallel.pp_layers=[1,3,3,1]"])
    assert layers_per_stage(cfg, 4) == [1, 3, 3, 1]
    with pytest.raises(ConfigError, match="parallel.pp_layers"):
        layers_per_stage(cfg, 2)


def test_stage_placement_loop_and_v():
    assert [stage_ids_for_rank(r, 4, 2, "interleaved_1f1b") for r in range(4)] == [
        [0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_ids_for_rank(r, 4, 2, "zbv") for r in range(4)] == [
        [0, 7], [1, 6], [2, 5], [3, 4]]
    for schedule in ("interleaved_1f1b", "zbv"):
        for r in range(4):
            for s in stage_ids_for_rank(r, 4, 2, schedule):
                assert stage_owner(s, 4, schedule) == r


def test_pipeline_validation_names_the_keys():
    cfg = H.make_config("llama", ["model.tie_embeddings=true", "parallel.pp=2"])
    with pytest.raises(ConfigError, match="tie_embeddings"):
        validate_pipeline(cfg, 2, 4)
    cfg = H.make_config("llama", _pp("zbv", 1))
    with pytest.raises(ConfigError, match="pp_virtual"):
        validate_pipeline(cfg, 2, 4)
    cfg = H.make_config("llama", _pp("interleaved_1f1b", 2))
    with pytest.raises(ConfigError, match="global_batch_size"):
        validate_pipeline(cfg, 2, 3)
    cfg = H.make_config("llama", _pp("1f1b", 1))
    with pytest.raises(ConfigError, match="global_batch_size"):
        validate_pipeline(cfg, 2, 1)
    cfg = H.make_config("llama", _pp("interleaved_1f1b", 4))
    with pytest.raises(ConfigError, match="num_layers"):
        validate_pipeline(cfg, 2, 4)
