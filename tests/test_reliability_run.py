"""The run directory (failure modes 14, 15, 16), through the real CLI.

- 15: a run.dir that cannot be created or written is one ``error:`` line
  naming run.dir, exit 2, before any process group, and nothing is created.
- 14: a second run in a run.dir that a live run holds fails at once on the
  lock file, naming the first run's pid and host, and writes nothing there.
- 16: SIGTERM (what Slurm sends before a kill) lets the step finish, writes
  a checkpoint at that step and exits 0; the lock goes with the process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from giantmodel.checkpoint.layout import read_latest, step_dirname
from giantmodel.checkpoint.run_dir import LOCK_NAME
from giantmodel.cli import main

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=128", "model.vocab_size=256", "model.max_seq_len=64",
         "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=4",
         "data.source=synthetic", "train.sample_tokens=0", "train.eval_every=0",
         "train.log_every=1", "run.tensorboard=false", "run.progress=false"]


def _train(args: list[str], capsys) -> tuple[int, str]:
    code = main(["train", *SMALL, *args])
    return code, capsys.readouterr().err.strip()


def _one_error_line(err: str, *fragments: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def no_process_group(monkeypatch):
    import giantmodel.train.trainer as trainer

    def refuse(*args, **kwargs):
        raise AssertionError("a process group was created for a run that must be refused")

    monkeypatch.setattr(trainer, "init_distributed", refuse)


def _unwritable_parents(tmp_path: Path) -> list[tuple[str, Path]]:
    afile = tmp_path / "a-file"
    afile.write_text("x")
    cases = [("parent is a file", afile / "run"), ("run.dir is a file", afile)]
    # /proc/self refuses new entries even to root, so this case runs everywhere
    if Path("/proc/self").is_dir() and not os.access("/proc/self", os.W_OK):
        cases.append(("read-only parent (/proc/self)", Path("/proc/self/giantmodel-run/x")))
    if os.geteuid() != 0:  # root may write into a 0o555 directory
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        cases.append(("read-only parent (mode 555)", ro / "run"))
    return cases


def test_unwritable_run_dir_fails_before_any_process_group(tmp_path, capsys, no_process_group):
    cases = _unwritable_parents(tmp_path)
    assert len(cases) >= 3
    for label, run in cases:
        code, err = _train([f"run.dir={run}"], capsys)
        assert code == 2, (label, err)
        _one_error_line(err, "run.dir")
        assert not run.is_dir(), label


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}:\n"
                                 f"{proc.stderr.read().decode()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    # Read while the trainer appends: only whole lines (ending in a newline).
    text = path.read_text()
    recs = [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines() if x.strip()]
    return [r["step"] for r in recs if "loss" in r]


@pytest.mark.timeout(180)
def test_second_run_fails_on_the_lock_and_sigterm_checkpoints_and_exits_cleanly(tmp_path, capsys):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "giantmodel", "train", *SMALL, f"run.dir={run}",
         "train.steps=100000", "checkpoint.every=100000", "train.threads=1"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_for(lambda: len(_steps(run)) >= 2, first, "the first steps")

        # mode 14: the second run fails at once, naming the first's pid and host
        before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != "metrics.jsonl"}
        t0 = time.monotonic()
        code, err = _train([f"run.dir={run}", "train.steps=3"], capsys)
        assert code == 2, err
        _one_error_line(err, "run.dir", f"pid {first.pid}", socket.gethostname(), LOCK_NAME)
        assert time.monotonic() - t0 < 30
        after = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != "metrics.jsonl"}
        assert after == before, "the refused run wrote into the first run's directory"

        # mode 16: SIGTERM finishes the step, checkpoints it, exits 0
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
        stderr = first.stderr.read().decode()
        assert first.returncode == 0, stderr[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    last = _steps(run)[-1]
    assert last < 100000
    assert read_latest(run / "checkpoints") == last
    assert (run / "checkpoints" / step_dirname(last)).is_dir()

    # the lock went with the process: a new run in the same dir resumes from it
    code, err = _train([f"run.dir={run}", f"train.steps={last + 1}", "train.threads=1"], capsys)
    assert code == 0, err
    assert _steps(run)[-1] == last + 1
