"""The giant backend's all-to-all against gloo's, bit for bit: uneven splits
(an MoE dispatch and combine), zero-size blocks, ranks that send or receive
nothing, every dtype, on one host (2 and 4 ranks, shared memory) and on two
emulated nodes (hierarchical). All cases run inside one spawned group."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from giantmodel.comm import GiantOptions, _lib, register_backend
from giantmodel.comm.hierarchical import plan_all_to_all
from giantmodel.comm.shm import CommArgError, offsets
from giantmodel.testing import run_ranks

needs_core = pytest.mark.skipif(_lib.skip_reason_for_tests() is not None,
                                reason=str(_lib.skip_reason_for_tests()))

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
          torch.int64)


def _matrices(w: int, seed: int) -> list[list[list[int]]]:
    """Rows each group rank sends each other rank: m[s][d]."""
    rng = random.Random(seed)
    rand = [[rng.choice((0, 1, 2, 5, 9)) for _ in range(w)] for _ in range(w)]
    silent = [[0 if s == 0 or d == w - 1 else 3 + s + d for d in range(w)] for s in range(w)]
    one_pair = [[0] * w for _ in range(w)]
    one_pair[w - 1][0] = 7  # a single non-empty block, away from the diagonal
    skewed = [[(40_000 if (s + 1) % w == d else 11) for d in range(w)] for s in range(w)]
    return [rand, silent, [[0] * w for _ in range(w)], one_pair, skewed]


def _rows(n: int, rank: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """n rows of 3, values that say where they came from."""
    base = torch.arange(n * 3, dtype=torch.float64).view(n, 3) + 100.0 * rank + salt
    return base.to(dtype)


def _exchange(group, ref, me, w, m, dtype, salt, explicit=True):
    """One uneven all-to-all on ``group`` and on gloo's ``ref``; equal or raise."""
    send, recv = m[me], [m[s][me] for s in range(w)]
    inp = _rows(sum(send), me, dtype, salt)
    got = torch.full((sum(recv), 3), -1, dtype=dtype)
    want = torch.full_like(got, -2)
    args = (recv, send) if explicit else (None, None)
    dist.all_to_all_single(got, inp, *args, group=group)
    dist.all_to_all_single(want, inp, *args, group=ref)
    assert torch.equal(got, want), (w, m, dtype, salt)


def _check_group(rank, group, ref, ranks, seed):
    w, me = len(ranks), ranks.index(rank)
    for k, m in enumerate(_matrices(w, seed)):
        dtypes = DTYPES if k != 4 else (torch.float32,)  # the big one once
        for dtype in dtypes:
            _exchange(group, ref, me, w, m, dtype, salt=k)
    # torch.uint8 and bool are not the core's: delegated, still gloo's answer
    _exchange(group, ref, me, w, _matrices(w, seed)[0], torch.uint8, salt=5)
    # equal splits, passed on some ranks and not on others: one kernel either way
    even = [[4] * w for _ in range(w)]
    _exchange(group, ref, me, w, even, torch.float32, salt=6, explicit=me % 2 == 0)
    # non-contiguous tensors in and out, rows of a wider dtype view
    m = [[2 + s + d for d in range(w)] for s in range(w)]
    send, recv = m[me], [m[s][me] for s in range(w)]
    inp = _rows(sum(send), me, torch.float32, 7).t().contiguous().t()  # column-major
    got = torch.zeros(3, sum(recv)).t()
    want = torch.zeros(sum(recv), 3)
    dist.all_to_all_single(got, inp, recv, send, group=group)
    dist.all_to_all_single(want, inp.contiguous(), recv, send, group=ref)  # gloo: contiguous only
    assert not got.is_contiguous() and not inp.is_contiguous()
    assert torch.equal(got, want), (got, want)
    # the list form, uneven too
    ins = [torch.full((m[me][d], 2), float(me * 10 + d)) for d in range(w)]
    outs = [torch.empty(m[s][me], 2) for s in range(w)]
    dist.all_to_all(outs, ins, group=group)
    assert all(torch.equal(o, torch.full_like(o, float(s * 10 + me))) for s, o in enumerate(outs))


def _mismatch(rank, group, ref):
    """Split sizes that disagree between two ranks fail on every rank of the
    group alike, before any data moves, with one line naming both ranks,
    both sizes and the rule; the group still works afterwards. On one host
    the core checks them; across nodes the size exchange ahead of the
    network leg does, for a pair on two nodes and a pair on one."""
    w = group.size()
    for src in sorted({w - 1, 1}):
        send, recv = [1] * w, [1] * w
        if rank == 0:
            recv[src] = 2  # expects one row more than rank src sends it
        with pytest.raises(CommArgError) as err:
            dist.all_to_all_single(torch.empty(sum(recv), 2), torch.ones(w, 2), recv, send,
                                   group=group)
        msg = str(err.value)
        assert "\n" not in msg, msg
        assert (f"rank {src} sends rank 0 1 row (input_split_sizes[0] on rank {src}) but "
                f"rank 0 expects 2 rows from rank {src} (output_split_sizes[{src}] on rank 0)"
                in msg), msg
        assert "rank a's input_split_sizes[b] == rank b's output_split_sizes[a]" in msg, msg
    # the list form names its tensors, in elements
    ins = [torch.ones(3 if (rank, d) == (w - 1, 0) else 2) for d in range(w)]
    with pytest.raises(CommArgError, match=rf"rank {w - 1} sends rank 0 3 elements "
                                           rf"\(input_tensors\[0\]\.numel\(\) on rank {w - 1}\) "
                                           rf"but rank 0 expects 2 elements"):
        dist.all_to_all([torch.empty(2) for _ in range(w)], ins, group=group)
    with pytest.raises(ValueError, match="split sizes"):
        dist.all_to_all_single(torch.empty(w), torch.ones(w), [1] * w, [2] * w, group=group)
    m = _matrices(w, 3)[0]
    _exchange(group, ref, rank, w, m, torch.float32, salt=9)


def _worker(rank, world):
    register_backend()
    calls = []
    groups = []
    # (ranks, giant options): one host of 4 and of 2; two emulated nodes of 2
    # and of 1 (hierarchical). 64 KB chunks make the large case take many rounds.
    small = 64 << 10
    for ranks, opts in (([0, 1, 2, 3], GiantOptions()), ([0, 2], GiantOptions(chunk_bytes=small)),
                        ([0, 1, 2, 3], GiantOptions(node_size=2, chunk_bytes=small,
                                                    hierarchical="on")),
                        ([1, 2], GiantOptions(node_size=2, hierarchical="on"))):
        giant = dist.new_group(ranks, backend="giant", pg_options=opts)
        gloo = dist.new_group(ranks, backend="gloo")
        groups.append((ranks, giant, gloo))
    # "auto" across nodes: the reductions go hierarchical, the all-to-all
    # stays on gloo (flat), and gives gloo's result
    auto = dist.new_group([0, 1, 2, 3], backend="giant", pg_options=GiantOptions(node_size=2))
    assert auto._hier is not None and not auto._hier_all_to_all
    out = torch.empty(8)
    dist.all_to_all_single(out, torch.arange(8.0) + 8 * rank, group=auto)
    want = torch.cat([torch.arange(2.0) + 8 * j + 2 * rank for j in range(4)])
    assert torch.equal(out, want), (out, want)
    auto.shutdown()
    for k, (ranks, giant, gloo) in enumerate(groups):
        if rank not in ranks:
            continue
        assert giant.accelerated
        hier = giant.topology.num_nodes > 1
        assert hier == (k >= 2)
        if hier:
            inner = giant._hier.all_to_all
            giant._hier.all_to_all = lambda *a, _f=inner, _k=k: (calls.append(_k), _f(*a))[1]
        else:
            inner = giant._shm.all_to_all_v
            giant._shm.all_to_all_v = lambda *a, _f=inner, _k=k: (calls.append(_k), _f(*a))[1]
        _check_group(rank, giant, gloo, ranks, seed=k)
        _mismatch(ranks.index(rank), giant, gloo)
    for _, giant, _ in groups:
        if giant is not None and hasattr(giant, "shutdown"):
            giant.shutdown()
    return sorted(set(calls)), len(calls)


@needs_core
@pytest.mark.timeout(150)
def test_all_to_all_equals_gloo_on_one_host_and_two_emulated_nodes():
    res = run_ranks(_worker, 4, timeout=140)
    # every group this rank belongs to ran its all-to-alls on the core
    assert [r[0] for r in res] == [[0, 1, 2], [0, 2, 3], [0, 1, 2, 3], [0, 2]]
    assert all(n >= 30 for _, n in res)


def _simulate(nodes, sizes, data):
    """Every rank's output through the two legs of :func:`plan_all_to_all`,
    exchanged in Python: what the shared-memory and network legs do."""
    ranks = sorted(r for members in nodes for r in members)
    node_of = {r: n for n, members in enumerate(nodes) for r in members}
    plans = {r: plan_all_to_all(nodes, r, [sizes[i] for i in nodes[node_of[r]]],
                                [sizes[s][r] for s in ranks]) for r in ranks}

    def gather(buf, blocks):
        return b"".join(buf[o:o + n] for o, n in blocks)

    def split(buf, sizes_):
        return [buf[o:o + n] for o, n in zip(offsets(sizes_), sizes_)]

    staged = {r: split(gather(data[r], plans[r].local_blocks), plans[r].send_local) for r in ranks}
    mid = {}
    for members in nodes:
        for j, r in enumerate(members):
            mid[r] = b"".join(staged[i][j] for i in members)
            assert len(mid[r]) == sum(plans[r].recv_local)
    cross = {r: split(gather(mid[r], plans[r].cross_blocks), plans[r].send_cross) for r in ranks}
    out = {}
    for r in ranks:
        n, j = node_of[r], nodes[node_of[r]].index(r)
        came = b"".join(cross[nodes[m][j]][n] for m in range(len(nodes)))
        assert len(came) == sum(plans[r].recv_cross)
        res = bytearray(sum(sizes[s][r] for s in ranks))
        at = 0
        for start, size in plans[r].placed:
            res[start:start + size] = came[at:at + size]
            at += size
        out[r] = bytes(res)
    return out


@pytest.mark.parametrize("nodes", [((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 3, 4), (1, 2, 5)),
                                   ((0,), (1,), (2,))])
def test_hierarchical_plan_delivers_every_block(nodes):
    """The two-level plan on any placement (Slurm's cyclic one too): each
    rank ends with block s of every rank s, in rank order."""
    rng = random.Random(len(nodes))
    w = sum(len(n) for n in nodes)
    for _ in range(20):
        sizes = [[rng.choice((0, 0, 1, 3, 8)) for _ in range(w)] for _ in range(w)]
        data = {s: b"".join(bytes([16 * s + d]) * sizes[s][d] for d in range(w)) for s in range(w)}
        out = _simulate(nodes, sizes, data)
        for r in range(w):
            assert out[r] == b"".join(bytes([16 * s + r]) * sizes[s][r] for s in range(w))


def _cluster_rank() -> None:
    """One rank on an emulated host (``popen_ranks`` sets RANK, MASTER_*):
    the giant group finds two nodes by host name and runs all-to-all
    hierarchically, against gloo on the default group."""
    import os

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    register_backend()
    giant = dist.new_group(backend="giant", pg_options=GiantOptions(hierarchical="on"))
    expect = tuple(tuple(int(r) for r in node.split(","))
                   for node in os.environ["A2A_NODES"].split(";"))
    assert giant.topology.nodes == expect and giant._hier is not None, giant.topology
    _check_group(rank, giant, None, list(range(world)), seed=11)
    giant.shutdown()
    dist.destroy_process_group()
    print(f"a2a ok on rank {rank}", flush=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_to_all_on_two_emulated_hosts(tmp_path):
    """Two network-namespace hosts, two ranks each, consecutive and cyclic
    (Slurm's) placement: the hierarchical all-to-all equals gloo's."""
    import subprocess
    import sys
    from pathlib import Path

    from giantmodel.testing.cluster import EmulatedCluster, Link, unavailable_reason

    if (why := unavailable_reason()) is not None:
        pytest.skip(why)
    repo = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-c", "import test_comm_alltoall as t; t._cluster_rank()"]
    with EmulatedCluster(2, link=Link(rate_mbit=1000)) as c:
        for port, hosts in ((29531, [[0, 1], [2, 3]]), (29532, [[0, 2], [1, 3]])):
            nodes = ";".join(",".join(map(str, h)) for h in hosts)
            env = {"PYTHONPATH": f"{repo}:{repo / 'tests'}", "OMP_NUM_THREADS": "1",
                   "GIANTMODEL_CACHE": str(tmp_path / "cache"), "A2A_NODES": nodes}
            log = tmp_path / f"{port}.log"
            with open(log, "w") as out:
                procs = c.popen_ranks(hosts, argv, port=port, env=env, stdout=out,
                                      stderr=subprocess.STDOUT)
                codes = c.wait_all(procs, timeout=240)
            text = log.read_text()
            assert codes == [0] * 4 and text.count("a2a ok") == 4, text[-4000:]
