"""Shared pieces of the emulated-cluster benchmarks: launch one process per
rank on emulated hosts, collect each rank's JSON, record the conditions."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from giantmodel.testing.cluster import EmulatedCluster

REPO = Path(__file__).resolve().parents[2]


def run_workers(cluster: EmulatedCluster, host_ranks, script: str, args: list[str],
                timeout: float, env: dict | None = None) -> list[dict]:
    """Run ``python script --worker OUT args...`` once per rank (srun-style,
    ``host_ranks[h]`` = ranks on host h); return each rank's JSON result."""
    out = Path(tempfile.mkdtemp(prefix="gm-cluster-bench-"))
    run_env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    with open(out / "log.txt", "ab") as log:
        procs = cluster.popen_ranks(host_ranks, [sys.executable, script, "--worker", str(out),
                                                 *args], env=run_env, stdout=log,
                                    stderr=subprocess.STDOUT)
        codes = cluster.wait_all(procs, timeout)
    if any(codes):
        raise RuntimeError(f"ranks exited with {codes}:\n"
                           f"{(out / 'log.txt').read_text()[-6000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(procs))]


def write_rank_result(out_dir: str, rank: int, result) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def conditions(cluster: EmulatedCluster) -> dict:
    """Machine, date, link emulation and load: what RESULTS.md records."""
    return {"date": datetime.date.today().isoformat(), "machine": platform.processor() or
            platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "cluster_mode": cluster.mode,
            "delay_applied": cluster.delay_applied,
            "link": vars(cluster.link), "pair_links": {f"{a}-{b}": vars(v) for (a, b), v in
                                                      cluster.pair_links.items()},
            "loadavg": os.getloadavg()}
