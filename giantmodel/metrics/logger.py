"""Metrics sinks: run.dir/metrics.jsonl, TensorBoard, and a terminal progress line."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


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
    """Writes on rank 0 only; every other rank gets a logger that does nothing."""

    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool = True,
                 progress: bool = True, total_steps: int = 0):
        self.enabled = enabled
        self.total_steps = total_steps
        self._jsonl = None
        self._tb = None
        self._start = time.perf_counter()
        self._start_step = 0
        self._progress = progress and enabled and sys.stderr.isatty()
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(run_dir / "tb"))
            except ImportError:
                self._tb = None  # tensorboard is optional

    def start(self, step: int) -> None:
        self._start, self._start_step = time.perf_counter(), step

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step = record.get("step", 0)
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)

    def progress(self, step: int, text: str) -> None:
        """One self-overwriting line on a terminal: step, ETA, and ``text``."""
        if not self._progress:
            return
        done = step - self._start_step
        elapsed = time.perf_counter() - self._start
        eta = elapsed / done * (self.total_steps - step) if done else float("nan")
        sys.stderr.write(f"\r[{step}/{self.total_steps}] {text} eta {format_duration(eta)}   ")
        sys.stderr.flush()
        if step >= self.total_steps:
            sys.stderr.write("\n")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
