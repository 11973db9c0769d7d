"""Metrics sinks: run.dir/metrics.jsonl, the experiment trackers, and a terminal progress line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from giantmodel.config.loader import to_dict
from giantmodel.metrics.progress import Progress
from giantmodel.metrics.trackers import Trackers


def peak_memory(device: torch.device, reset: bool = True) -> dict[str, float]:
    """This process's peak memory, in GiB, for a metrics record.

    CUDA: the caching allocator's peak allocated and reserved bytes since
    the last reset (``reset`` starts the next window: a record then shows
    the peak of the steps since the previous record). CPU: the peak resident
    set size of the process so far (``ru_maxrss``; it cannot be reset).
    Host-side reads only: no device synchronisation."""
    if device.type == "cuda":
        out = {"mem_max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
               "mem_max_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return out
    try:
        import resource
    except ImportError:  # not on Unix
        return {}
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return {"mem_peak_rss_gb": kib / (2**30 if sys.platform == "darwin" else 2**20)}


def format_memory(record: dict) -> str:
    """The memory part of a progress line: peak allocated/reserved on CUDA
    (e.g. ' mem 12.3/14.0 GB'), peak RSS on a CPU; empty without the fields."""
    if "mem_max_allocated_gb" in record:
        return f" mem {record['mem_max_allocated_gb']:.1f}/{record['mem_max_reserved_gb']:.1f} GB"
    if "mem_peak_rss_gb" in record:
        return f" rss {record['mem_peak_rss_gb']:.1f} GB"
    return ""


class MetricsLogger:
    """Writes on rank 0 only; every other rank gets a logger that does nothing.

    Each record goes to run.dir/metrics.jsonl and to the run's trackers
    (run.loggers: TensorBoard, W&B, MLflow; see :mod:`giantmodel.metrics.trackers`)."""

    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool | list[str] = True,
                 progress: bool = True, total_steps: int = 0, config: dict | None = None,
                 implicit: bool | None = None):
        """``tensorboard``: the trackers' names, or a bool for [tensorboard] /
        none (the old signature). ``implicit``: the list is the default one,
        so a missing package is no warning (default: when a bool is given)."""
        self.enabled = enabled
        self.total_steps = total_steps
        self._jsonl = None
        self.trackers: Trackers | None = None
        self._progress = Progress(total_steps, enabled=progress and enabled)
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        names = tensorboard if isinstance(tensorboard, list) else (
            ["tensorboard"] if tensorboard else [])
        implicit = isinstance(tensorboard, bool) if implicit is None else implicit
        self.trackers = Trackers(names, run_dir, config or {}, implicit=implicit)

    @classmethod
    def for_job(cls, cfg, enabled: bool) -> MetricsLogger:
        """The logger of a JobConfig's run: its trackers, progress and config."""
        return cls(cfg.run.dir, enabled, cfg.run.trackers(), cfg.run.progress, cfg.train.steps,
                   config=to_dict(cfg), implicit=cfg.run.loggers is None)

    @property
    def live(self) -> bool:
        """Whether a live progress line replaces the plain per-record lines."""
        return self._progress.live

    def start(self, step: int) -> None:
        self._progress.start(step)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self.trackers.log(record)

    def log_text(self, key: str, text: str, step: int) -> None:
        """Free text for the trackers (a generated sample after training)."""
        if self.enabled:
            self.trackers.log_text(key, text, step)

    def progress(self, step: int, text: str) -> None:
        """The live progress line on a terminal: step, ETA, and ``text``."""
        self._progress.update(step, text)

    def close(self) -> None:
        self._progress.close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self.trackers is not None:
            self.trackers.close()
