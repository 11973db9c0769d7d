"""One system's ranks, launched once and kept for every rep.

Each rank is its own process, started as torchrun or srun starts one (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR in its environment, one thread), running
its side's script with ``--serve``: it imports its framework once, then reads
commands from its stdin, one JSON object a line::

    {"cases": "dp2-zero1,dp2-zero2", "out": PREFIX, "steps": 20, "profile": true,
     "port": 29512}

and runs the cases in turn, each in a child forked for it
(:func:`workload.run_cases_in_turn`; the child takes MASTER_PORT port + i),
writing PREFIX-<case>.rank<R>, then PREFIX.done.rank<R> with the exit code.

Start-up (4 ranks importing torch, and for DeepSpeed transformers, on 2
cores) was most of the suite's wall time when every rep of every system
launched afresh; no figure includes it either way.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import workload


class RankGroup:
    """``start(**popen_kwargs)`` launches the ranks (rank order) with the given
    Popen arguments; ``summarize(case, per_rank)`` is the side's summary.
    A failed or timed-out command kills the ranks; the next one starts them
    again."""

    def __init__(self, start: Callable[..., list[subprocess.Popen]], summarize,
                 timeout: float):
        self.start, self.summarize, self.timeout = start, summarize, timeout
        self.procs: list[subprocess.Popen] | None = None
        self.log = tempfile.TemporaryFile("w+")

    def run(self, cases: list[workload.Case], out: Path, *, steps: int, profile: bool,
            port: int) -> dict[str, dict]:
        """Each case's figures (the side's summary plus ``command_wall_s``), or
        the command's error with the tail of the ranks' output."""
        if self.procs is None:
            self.procs = self.start(stdin=subprocess.PIPE, stdout=self.log,
                                    stderr=subprocess.STDOUT, text=True)
        names = ",".join(c.name for c in cases)
        line = json.dumps({"cases": names, "out": str(out), "steps": steps,
                           "profile": profile, "port": port})
        t0 = time.perf_counter()
        error = None
        try:
            for p in self.procs:
                p.stdin.write(line + "\n")
                p.stdin.flush()
        except OSError as e:
            error = f"a rank had exited before the command: {e}"
        done = [Path(f"{out}.done.rank{r}") for r in range(len(self.procs))]
        while error is None and not all(f.is_file() for f in done):
            dead = [p.returncode for p in self.procs if p.poll() is not None]
            if dead:
                error = f"a rank exited with {dead[0]}"
            elif time.perf_counter() - t0 > self.timeout:
                error = f"no answer within {self.timeout:.0f} s"
            time.sleep(0.05)
        if error is None:
            codes = [int(f.read_text()) for f in done]
            if any(codes):
                error = f"exit codes {codes}"
        if error is not None:
            error += ": " + self._tail()
            self.close(kill=True)
        extra = {"command_wall_s": time.perf_counter() - t0, "load_avg": workload.load_avg()}
        return {name: r if "error" in r else {**extra, **r} for name, r in workload.collect(
            names, str(out), self.summarize, error or "no output").items()}

    def _tail(self, lines: int = 15) -> str:
        self.log.seek(0)
        tail = "\n".join(self.log.read().strip().splitlines()[-lines:])
        self.log.seek(0, 2)
        return tail

    def close(self, kill: bool = False) -> None:
        """End of input lets the ranks exit; ``kill`` (or a rank that does not
        exit) ends them, and their forked children with them."""
        for p in self.procs or []:
            if kill:
                p.kill()
            elif p.stdin:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for p in self.procs or []:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(kill=exc[0] is not None)
        self.log.close()
