"""profile.steps: a torch.profiler window as a Chrome trace per rank, and a
CUDA memory snapshot when a step runs out of device memory."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

log = logging.getLogger("giantmodel")

MEMORY_VIZ = "https://pytorch.org/memory_viz"
# Allocation events kept by the memory history: the newest 100k are what led
# to an out-of-memory error; the ring buffer bounds the host memory it holds.
_HISTORY_ENTRIES = 100_000


def trace_path(run_dir: str | Path, rank: int, steps: list[int]) -> Path:
    return Path(run_dir) / "profile" / f"rank{rank}-steps{steps[0]}-{steps[1]}.trace.json"


def snapshot_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"memory-snapshot-rank{rank}.pickle"


def is_oom(error: BaseException | None) -> bool:
    """A CUDA out-of-memory error, also when another error wraps it (a
    pipeline schedule or a worker thread re-raising it)."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, torch.OutOfMemoryError) or "CUDA out of memory" in str(error):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


class StepProfiler:
    """Wraps the training loop's steps: :meth:`before_step` / :meth:`after_step`
    around each, :meth:`on_error` when the loop fails, :meth:`close` at the end.

    The window starts before step ``first`` and is exported after step
    ``last`` (a resumed run past the window records nothing). Shapes and
    memory are recorded, stacks are not: with stacks a step's trace grows
    tenfold and takes minutes to export on a large model."""

    def __init__(self, cfg, run_dir: str | Path, rank: int, device: torch.device,
                 announce=None):
        """``cfg``: the job's ProfileConfig; ``announce``: prints a line on rank 0."""
        self.cfg, self.run_dir, self.rank, self.device = cfg, Path(run_dir), rank, device
        self._announce = announce or (lambda text: None)
        self._prof = None
        if device.type == "cuda" and cfg.memory_history:
            # Before the first allocation of the model, so the snapshot shows
            # every live block's stack.
            torch.cuda.memory._record_memory_history(max_entries=_HISTORY_ENTRIES)

    def before_step(self, step: int) -> None:
        """``step``: the step about to run (the first is 1)."""
        if self.cfg.steps is None or self._prof is not None or step != self.cfg.steps[0]:
            return
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._prof.__enter__()

    def after_step(self, step: int) -> None:
        if self._prof is not None and step >= self.cfg.steps[1]:
            self._export()

    def _export(self) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        path = trace_path(self.run_dir, self.rank, self.cfg.steps)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        first, last = self.cfg.steps
        self._announce(f"profile: steps {first}-{last} written to {path.parent}/ (one trace per "
                       "rank; open one in https://ui.perfetto.dev or chrome://tracing)")

    def on_error(self, error: BaseException) -> Path | None:
        """After a failed step: on CUDA out-of-memory, write the allocator's
        snapshot next to the run and say how to view it. Returns its path."""
        self.close(export=False)
        if not (self.cfg.memory_snapshot_on_oom and self.device.type == "cuda"
                and is_oom(error)):
            return None
        path = snapshot_path(self.run_dir, self.rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
        except Exception as e:  # a failed diagnosis must not hide the OOM itself
            log.warning("could not write the memory snapshot to %s: %s", path, e)
            return None
        history = ("" if self.cfg.memory_history else
                   "; set profile.memory_history=true to see each block's allocation stack")
        print(f"error: rank {self.rank}: CUDA out of memory; memory snapshot written to {path}: "
              f"drop it on {MEMORY_VIZ} to see what held the memory{history}",
              file=sys.stderr, flush=True)
        return path

    def close(self, export: bool = True) -> None:
        """End an open window (the run stopped inside it): export what it has."""
        if self._prof is None:
            return
        if export:
            self._export()
        else:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
