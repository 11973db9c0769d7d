"""A link that goes down is named like a host that dies: two emulated hosts,
one rank each, train data-parallel; host1's link is cut (both processes stay
alive) mid-step, or mid-save. Each rank must end, within
``parallel.timeout_s`` + 30 s, on one line that names the other host as lost,
with no traceback after it; a restart with the link back resumes exactly.

Ranks are started one process per host, as srun does, so that each log is
the giantmodel process's own (torchrun's agent adds its own report of a
failed worker). ``-m slow``: each case takes about a minute."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from giantmodel.testing.cluster import EmulatedCluster, Link, unavailable_reason

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=str(unavailable_reason()))]

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 20
EVERY = 4
TINY = {"model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "ffn_hidden_size": 128, "vocab_size": 16384},
        "train": {"global_batch_size": 8, "micro_batch_size": 4, "seq_len": 32, "log_every": 1,
                  "eval_every": 0, "sample_tokens": 0, "device": "cpu", "steps": 40},
        "parallel": {"timeout_s": TIMEOUT_S},
        "checkpoint": {"every": EVERY}}


def _start(c: EmulatedCluster, tmp_path: Path, tag: str, port: int) -> list:
    """Rank r on host r, as srun starts them, each with its own log."""
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    argv = [sys.executable, "-m", "giantmodel", "train", "--config", str(tmp_path / "tiny.yaml"),
            f"run.dir={tmp_path / 'run'}"]
    procs = []
    for r in range(2):
        env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               "GIANTMODEL_CACHE": str(tmp_path / "cache"), "RANK": str(r), "WORLD_SIZE": "2",
               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "host0",
               "MASTER_PORT": str(port)}
        with open(tmp_path / f"{tag}-rank{r}.log", "w") as log:
            procs.append(c.popen(r, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    # Read while the trainer appends: only whole lines (ending in a newline).
    text = path.read_text()
    return [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines() if x.strip()]


def _losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _wait_for(cond, procs, what: str, limit: float = 240.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in procs), f"a rank exited before {what}"
        time.sleep(0.01)


def _ended(procs, since: float, limit: float) -> list[tuple[int, float]]:
    """Each process's exit status and when it exited, in seconds after ``since``."""
    done: dict[int, tuple[int, float]] = {}
    while len(done) < len(procs) and time.monotonic() - since < limit:
        for i, p in enumerate(procs):
            if i not in done and p.poll() is not None:
                done[i] = (p.returncode, time.monotonic() - since)
        time.sleep(0.1)
    return [done.get(i, (None, limit)) for i in range(len(procs))]


def _check_diagnosis(log: str, other: int, ranks: str, phase, ended: tuple) -> None:
    """The rank's log ends on one line naming host ``other`` as lost, said in
    time, after a non-zero exit, with no traceback after it."""
    lines = [x for x in log.splitlines() if x.strip()]
    code, seconds = ended
    assert code not in (None, 0), (ended, log[-3000:])
    assert seconds < TIMEOUT_S + 30, (ended, log[-3000:])
    last = lines[-1] if lines else ""
    assert last.startswith("error: ") and \
        f"lost contact with host host{other} ({ranks}, 10.50.0.{other + 1})" in last, log[-3000:]
    first = next(i for i, x in enumerate(lines) if "lost contact with host" in x)
    assert not any("Traceback" in x for x in lines[first:]), log[-3000:]
    assert phase(last), last


def _hold_while(c: EmulatedCluster, cut_when, run: Path, procs) -> None:
    """Stop host1's processes inside a moment that ``cut_when`` names and that
    rank 0 cannot leave alone. A save is far shorter than the poll's reaction
    on a fast disk, and a held rank 1 keeps rank 0 inside it only before
    rank 1's last part in it: once rank 1 has sent its checksums, rank 0
    commits the save by itself. So hold, give rank 0 time to do so, and if
    the moment is gone, let host1 go on and take the next one."""
    while True:
        _wait_for(lambda: cut_when(run), procs, "the moment to cut")
        c.kill_host(1, signal.SIGSTOP)
        time.sleep(2.0)
        if cut_when(run):
            return
        c.kill_host(1, signal.SIGCONT)


def _cut_and_restart(tmp_path: Path, cut_when, phase, hold: bool = False) -> None:
    """Cut host1's link when ``cut_when`` holds; ``hold``: inside a moment
    host1 is held in (:func:`_hold_while`), letting it run on after the cut."""
    run = tmp_path / "run"
    with EmulatedCluster(2, link=Link(rate_mbit=1000)) as c:
        procs = _start(c, tmp_path, "a", port=29510)
        if hold:
            _hold_while(c, cut_when, run, procs)
        else:
            _wait_for(lambda: cut_when(run), procs, "the moment to cut")
        cut = time.monotonic()
        c.cut_link(1)
        if hold:
            c.kill_host(1, signal.SIGCONT)
        ended = _ended(procs, cut, TIMEOUT_S + 60)
        c.restore_link(1)
        logs = [(tmp_path / f"a-rank{r}.log").read_text() for r in range(2)]
        _check_diagnosis(logs[0], 1, "ranks [1]", phase, ended[0])
        _check_diagnosis(logs[1], 0, "ranks [0]", phase, ended[1])
        rows = _rows(run)
        before = _losses(rows)
        resumed_from = max(s for s in range(0, TINY["train"]["steps"] + 1, EVERY)
                           if s == 0 or (run / "checkpoints" / f"step-{s:08d}").is_dir())
        procs = _start(c, tmp_path, "b", port=29520)
        codes = c.wait_all(procs, timeout=300)
        out_b = (tmp_path / "b-rank0.log").read_text()
        assert codes == [0, 0], out_b[-4000:]
    assert f"at step {resumed_from}" in out_b, out_b[-3000:]
    after = _losses(_rows(run)[len(rows):])
    again = [s for s in before if s > resumed_from]
    assert again, (resumed_from, sorted(before))
    assert [after[s] for s in again] == [before[s] for s in again]
    assert max(after) == TINY["train"]["steps"]


def _step_past_checkpoint(run: Path) -> bool:
    """A step or two past a checkpoint, so the restart repeats at least one
    step that the cut run logged."""
    steps = _losses(_rows(run))
    top = max(steps, default=0)
    return top > EVERY and top % EVERY in (1, 2) and top < TINY["train"]["steps"] - 4


def _save_started(run: Path) -> bool:
    """A save under way (its ``.tmp`` directory exists) after a committed
    checkpoint, so the restart has one to resume from."""
    ckpts = run / "checkpoints"
    if not ckpts.is_dir():
        return False
    # Only step directories count: the ``latest`` marker is also written
    # through a ``.latest.tmp`` file, which names no step.
    saving = (re.fullmatch(r"step-(\d+)\.tmp", p.name) for p in ckpts.iterdir())
    return any(m is not None and int(m.group(1)) >= 2 * EVERY for m in saving)


@pytest.mark.timeout(600)
def test_link_cut_mid_step_names_the_host_and_a_restart_resumes(tmp_path):
    _cut_and_restart(tmp_path, _step_past_checkpoint,
                     lambda line: "waited in step " in line and "checkpoint save" not in line)


@pytest.mark.timeout(600)
def test_link_cut_mid_save_names_the_host_and_a_restart_resumes(tmp_path):
    _cut_and_restart(tmp_path, _save_started, lambda line: "checkpoint save" in line, hold=True)
