"""Experiment trackers (run.loggers): failures never stop training; W&B offline
and a local MLflow store hold every logged step, and a resumed run continues both."""

import io
import json
import logging
import shutil
import subprocess
import sys

import pytest

from giantmodel.config import ConfigError, load_config
from giantmodel.metrics import trackers as trackers_mod
from giantmodel.metrics.logger import MetricsLogger
from giantmodel.metrics.trackers import Tracker, Trackers, flatten

SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=128", "model.vocab_size=256", "model.max_seq_len=64",
         "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=4",
         "data.source=synthetic", "train.log_every=1", "train.sample_tokens=0",
         "train.eval_every=0", "optim.warmup_steps=2", "run.progress=false"]


class Recorder(Tracker):
    name = "recorder"
    made: list = []

    def __init__(self, run_dir, config):
        self.rows, self.texts = [], []
        Recorder.made.append(self)

    def log(self, record, step):
        self.rows.append((step, record["loss"]))

    def log_text(self, key, text, step):
        self.texts.append((key, text, step))


class Broken(Tracker):
    name = "broken"

    def __init__(self, run_dir, config):
        pass

    def log(self, record, step):
        raise ConnectionError("no network")


def test_loggers_config_default_alias_and_names():
    assert load_config(None, []).run.trackers() == ["tensorboard"]
    assert load_config(None, ["run.tensorboard=false"]).run.trackers() == []
    cfg = load_config(None, ["run.loggers=[wandb,mlflow,wandb]", "run.tensorboard=false"])
    assert cfg.run.trackers() == ["wandb", "mlflow"]  # run.loggers decides alone
    with pytest.raises(ConfigError, match="run.loggers"):
        load_config(None, ["run.loggers=[neptune]"])
    assert flatten({"train": {"steps": 3, "x": None}, "seed": 1}) == {
        "train.steps": "3", "train.x": "None", "seed": "1"}


def test_failing_tracker_warns_once_and_the_others_go_on(tmp_path, monkeypatch, caplog):
    Recorder.made = []
    monkeypatch.setitem(trackers_mod.TRACKERS, "wandb", Broken)
    monkeypatch.setitem(trackers_mod.TRACKERS, "mlflow", Recorder)
    logger = MetricsLogger(tmp_path, True, ["wandb", "mlflow"], progress=False)
    with caplog.at_level(logging.WARNING, logger="giantmodel"):
        for step in (1, 2, 3):
            logger.log({"step": step, "loss": 1.0 / step})
    logger.log_text("samples", "def f():", 3)
    logger.close()
    warned = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert len(warned) == 1 and "no network" in warned[0] and "training goes on" in warned[0]
    (rec,) = Recorder.made
    assert rec.rows == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert rec.texts == [("samples", "def f():", 3)]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_missing_package_and_failed_start_warn_only_when_asked(tmp_path, monkeypatch, caplog):
    class Missing(Tracker):
        def __init__(self, run_dir, config):
            raise ImportError("No module named 'wandb'")

    class BadKey(Tracker):
        def __init__(self, run_dir, config):
            raise PermissionError("API key rejected")

    monkeypatch.setitem(trackers_mod.TRACKERS, "wandb", Missing)
    monkeypatch.setitem(trackers_mod.TRACKERS, "mlflow", BadKey)
    with caplog.at_level(logging.WARNING, logger="giantmodel"):
        assert Trackers(["wandb"], tmp_path, {}, implicit=True).names == []
        assert not caplog.records  # the default list: a missing package is no news
        assert Trackers(["wandb", "mlflow"], tmp_path, {}).names == []
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "pip install wandb" in text and "API key rejected" in text


def test_only_rank0_builds_trackers(tmp_path, monkeypatch):
    Recorder.made = []
    monkeypatch.setitem(trackers_mod.TRACKERS, "wandb", Recorder)
    logger = MetricsLogger(tmp_path / "r1", False, ["wandb"], progress=False)
    logger.log({"step": 1, "loss": 1.0})
    logger.close()
    assert Recorder.made == [] and not (tmp_path / "r1").exists()


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_live_only_on_a_terminal(tmp_path, monkeypatch):
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a log file: plain lines
    logger = MetricsLogger(tmp_path, True, [], progress=True, total_steps=4)
    assert not logger.live
    logger.start(0)
    logger.progress(1, "loss 2.0")
    assert err.getvalue() == ""
    logger.close()

    monkeypatch.setattr(sys, "stdout", Terminal())
    monkeypatch.setitem(sys.modules, "tqdm", None)  # no tqdm: the plain \r line
    logger = MetricsLogger(tmp_path, True, [], progress=True, total_steps=4)
    assert logger.live
    logger.start(0)
    logger.progress(2, "loss 2.0 1,000 tokens/s")
    logger.close()
    assert err.getvalue().startswith("\r[2/4] loss 2.0 1,000 tokens/s eta ")
    assert not MetricsLogger(tmp_path, False, [], progress=True).live  # not rank 0

    monkeypatch.delitem(sys.modules, "tqdm")
    pytest.importorskip("tqdm")
    err.seek(0), err.truncate()
    logger = MetricsLogger(tmp_path, True, [], progress=True, total_steps=4)
    logger.start(1)
    logger.progress(3, "loss 1.5")
    logger.close()
    assert "3/4" in err.getvalue() and "loss 1.5" in err.getvalue()


def _wandb_history(wandb_dir) -> list[dict]:
    """Every history row of every offline run under ``wandb_dir``, read by
    W&B's own reader of its .wandb transaction logs (``wandb leet inspect``)."""
    exe = shutil.which("wandb") or pytest.skip("no wandb command")
    rows = []
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        out = subprocess.run([exe, "leet", "inspect", "--json", str(path)], capture_output=True,
                             text=True, timeout=60)
        if out.returncode != 0:
            pytest.skip(f"this wandb cannot read its logs back: {out.stderr.strip()[:200]}")
        for line in out.stdout.splitlines():
            rec = json.loads(line)
            if rec.get("type") == "run":
                rows.append({"run_id": rec["run"]["run_id"]})
            elif rec.get("type") == "history":
                rows.append(rec["history"]["item"])
    return rows


@pytest.mark.slow  # ~10 s: two runs, two W&B starts and two reads of its logs
@pytest.mark.timeout(240)
def test_wandb_offline_and_mlflow_file_store_hold_every_step_and_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from giantmodel.train.trainer import Trainer, run_training

    wandb_dir, store = tmp_path / "wb", tmp_path / "mlruns"
    wandb_dir.mkdir()
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir),
                       "WANDB_PROJECT": "giantmodel-test", "WANDB_SILENT": "true",
                       "WANDB_CONSOLE": "off", "MLFLOW_TRACKING_URI": store.as_uri()}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    run = tmp_path / "run"
    base = [*SMALL, f"run.dir={run}", "run.loggers=[wandb,mlflow]", "checkpoint.every=3"]
    run_training(load_config(None, [*base, "train.steps=3"]))
    ids = {name: (run / name).read_text().strip() for name in ("wandb_run_id", "mlflow_run_id")}
    # resumed from step 3's checkpoint, to step 5, with a sample at the end
    trainer = Trainer(load_config(None, [*base, "train.steps=5"]))
    try:
        trainer.train()
        # what run_training does with the sample (synthetic data has no tokenizer to make one)
        trainer.metrics.log_text("samples", "def f(): pass", trainer.state.step)
    finally:
        trainer.close()
    assert {name: (run / name).read_text().strip() for name in ids} == ids

    losses = {r["step"]: r["loss"] for r in
              (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(losses) == [1, 2, 3, 4, 5]

    client = MlflowClient(tracking_uri=store.as_uri())
    history = client.get_metric_history(ids["mlflow_run_id"], "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]  # one value per step
    assert all(m.value == pytest.approx(losses[m.step]) for m in history)
    mlrun = client.get_run(ids["mlflow_run_id"])
    assert mlrun.data.params["train.seq_len"] == "32" and mlrun.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(ids["mlflow_run_id"], "samples")] == [
        "samples/step-00000005.txt"]

    rows = _wandb_history(wandb_dir)
    assert {r["run_id"] for r in rows if "run_id" in r} == {ids["wandb_run_id"]}
    assert len([r for r in rows if "run_id" in r]) == 2  # two offline fragments, one run
    wb_losses = [(r["_step"], r["loss"]) for r in rows if "loss" in r]
    assert [s for s, _ in wb_losses] == [1, 2, 3, 4, 5]
    assert all(v == pytest.approx(losses[s]) for s, v in wb_losses)
    assert any(k.startswith("samples") for r in rows for k in r)  # the sample's table


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
