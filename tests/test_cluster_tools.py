"""Pieces of multi-node support that need no namespaces: Slurm host lists and
srun options in the shim, lost-host messages, probe scheduling."""

import numpy as np

from giantmodel.distributed.init import PeerHost, describe_lost_peer
from giantmodel.distributed.linkprobe import schedule
from giantmodel.testing.slurm_shim import _parse_srun, expand_hostlist


def test_slurm_host_lists_expand_like_scontrol():
    assert expand_hostlist("host[0-1]") == ["host0", "host1"]
    assert expand_hostlist("gpu[08-10,12],login1") == ["gpu08", "gpu09", "gpu10", "gpu12",
                                                        "login1"]
    assert expand_hostlist("a,b") == ["a", "b"]


def test_srun_options_stop_at_the_command():
    opts, cmd = _parse_srun(["--kill-on-bad-exit=1", "-N", "2", "--ntasks-per-node", "4",
                             "--distribution=cyclic", "torchrun", "--nnodes", "2"])
    assert opts == {"kill-on-bad-exit": "1", "N": "2", "ntasks-per-node": "4",
                    "distribution": "cyclic"}
    assert cmd == ["torchrun", "--nnodes", "2"]


def test_lost_peer_is_named_by_its_address():
    peers = [PeerHost(0, "host0", ("10.50.0.1",)), PeerHost(1, "host0", ("10.50.0.1",)),
             PeerHost(2, "host1", ("10.50.0.2",)), PeerHost(3, "host1", ("10.50.0.2",))]
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.50.0.2]:25813: "
                        "Connection reset by peer. This is typically caused by ...")
    msg = describe_lost_peer(gloo, peers, me=0)
    assert msg.startswith("lost contact with host host1 (ranks [2, 3], 10.50.0.2): [gloo")
    # an address of our own host, or none at all, names nobody
    assert describe_lost_peer(RuntimeError("Read error [10.50.0.1]:1: reset"), peers, 0) is None
    assert describe_lost_peer(ValueError("shape mismatch"), peers, 0) is None


def test_probe_rounds_never_put_a_host_in_two_probes():
    host_of = np.array([0, 0, 1, 1, 2, 2])
    pairs = [(0, 1), (2, 3), (4, 5), (0, 2), (0, 4), (2, 4)]
    rounds = schedule(pairs, host_of)
    assert sorted(p for r in rounds for p in r) == sorted(pairs)
    for r in rounds:
        hosts = [h for a, b in r for h in {int(host_of[a]), int(host_of[b])}]
        assert len(hosts) == len(set(hosts))
    # the three intra-host probes at once, then each pair of the 3 hosts alone
    assert len(rounds) == 4


def _fake_host(monkeypatch, cpus: int, mask: set[int]):
    import os

    import torch

    state = {"mask": None, "threads": None}
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(mask))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, m: state.update(mask=list(m)))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: state.update(threads=n))
    return state


def test_cpu_ranks_get_disjoint_equal_core_shares(monkeypatch):
    from giantmodel.distributed.init import WorldInfo, bind_cpu_cores

    state = _fake_host(monkeypatch, 8, set(range(8)))
    assert bind_cpu_cores(WorldInfo(5, 6, 1, 2)) == [4, 5, 6, 7]
    assert state == {"mask": [4, 5, 6, 7], "threads": 4}
    assert bind_cpu_cores(WorldInfo(0, 3, 0, 3), threads=1) == [0, 1]
    assert state == {"mask": [0, 1], "threads": 1}


def test_cpu_binding_leaves_a_placed_or_oversubscribed_rank_alone(monkeypatch):
    from giantmodel.distributed.init import WorldInfo, bind_cpu_cores

    # srun --cpu-bind or numactl already narrowed the mask
    state = _fake_host(monkeypatch, 8, {2, 3})
    assert bind_cpu_cores(WorldInfo(1, 2, 1, 2)) is None
    # more ranks than CPUs, and a single rank
    state = _fake_host(monkeypatch, 2, {0, 1})
    assert bind_cpu_cores(WorldInfo(3, 4, 3, 4)) is None
    assert bind_cpu_cores(WorldInfo(0, 1, 0, 1)) is None
    assert state == {"mask": None, "threads": None}
