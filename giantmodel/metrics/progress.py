"""The live progress line: step, ETA, tokens/s and loss on a terminal.

Live only when both stdout and stderr are terminals: a job whose output goes
to a log file (nohup, Slurm's batch output, CI) gets the plain per-record
lines instead, since a self-overwriting line turns into thousands of ``\\r``
fragments in a file. tqdm draws the line when it is installed; otherwise a
plain ``\\r`` line does.
"""

from __future__ import annotations

import math
import sys
import time


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def on_terminal() -> bool:
    try:
        return sys.stdout.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


class Progress:
    """One self-overwriting line on stderr, or nothing when not :attr:`live`."""

    def __init__(self, total_steps: int, enabled: bool = True):
        self.total_steps = total_steps
        self.live = enabled and on_terminal()
        self._bar = None
        self._start, self._start_step = time.perf_counter(), 0

    def start(self, step: int) -> None:
        self._start, self._start_step = time.perf_counter(), step
        if not self.live:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=self.total_steps, initial=step, file=sys.stderr, unit="step",
                         dynamic_ncols=True, leave=True)

    def update(self, step: int, text: str) -> None:
        if not self.live:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(step - self._bar.n)  # redraws, with tqdm's ETA
            return
        done = step - self._start_step
        elapsed = time.perf_counter() - self._start
        eta = elapsed / done * (self.total_steps - step) if done else float("nan")
        sys.stderr.write(f"\r[{step}/{self.total_steps}] {text} eta {format_duration(eta)}   ")
        sys.stderr.flush()
        if step >= self.total_steps:
            sys.stderr.write("\n")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
