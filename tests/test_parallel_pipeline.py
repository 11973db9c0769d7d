"""Pipeline parallelism against the single-process run (5 steps, gloo):
every schedule, pp combined with tp, sp, dp/ZeRO 0-3 and cp, pp4, tied
embeddings across stages, recompute, a re-cut micro-batch count, and bf16/fp16;
plus the stage split, the stage placement, forward-only evaluation and the
pipeline checks of the config, which need no process group.

Several layouts share one ``run_ranks`` spawn: starting a rank costs seconds.
"""

from __future__ import annotations

import layout_harness as H
import pytest
import torch

from giantmodel.config.errors import ConfigError
from giantmodel.core.pipeline_split import (
    balanced_split,
    check_pipeline_placement,
    head_cost,
    layer_cost,
    layers_per_stage,
    plan_pipeline,
    stage_ids_for_rank,
    stage_owner,
)
from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.testing import run_ranks

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2)]


def _pp(schedule: str, virtual: int, *extra: str) -> list[str]:
    return ["parallel.pp=2", f"parallel.pp_schedule={schedule}",
            f"parallel.pp_virtual={virtual}", *extra]


def _check_all(cases: list, results: list, check=H.assert_matches) -> None:
    refs: dict = {}
    for (arch, overrides), result in zip(cases, results, strict=True):
        key = (arch, tuple(o for o in overrides if not o.startswith("parallel.")))
        if key not in refs:
            refs[key] = H.reference(arch, list(overrides))
        if "model.tie_embeddings=true" in overrides:
            _merge_tied_copies(result, f"{arch} {overrides}")
        check(result, refs[key], f"{arch} {overrides}")


def _merge_tied_copies(result: dict, label: str) -> None:
    """Under pp a tied embedding is two copies (first and last stage) that
    must stay bitwise equal; the single-process model names it once."""
    head = torch.as_tensor(result["params"].pop("output.weight"))
    embedding = torch.as_tensor(result["params"]["tok_embeddings.weight"])
    assert torch.equal(head, embedding), f"{label}: tied copies drifted apart"


# ----------------------------------------------------------- stage layout
def stage_layout(rank: int, world: int, cases: list) -> list:
    """Which stages and parameters each rank holds, and eval under pp."""
    from giantmodel.core.precision import Precision
    from giantmodel.distributed.parallel_dims import ParallelDims

    out = []
    for arch, overrides in cases:
        cfg = H.make_config(arch, overrides)
        dims = ParallelDims.from_config(cfg, world)
        dims.build_mesh("cpu")
        engine = H.build_engine(cfg, dims)
        names = [sorted(n for n, _ in part.named_parameters()) for part in engine.parts]
        batches = H.local_microbatches(cfg, 11, engine.data_rank, engine.data_world)
        val = engine.eval_loss(batches, Precision("fp32", "cpu"))
        out.append({"stages": engine.runner.stage_ids, "counts": list(dims.pipeline.layer_counts),
                    "names": names, "eval": val})
    return out


def _layers(names: list[str]) -> set[int]:
    return {int(n.split(".")[1]) for n in names if n.startswith("layers.")}


def reference_eval(arch: str) -> float:
    from giantmodel.core.precision import Precision
    from giantmodel.distributed.parallel_dims import ParallelDims

    cfg = H.make_config(arch, [])
    engine = H.build_engine(cfg, ParallelDims(world_size=1))
    return engine.eval_loss(H.local_microbatches(cfg, 11, 0, 1), Precision("fp32", "cpu"))


def pp2_group(rank: int, world: int, cases: list, layout_cases: list) -> tuple:
    return H.run_cases(rank, world, cases), stage_layout(rank, world, layout_cases)


# Recompute is exact; bf16/fp16 autocast is compared with the single-process
# run at the same precision by each tensor's update (H.assert_update_matches).
EXACT_EXTRAS = [("llama", _pp("1f1b", 1, "recompute=full")),
                ("gpt", _pp("interleaved_1f1b", 2, "recompute=selective")),
                ("llama", _pp("1f1b", 1, "model.tie_embeddings=true")),
                ("gpt", _pp("zbv", 2, "model.tie_embeddings=true")),
                ("llama", _pp("zero_bubble", 1)),
                # 8 sequences per step, re-cut into 8 pipeline micro-batches of 1.
                ("gpt", _pp("1f1b", 1, "parallel.pp_microbatches=8")),
                # Llama 3's split: more stages than blocks, the first chunk holding only the
                # embedding and the last only the head.
                ("llama", _pp("interleaved_1f1b", 3, "parallel.pp_layers=[0,1,1,1,1,0]")),
                ("llama", _pp("zbv", 2, "parallel.pp_layers=[0,2,2,0]")),
                ("gpt", _pp("1f1b", 1, "parallel.pp_layers=[4,0]"))]
LOW_PRECISION = [("llama", _pp("1f1b", 1, "precision=bf16")),
                 ("gpt", _pp("zbv", 2, "precision=fp16"))]


@pytest.mark.timeout(480)
def test_pp2_every_schedule_matches_single_process():
    cases = [(arch, _pp(s, v)) for arch in ("llama", "gpt") for s, v in SCHEDULES]
    cases += EXACT_EXTRAS
    layout_cases = [("llama", _pp("interleaved_1f1b", 2)), ("gpt", _pp("zbv", 2)),
                    ("llama", _pp("1f1b", 1))]
    results = run_ranks(pp2_group, 2, cases + LOW_PRECISION, layout_cases, timeout=220)
    trained = results[0][0]
    _check_all(cases, trained[:len(cases)])
    _check_all(LOW_PRECISION, trained[len(cases):], check=H.assert_update_matches)

    interleaved, zbv, plain = zip(*(r[1] for r in results))
    # Looped placement: rank r runs stages r and r + pp; one layer each.
    assert [x["stages"] for x in interleaved] == [[0, 2], [1, 3]]
    assert [[_layers(n) for n in x["names"]] for x in interleaved] == [[{0}, {2}], [{1}, {3}]]
    assert any(n.startswith("tok_embeddings") for n in interleaved[0]["names"][0])
    assert any(n.startswith("output") for n in interleaved[1]["names"][1])
    # V placement: rank 0 runs the first and the last stage.
    assert [x["stages"] for x in zbv] == [[0, 3], [1, 2]]
    assert [[_layers(n) for n in x["names"]] for x in zbv] == [[{0}, {3}], [{1}, {2}]]
    assert any(n.startswith("pos_embeddings") for n in zbv[0]["names"][0])
    assert any(n.startswith("output") for n in zbv[0]["names"][1])
    for x in plain:
        assert x["counts"] == [2, 2]
    # Forward-only evaluation across stages equals the single-process loss.
    for arch, group in (("llama", interleaved), ("gpt", zbv), ("llama", plain)):
        ref = reference_eval(arch)
        for x in group:
            assert abs(x["eval"] - ref) <= 1e-5 * ref, (arch, x["eval"], ref)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_pp2_with_tp_sp_dp_zero_cp_tied_matches_single_process():
    cases = [
        ("llama", _pp("1f1b", 1, "parallel.tp=2")),
        ("llama", _pp("interleaved_1f1b", 2, "parallel.tp=2", "parallel.sp=true",
                      "model.tie_embeddings=true")),
        # A non-identity placement: pipeline groups [1, 3] and [0, 2].
        ("llama", _pp("1f1b", 1, "parallel.dp=2", "parallel.placement=[1,0,3,2]")),
        ("gpt", _pp("gpipe", 1, "parallel.dp=2", "parallel.zero=3", "model.tie_embeddings=true")),
        ("llama", _pp("zbv", 2, "parallel.dp=2", "parallel.zero=1")),
        ("gpt", _pp("interleaved_1f1b", 2, "parallel.dp=2", "parallel.zero=2")),
        ("llama", _pp("1f1b", 1, "parallel.cp=2")),
        ("llama", ["parallel.pp=4", "model.tie_embeddings=true"]),
        # empty edge chunks with a tied embedding, sharded: the first chunk's embedding and the
        # last chunk's head are the two copies
        ("llama", _pp("interleaved_1f1b", 3, "parallel.pp_layers=[0,1,1,1,1,0]", "parallel.dp=2",
                      "parallel.zero=2", "model.tie_embeddings=true")),
    ]
    # zero 1 where the first stage's 4096 x 64 embedding cannot be balanced
    # over two owners: FSDP2 units, which torch's schedule syncs after the
    # last micro-batch (grad norm summed from shards: 1e-4). Then a tied
    # embedding where only the first stage would pad (one block beside it,
    # three beside the head): both stages must shard alike.
    padded = [("llama", _pp("1f1b", 1, "parallel.dp=2", "parallel.zero=1",
                            "model.vocab_size=4096")),
              ("llama", _pp("1f1b", 1, "parallel.dp=2", "parallel.zero=1", "parallel.pp_layers=[1,3]",
                            "model.tie_embeddings=true", "model.vocab_size=1024"))]
    results = run_ranks(H.run_cases, 4, cases + padded, timeout=240)
    _check_all(cases, results[0][:len(cases)])
    _check_all(padded, results[0][len(cases):],
               check=lambda r, ref, label: H.assert_matches(r, ref, label, norm_rtol=1e-4))


@pytest.mark.timeout(480)
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
    counts = layers_per_stage(cfg.model, seq_len=cfg.train.seq_len, num_stages=2)
    assert sum(counts) == 8 and counts[0] > counts[1]
    cfg = H.make_config("llama", ["model.num_layers=8", "parallel.pp_layers=[1,3,3,1]"])
    split = {"seq_len": cfg.train.seq_len, "pp_layers": cfg.parallel.pp_layers}
    assert layers_per_stage(cfg.model, num_stages=4, **split) == [1, 3, 3, 1]
    with pytest.raises(ConfigError, match="parallel.pp_layers"):
        layers_per_stage(cfg.model, num_stages=2, **split)


def test_stage_placement_loop_and_v():
    assert [stage_ids_for_rank(r, 4, 2, "interleaved_1f1b") for r in range(4)] == [
        [0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_ids_for_rank(r, 4, 2, "zbv") for r in range(4)] == [
        [0, 7], [1, 6], [2, 5], [3, 4]]
    for schedule in ("interleaved_1f1b", "zbv"):
        for r in range(4):
            for s in stage_ids_for_rank(r, 4, 2, schedule):
                assert stage_owner(s, 4, schedule) == r


def validate_pipeline(cfg, pp, dp):
    return plan_pipeline(model=cfg.model, train=cfg.train, parallel=cfg.parallel, pp=pp, dp=dp)


def test_pipeline_validation_names_the_keys():
    # The harness batch: 8 sequences per step, micro-batches of 2.
    cfg = H.make_config("llama", _pp("zbv", 1))
    with pytest.raises(ConfigError, match="pp_virtual"):
        validate_pipeline(cfg, 2, 1)
    cfg = H.make_config("llama", _pp("interleaved_1f1b", 2, "parallel.pp_microbatches=2"))
    validate_pipeline(cfg, 2, 1)
    cfg = H.make_config("llama", _pp("interleaved_1f1b", 4, "parallel.pp=4"))
    with pytest.raises(ConfigError, match="parallel.pp_microbatches|global_batch_size"):
        validate_pipeline(cfg, 4, 4)  # 2 sequences per dp rank: 1 micro-batch < 4 stages
    cfg = H.make_config("llama", _pp("1f1b", 1, "parallel.pp=4"))
    with pytest.raises(ConfigError, match="global_batch_size"):
        validate_pipeline(cfg, 4, 4)
    cfg = H.make_config("llama", _pp("1f1b", 1, "parallel.pp_microbatches=3"))
    with pytest.raises(ConfigError, match="parallel.pp_microbatches"):
        validate_pipeline(cfg, 2, 1)
    cfg = H.make_config("llama", _pp("interleaved_1f1b", 4))
    with pytest.raises(ConfigError, match="num_layers"):
        validate_pipeline(cfg, 2, 1)
    # More stages than blocks is allowed when the split is given (empty edge chunks).
    cfg = H.make_config("llama", _pp("interleaved_1f1b", 4, "parallel.pp_microbatches=2",
                                     "parallel.pp_layers=[0,1,1,1,1,0,0,0]"))
    assert validate_pipeline(cfg, 2, 1).layer_counts == (0, 1, 1, 1, 1, 0, 0, 0)
    # Stage order must follow rank order inside each pipeline group.
    check_pipeline_placement(ParallelDims(world_size=4, dp_replicate=2, pp=2,
                                          placement=[1, 0, 3, 2]).mesh_layout(), 2)
    with pytest.raises(ConfigError, match="parallel.placement"):
        check_pipeline_placement(ParallelDims(world_size=4, dp_replicate=2, pp=2,
                                              placement=[3, 0, 2, 1]).mesh_layout(), 2)


# ------------------------------------------------------------ dead peer
FAULT_TIMEOUT_S = 2.0


def _train_with_stuck_peer(rank: int, world: int) -> dict | None:
    """Rank 1 (the last stage) stops answering after one healthy step; rank 0
    must fail within ``parallel.timeout_s``, not wait for it."""
    import time

    from giantmodel.core.precision import Precision
    from giantmodel.distributed.parallel_dims import ParallelDims

    cfg = H.make_config("llama", _pp("1f1b", 1, f"parallel.timeout_s={FAULT_TIMEOUT_S}"))
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    engine = H.build_engine(cfg, dims)
    precision = Precision("fp32", "cpu")
    mbs = H.local_microbatches(cfg, 0, engine.data_rank, engine.data_world)
    engine.forward_backward(mbs, precision)
    if rank == 1:
        time.sleep(FAULT_TIMEOUT_S + 5)
        return None
    start = time.monotonic()
    try:
        engine.forward_backward(mbs, precision)
    except Exception as e:  # noqa: BLE001 - the failure is the point
        return {"raised": True, "elapsed": time.monotonic() - start, "error": str(e)[:200]}
    return {"raised": False, "elapsed": time.monotonic() - start}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stuck_stage_fails_within_timeout():
    # The default group's timeout is long: only parallel.timeout_s can end it in time.
    res = run_ranks(_train_with_stuck_peer, 2, timeout=100, pg_timeout=60)[0]
    assert res["raised"], "stage 0 kept waiting for a silent stage 1"
    assert res["elapsed"] <= FAULT_TIMEOUT_S + 4, res
