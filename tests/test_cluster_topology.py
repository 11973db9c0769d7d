"""`giantmodel bench topology` on emulated hosts: it measures the shaped links,
and placement finds the fast pairs of a heterogeneous cluster from the file."""

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

MBYTE_S_PER_MBIT = 1e6 / 8


def _probe(cluster: EmulatedCluster, host_ranks, out) -> None:
    argv = [sys.executable, "-m", "giantmodel", "bench", "topology", "--out", str(out)]
    procs = cluster.popen_ranks(host_ranks, argv, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    codes = cluster.wait_all(procs, timeout=150)
    assert codes == [0] * len(procs), procs[0].stdout.read()


def test_probe_measures_shaped_links_between_cyclic_ranks(tmp_path):
    out = tmp_path / "topology.yaml"
    with EmulatedCluster(2, link=Link(rate_mbit=200, delay_ms=1.0)) as c:
        _probe(c, [[0, 2], [1, 3]], out)  # Slurm's cyclic order: ranks 0, 2 on host0
    topo = load_topology(out, world_size=4)
    assert topo.host_names == ["host0", "host1"] and topo.host_ranks == [[0, 2], [1, 3]]
    inter, intra = topo.beta[0, 1], topo.beta[0, 2]
    assert 0.75 * 200 <= inter / MBYTE_S_PER_MBIT <= 1.25 * 200, inter
    assert intra > 5 * inter
    assert 1e-3 <= topo.alpha[0, 1] <= 4e-3 and topo.alpha[0, 2] < 0.5e-3
    assert [name for name, _ in topo.levels()][-2:] == ["host", "network"]


def test_placement_finds_fast_pairs_it_was_not_told_about(tmp_path):
    out = tmp_path / "topology.yaml"
    fast = Link(rate_mbit=1000)
    # hosts 0-2 and 1-3 share fast links; every other pair crosses 100 Mbit/s
    with EmulatedCluster(4, link=Link(rate_mbit=100),
                         pair_links={(0, 2): fast, (1, 3): fast}) as c:
        _probe(c, [[0], [1], [2], [3]], out)
    topo = load_topology(out, world_size=4)
    assert topo.levels()[0][1] == [[0, 2], [1, 3]]
    cfg = load_config(None, ["parallel.tp=2", "parallel.placement=auto",
                             f"comm.topology={out}"])
    result = plan_placement(cfg, ParallelDims.from_config(cfg, 4), topo)
    pairs = sorted(sorted(g) for g in np.asarray(result.placement).reshape(2, 2).tolist())
    assert pairs == [[0, 2], [1, 3]]
    assert result.identity_s > 1.5 * result.cost_s
