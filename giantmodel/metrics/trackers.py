"""Experiment trackers behind one small interface: TensorBoard, Weights & Biases, MLflow.

Each tracker is optional (its package is an extra) and fallible: a tracker
that cannot import, start or write (no network, a bad key, a full disk) warns
once and is dropped, and training goes on. Only rank 0 builds trackers.

A resumed run continues the same W&B and MLflow runs: each tracker stores its
run id in the run directory the first time and reads it back on resume.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("giantmodel")

WANDB_ID_FILE = "wandb_run_id"
MLFLOW_ID_FILE = "mlflow_run_id"
_MLFLOW_PARAMS_PER_BATCH = 100  # MLflow's log_batch limit
_MLFLOW_PARAM_CHARS = 6000  # MLflow's param value limit


class Tracker:
    """One sink for metrics records, text and the config."""

    name = "tracker"

    def log(self, record: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def log_text(self, key: str, text: str, step: int) -> None:
        """Free text (a generated sample); trackers without a text view ignore it."""

    def close(self) -> None:
        pass


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics record, ``step`` aside (bools count as 0/1)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float))}


def _stored_id(run_dir: Path, name: str) -> str | None:
    try:
        return (run_dir / name).read_text().strip() or None
    except OSError:
        return None


def _new_run_id() -> str:
    """Eight lowercase letters and digits, as W&B's own ids."""
    import secrets
    import string
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"train": {"steps": 3}}`` -> ``{"train.steps": "3"}``: MLflow params are flat strings."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = str(value)[:_MLFLOW_PARAM_CHARS]
    return out


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter
        self._writer = SummaryWriter(str(run_dir / "tb"))

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in _scalars(record).items():
            self._writer.add_scalar(key, value, step)

    def log_text(self, key: str, text: str, step: int) -> None:
        self._writer.add_text(key, text, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker(Tracker):
    """A W&B run named after run.dir. WANDB_MODE, WANDB_PROJECT, WANDB_DIR and
    WANDB_RUN_ID are honoured; without WANDB_DIR its files go under run.dir."""

    name = "wandb"

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        import wandb
        run_id = (os.environ.get("WANDB_RUN_ID") or _stored_id(run_dir, WANDB_ID_FILE)
                  or _new_run_id())
        self._wandb = wandb
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "giantmodel"),
            name=run_dir.resolve().name, id=run_id, resume="allow", config=config,
            dir=os.environ.get("WANDB_DIR") or str(run_dir))
        (run_dir / WANDB_ID_FILE).write_text(self._run.id + "\n")
        self._texts: list[list] = []

    def log(self, record: dict[str, Any], step: int) -> None:
        self._run.log(_scalars(record), step=step)

    def log_text(self, key: str, text: str, step: int) -> None:
        # a Table logged again with every row so far: W&B shows the newest table
        self._texts.append([step, text])
        table = self._wandb.Table(columns=["step", "text"], data=list(self._texts))
        self._run.log({key: table}, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in experiment MLFLOW_EXPERIMENT_NAME (default
    "giantmodel") at MLFLOW_TRACKING_URI (default a file store in
    run.dir/mlruns, which needs no server)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir.resolve() / "mlruns").as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 refuses file stores unless asked; the user asked by
            # naming one (or by not naming a server).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(tracking_uri=uri)
        run_id = os.environ.get("MLFLOW_RUN_ID") or _stored_id(run_dir, MLFLOW_ID_FILE)
        if run_id:
            client.update_run(run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "giantmodel")
            exp = client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp else client.create_experiment(name)
            run_id = client.create_run(exp_id, run_name=run_dir.resolve().name).info.run_id
            params = [Param(k, v) for k, v in flatten(config).items()]
            for i in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
                client.log_batch(run_id, params=params[i:i + _MLFLOW_PARAMS_PER_BATCH])
        self._run_id = run_id
        (run_dir / MLFLOW_ID_FILE).write_text(run_id + "\n")

    def log(self, record: dict[str, Any], step: int) -> None:
        import time

        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in _scalars(record).items()]
        if metrics:
            self._client.log_batch(self._run_id, metrics=metrics)

    def log_text(self, key: str, text: str, step: int) -> None:
        self._client.log_text(self._run_id, text, f"{key}/step-{step:08d}.txt")

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


TRACKERS: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
_EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}


class Trackers:
    """Every tracker a run asked for; a failing one warns once and is dropped."""

    def __init__(self, names: list[str], run_dir: str | Path, config: dict[str, Any],
                 implicit: bool = False):
        """``implicit``: the list is the default, not the user's: a missing
        package then drops the tracker silently."""
        self.active: list[Tracker] = []
        run_dir = Path(run_dir)
        for name in names:
            try:
                self.active.append(TRACKERS[name](run_dir, config))
            except ImportError as e:
                if not implicit:
                    log.warning("run.loggers: %s is not installed (%s); pip install %s "
                                "(or giantmodel[track]). Training goes on without it",
                                name, e, _EXTRA[name])
            except Exception as e:  # a tracker must never stop training
                log.warning("run.loggers: %s could not start (%s: %s); training goes on "
                            "without it", name, type(e).__name__, e)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.active]

    def _each(self, what: str, *args) -> None:
        for tracker in list(self.active):
            try:
                getattr(tracker, what)(*args)
            except Exception as e:
                self.active.remove(tracker)
                log.warning("run.loggers: %s failed in %s (%s: %s); it is off for the rest "
                            "of the run, training goes on", tracker.name, what,
                            type(e).__name__, e)

    def log(self, record: dict[str, Any]) -> None:
        self._each("log", record, int(record.get("step", 0)))

    def log_text(self, key: str, text: str, step: int) -> None:
        self._each("log_text", key, text, step)

    def close(self) -> None:
        self._each("close")
        self.active = []
