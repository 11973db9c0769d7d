"""`giantmodel bench topology` on emulated hosts, launched srun-style: on a
heterogeneous cluster placement finds the fast pairs from the measured file.
(The measured figures of the 200 Mbit/s, 1 ms cluster: tests/test_cluster_launch.py.)"""

import subprocess
import sys

import numpy as np
import pytest

from giantmodel.config import load_config
from giantmodel.distributed.links import load_topology
from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.distributed.placement import plan_placement
from giantmodel.testing.cluster import EmulatedCluster, Link, unavailable_reason

pytestmark = [pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=str(unavailable_reason())), pytest.mark.slow]

def _probe(cluster: EmulatedCluster, host_ranks, out) -> None:
    argv = [sys.executable, "-m", "giantmodel", "bench", "topology", "--out", str(out)]
    procs = cluster.popen_ranks(host_ranks, argv, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    codes = cluster.wait_all(procs, timeout=150)
    assert codes == [0] * len(procs), procs[0].stdout.read()


def test_placement_finds_fast_pairs_it_was_not_told_about(tmp_path):
    out = tmp_path / "topology.yaml"
    fast = Link(rate_mbit=1000)
    # hosts 0-2 and 1-3 share fast links; every other pair crosses 50 Mbit/s.
    # The probe splits link classes 3x apart, so the fast pairs are told apart
    # as long as a loaded machine still moves 150 Mbit/s over a 1 Gbit/s veth
    with EmulatedCluster(4, link=Link(rate_mbit=50),
                         pair_links={(0, 2): fast, (1, 3): fast}) as c:
        _probe(c, [[0], [1], [2], [3]], out)
    topo = load_topology(out, world_size=4)
    assert topo.levels()[0][1] == [[0, 2], [1, 3]]
    cfg = load_config(None, ["parallel.tp=2", "parallel.placement=auto",
                             f"comm.topology={out}"])
    result = plan_placement(cfg, ParallelDims.from_config(cfg, 4), topo)
    pairs = sorted(sorted(g) for g in np.asarray(result.placement).reshape(2, 2).tolist())
    assert pairs == [[0, 2], [1, 3]]
    # once the classes are told apart (>= 3x), the model predicts >= 1.78x
    assert result.identity_s > 1.5 * result.cost_s
