"""The launch scripts on two emulated hosts: scripts/train_multinode.sh and
scripts/slurm_train.sh (srun emulated by scripts/slurm-shim) start a 2-host
run with parallel.placement=auto; it checkpoints, stops, and resumes with the
exact loss sequence; a lost host is named within parallel.timeout_s, and with
MAX_RESTARTS the restarted host's agent resumes the job from its checkpoint.

The fast set launches one small job on two hosts, one rank each; the rest is
``-m slow``."""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from giantmodel.distributed.links import load_topology
from giantmodel.testing.cluster import EmulatedCluster, Link, unavailable_reason

pytestmark = [pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=str(unavailable_reason()))]

REPO = Path(__file__).resolve().parents[1]
# The vocabulary and micro-batch put the placement far from its tipping point:
# 8.7 MB of dp gradients per step against about ten tp all-reduces of 32 KB,
# so a loaded machine's slower probe (larger measured latency) cannot flip it.
TINY = {"model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "ffn_hidden_size": 128, "vocab_size": 16384},
        "train": {"global_batch_size": 8, "micro_batch_size": 4, "seq_len": 32, "log_every": 1,
                  "eval_every": 0, "sample_tokens": 0, "device": "cpu"},
        "parallel": {"tp": 2, "placement": "auto", "timeout_s": 30},
        "checkpoint": {"every": 2}}


def _env(tmp_path: Path, **extra) -> dict:
    return {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GPUS_PER_NODE": "2",
            "GIANTMODEL_CACHE": str(tmp_path / "cache"), "PYTHON": "python3", **extra}


def _config(tmp_path: Path, steps: int) -> list[str]:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return [str(path), f"train.steps={steps}", f"run.dir={tmp_path / 'run'}"]


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _multinode(c, tmp_path, args, host, log, **env):
    env = _env(tmp_path, HEAD_NODE="host0", NNODES="2", **env)
    return c.popen(host, ["bash", str(REPO / "scripts/train_multinode.sh"), *args], env=env,
                   stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.timeout(240)
def test_two_hosts_one_rank_each_train_data_parallel(tmp_path):
    """One torchrun agent per emulated host meets the other by c10d rendezvous;
    the two ranks train dp2 over the shaped link and finish together."""
    path = tmp_path / "tiny.yaml"
    tiny = {**TINY, "parallel": {"timeout_s": 30}, "checkpoint": {"every": 0},
            "model": {**TINY["model"], "vocab_size": 4096}}
    path.write_text(yaml.safe_dump(tiny))
    args = [str(path), "train.steps=2", f"run.dir={tmp_path / 'run'}"]
    with EmulatedCluster(2, link=Link(rate_mbit=1000)) as c, open(tmp_path / "a.log", "w") as log:
        procs = [_multinode(c, tmp_path, args, h, log, GPUS_PER_NODE="1") for h in range(2)]
        codes = c.wait_all(procs, timeout=200)
    out = (tmp_path / "a.log").read_text()
    assert codes == [0, 0], out[-4000:]
    assert sorted(_losses(tmp_path / "run")) == [1, 2], out[-4000:]
    assert "world=2 pp=1 dp=2" in out, out[-4000:]


@pytest.mark.slow
def test_scripts_start_checkpoint_and_resume_exactly(tmp_path):
    args = _config(tmp_path, steps=4)
    run = tmp_path / "run"
    with EmulatedCluster(2, link=Link(rate_mbit=200, delay_ms=1.0)) as c:
        with open(tmp_path / "a.log", "w") as log:
            procs = [_multinode(c, tmp_path, args, h, log) for h in range(2)]
            codes = c.wait_all(procs, timeout=400)
        out_a = (tmp_path / "a.log").read_text()
        assert codes == [0, 0], out_a[-4000:]
        first = _losses(run)
        resolved = yaml.safe_load((run / "config.yaml").read_text())["parallel"]["placement"]
        # torchrun numbers ranks node by node (host0: 0, 1). This tiny model's dp
        # gradients outweigh its tp activations (see TINY), so auto keeps each dp
        # pair on one host and sends tp across: tp groups {0,2}, {1,3}
        assert resolved == [0, 2, 1, 3]
        assert "placement: auto -> [0, 2, 1, 3]" in out_a
        assert "topology: measured 2 hosts" in out_a
        # "stop" after step 2: drop the later checkpoint, relaunch under (emulated) Slurm
        shutil.rmtree(run / "checkpoints" / "step-00000004")
        env = _env(tmp_path, GIANTMODEL_CLUSTER=str(c.state_dir), SLURM_JOB_ID="4242",
                   SLURM_JOB_NODELIST="host[0-1]", SLURM_NNODES="2",
                   PATH=f"{REPO / 'scripts/slurm-shim'}:{os.environ['PATH']}")
        b = c.run(0, ["bash", str(REPO / "scripts/slurm_train.sh"), *args], env=env,
                  timeout=400, cwd=str(tmp_path))
        assert b.returncode == 0, (b.stdout + b.stderr)[-4000:]
    assert "resumed from" in b.stdout and "at step 2" in b.stdout
    assert "topology: cached measurement" in b.stdout
    second = _losses(run)  # metrics.jsonl holds both runs; the later records win
    assert sorted(first) == [1, 2, 3, 4]
    assert [second[s] for s in (3, 4)] == [first[s] for s in (3, 4)]
    # the start-up measurement (cached per host set) saw the shaped link
    (cached,) = (tmp_path / "cache" / "topology").glob("*.yaml")
    topo = load_topology(cached)
    assert topo.host_names == ["host0", "host1"] and topo.host_ranks == [[0, 1], [2, 3]]
    # what the shaped link guarantees: its rate bounds the measured cross-host
    # bandwidth from above, its 1 ms delay the latency from below. How close a
    # loaded machine comes to the rate, and how fast a host answers on its own
    # (unshaped) link, are not asserted; only that the probe tells the two apart
    assert topo.beta[0, 2] * 8 / 1e6 <= 1.25 * 200, topo.beta[0, 2]
    assert topo.beta[0, 1] > 2 * topo.beta[0, 2], (topo.beta[0, 1], topo.beta[0, 2])
    assert topo.alpha[0, 2] >= 1e-3, topo.alpha[0, 2]


@pytest.mark.slow
def test_lost_host_is_named_and_a_restarted_agent_resumes(tmp_path):
    args = _config(tmp_path, steps=8)
    run = tmp_path / "run"
    with EmulatedCluster(2, link=Link(rate_mbit=1000)) as c, \
            open(tmp_path / "h0.log", "w") as log0, open(tmp_path / "h1.log", "w") as log1:
        agents = [_multinode(c, tmp_path, args, h, log, MAX_RESTARTS="1")
                  for h, log in ((0, log0), (1, log1))]
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "step-00000002").is_dir():
            assert time.monotonic() < deadline, (tmp_path / "h0.log").read_text()[-3000:]
            assert agents[0].poll() is None, (tmp_path / "h0.log").read_text()[-3000:]
            time.sleep(0.2)
        killed = time.monotonic()
        c.kill_host(1)
        while "lost contact with host host1" not in (tmp_path / "h0.log").read_text():
            assert time.monotonic() - killed < TINY["parallel"]["timeout_s"], \
                (tmp_path / "h0.log").read_text()[-3000:]
            time.sleep(0.2)
        agents.append(_multinode(c, tmp_path, args, 1, log1, MAX_RESTARTS="1"))
        codes = c.wait_all([agents[0], agents[2]], timeout=400)
    out = (tmp_path / "h0.log").read_text()
    assert codes == [0, 0], out[-4000:]
    assert "(ranks [2, 3], 10.50.0.2)" in out
    assert "resumed from" in out and max(_losses(run)) == 8
