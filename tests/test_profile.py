"""profile.steps writes a Chrome trace with the step's matmuls; a CUDA
out-of-memory error leaves a memory snapshot and says how to view it."""

import json

import pytest
import torch

from giantmodel.config import ConfigError, load_config
from giantmodel.config.train import ProfileConfig
from giantmodel.metrics import profile as profile_mod
from giantmodel.metrics.profile import StepProfiler, is_oom, snapshot_path

SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=128", "model.vocab_size=256", "model.max_seq_len=64",
         "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=4",
         "data.source=synthetic", "train.log_every=1", "train.sample_tokens=0",
         "train.eval_every=0", "optim.warmup_steps=2", "run.tensorboard=false",
         "run.progress=false", "checkpoint.every=0", "checkpoint.save_final=false",
         "train.device=cpu"]
MATMULS = {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm"}


def test_profile_steps_validation():
    assert load_config(None, ["profile.steps=[2,3]"]).profile.steps == [2, 3]
    for bad in ("[0,2]", "[3,2]", "[1,2,3]"):
        with pytest.raises(ConfigError, match="profile.steps"):
            load_config(None, [f"profile.steps={bad}"])


@pytest.mark.timeout(120)
def test_profile_window_writes_a_trace_with_the_steps_matmuls(tmp_path, capsys, monkeypatch):
    from giantmodel.train.trainer import Trainer

    trainer = Trainer(load_config(None, [*SMALL, f"run.dir={tmp_path}", "train.steps=3",
                                         "profile.steps=[2,3]"]))
    try:
        trainer.train()
    finally:
        trainer.close()
    trace = tmp_path / "profile" / "rank0-steps2-3.trace.json"
    assert trace.is_file()
    out = capsys.readouterr().out
    assert f"profile: steps 2-3 written to {trace.parent}/" in out
    # not a terminal: the plain per-record lines, no live line
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == [
        "1/3", "2/3", "3/3"]
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert names & MATMULS, sorted(n for n in names if n and n.startswith("aten::"))[:40]
    # shapes: a matmul's input dims; memory: allocator events
    mm = [e for e in events if e.get("name") in MATMULS and e.get("args", {}).get("Input Dims")]
    assert mm and any(dims for e in mm for dims in e["args"]["Input Dims"])
    assert any(e.get("name") == "[memory]" for e in events)

    # A failing step inside the loop reaches the out-of-memory hook (CPU: the
    # device is made to look like CUDA, and the snapshot writer is faked).
    trainer = Trainer(load_config(None, [*SMALL, f"run.dir={tmp_path / 'oom'}", "train.steps=2"]))
    dumped = []
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot",
                        lambda path: dumped.append(path) or open(path, "wb").close())

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(trainer, "train_step", oom)
    trainer.profiler.device = torch.device("cuda", 0)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            trainer.train()
    finally:
        trainer.close()
    assert dumped == [str(snapshot_path(tmp_path / "oom", 0))]
    assert "memory_viz" in capsys.readouterr().err


def test_oom_handler_writes_the_snapshot_and_prints_where(tmp_path, monkeypatch, capsys):
    calls = {}
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda **kw: calls.setdefault("history", kw))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot",
                        lambda path: open(path, "wb").write(b"snapshot"))
    cuda = torch.device("cuda", 1)
    prof = StepProfiler(ProfileConfig(memory_history=True), tmp_path, 3, cuda)
    assert calls["history"]["max_entries"] == profile_mod._HISTORY_ENTRIES

    wrapped = RuntimeError("stage 1 failed")
    wrapped.__cause__ = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
    path = prof.on_error(wrapped)
    assert path == tmp_path / "memory-snapshot-rank3.pickle" and path.read_bytes() == b"snapshot"
    err = capsys.readouterr().err
    assert f"rank 3: CUDA out of memory; memory snapshot written to {path}" in err
    assert "https://pytorch.org/memory_viz" in err and "memory_history" not in err

    # without the history the line says how to get allocation stacks
    prof = StepProfiler(ProfileConfig(), tmp_path / "b", 0, cuda)
    assert prof.on_error(torch.OutOfMemoryError("CUDA out of memory")) is not None
    assert "profile.memory_history=true" in capsys.readouterr().err

    # not an OOM, not CUDA, or switched off: nothing is written
    assert prof.on_error(ValueError("bad")) is None
    assert StepProfiler(ProfileConfig(), tmp_path / "c", 0, torch.device("cpu")).on_error(
        torch.OutOfMemoryError("CUDA out of memory")) is None
    assert StepProfiler(ProfileConfig(memory_snapshot_on_oom=False), tmp_path / "d", 0,
                        cuda).on_error(torch.OutOfMemoryError("CUDA out of memory")) is None
    assert not is_oom(ValueError("x")) and is_oom(torch.OutOfMemoryError("y"))
    assert not any((tmp_path / d).exists() for d in ("c", "d"))
