"""The peer benchmark suite's bookkeeping (benchmarks/peers/): profile
interval arithmetic, ratio medians, DeepSpeed config merging, and that both
sides see the same workload. No peer is installed or run here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))

import ds_side
import run
import stepprofile
import workload


def test_profile_intervals():
    merged = stepprofile._merge([(5, 7), (0, 2), (1, 3), (6, 9)])
    assert merged == [(0, 3), (5, 9)]
    assert stepprofile._gaps((0, 10), merged) == [(3, 5), (9, 10)]
    assert stepprofile._overlap([(3, 5), (9, 10)], [(4, 9.5)]) == pytest.approx(1.5)


def test_comm_names():
    for name in ("c10d::allreduce_", "giant:collective", "gloo:all_reduce",
                 "FSDP::post_backward_reduce", "c10d::_allgather_base_"):
        assert stepprofile.COMM.search(name), name
    for name in ("aten::mm", "peer::compute", "Optimizer.step#AdamW.step"):
        assert not stepprofile.COMM.search(name), name


def _run(tps, loss=8.0):
    return {"tokens_per_sec": tps, "loss": loss, "losses": [loss] * 20, "peak_rss_mib": [500.0]}


def test_summary_takes_median_of_paired_ratios_and_skips_failures():
    systems = {"giantmodel": [_run(110), _run(90), _run(130), {"error": "x"}],
               "deepspeed": [_run(100), _run(100), _run(100), _run(100)]}
    s = run.summarize(systems)["giantmodel"]
    assert s["ratios"] == pytest.approx([1.1, 0.9, 1.3])
    assert s["ratio_median"] == pytest.approx(1.1)
    assert s["loss_rel_diff"] == 0.0


def test_ds_config_merges_sections_and_keeps_batch_plan():
    case = workload.find_case("dp2-zero2")
    cfg = ds_side.ds_config(case, {"zero_optimization": {"overlap_comm": True}})
    assert cfg["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert cfg["train_batch_size"] == case.global_batch
    assert cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] \
        * case.dp == case.global_batch
    with pytest.raises(SystemExit):
        workload.find_case("dp3")


def test_giantmodel_side_uses_the_shared_workload():
    from giantmodel.config import load_config

    case = workload.find_case("dp2-zero1")
    cfg = load_config(None, workload.gm_overrides(case, 20, "/tmp/unused"))
    assert cfg.model.hidden_size == workload.MODEL["hidden_size"]
    assert cfg.model.ffn_hidden_size == workload.MODEL["ffn_hidden_size"]
    assert (cfg.parallel.dp, cfg.parallel.zero) == (2, 1)
    assert cfg.optim.lr == workload.OPTIM["lr"] and cfg.optim.schedule == "constant"
    assert cfg.train.global_batch_size == case.global_batch


def test_gpu_suite_without_cuda_prints_the_planner_prediction(tmp_path, monkeypatch, capsys):
    """With no CUDA device the GPU suite runs nothing and reports the planner's
    prediction for the workload, marked as one."""
    import json

    import gpu

    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    assert run.main(["--suite", "gpu", "--json", str(out)]) == 0
    assert "PREDICTION, not measured" in capsys.readouterr().out
    report = json.loads(out.read_text())
    pred = report["prediction"]
    assert pred["kind"].startswith("prediction") and not report["run"]
    assert pred["tokens_per_sec"] > 0 and 0.05 < pred["mfu"] < 0.9 and pred["peak_memory_gib"] > 1


@pytest.mark.slow
def test_ranks_launched_once_serve_several_commands(tmp_path):
    """The suite launches each system's ranks once and sends them every rep:
    each command runs its cases in turn, each case in a fresh child with its
    own process group, and each writes its own figures. A command that fails
    leaves its error, and the next one starts the ranks again."""
    import gm_side
    import launch

    from giantmodel.testing.ranks import free_port

    z1, z3 = workload.find_case("dp2-zero1"), workload.find_case("dp2-zero3")
    cmd = [sys.executable, Path(run.HERE) / "gm_side.py", "--warmup", 1]
    with launch.RankGroup(run._local_ranks(cmd, 2), gm_side.summarize, 240) as ranks:
        got = ranks.run([z1, z3], tmp_path / "a", steps=3, profile=False, port=free_port())
        first = ranks.procs
        again = ranks.run([z1], tmp_path / "b", steps=2, profile=False, port=free_port())
        assert ranks.procs is first     # the same processes served both commands
        # a case of another rank count: the ranks' children fail, the command reports it
        bad = ranks.run([workload.find_case("dp4-zero1")], tmp_path / "c", steps=2,
                        profile=False, port=free_port())
        assert "error" in bad["dp4-zero1"] and ranks.procs is None
        after = ranks.run([z1], tmp_path / "d", steps=2, profile=False, port=free_port())
    assert set(got) == {"dp2-zero1", "dp2-zero3"}
    for r in [*got.values(), again["dp2-zero1"], after["dp2-zero1"]]:
        assert "error" not in r, r["error"][-3000:]
        assert r["tokens_per_sec"] > 0 and r["command_wall_s"] > 0
    assert len(got["dp2-zero1"]["losses"]) == 3 and len(again["dp2-zero1"]["losses"]) == 2
    # the same weights and batches: ZeRO-1 and ZeRO-3 train alike, and a
    # later command starts from the same state
    assert got["dp2-zero1"]["losses"] == pytest.approx(got["dp2-zero3"]["losses"], rel=1e-5)
    assert again["dp2-zero1"]["losses"] == pytest.approx(got["dp2-zero1"]["losses"][:2], rel=1e-6)
    missing = workload.collect("dp2-zero2", str(tmp_path / "none"), gm_side.summarize, "boom")
    assert missing == {"dp2-zero2": {"error": "boom"}}
