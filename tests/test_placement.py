"""Rank placement: the traffic model, topology files, the cost model and the search."""

import itertools
import json
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from giantmodel import cli
from giantmodel.config import dump_config, load_config
from giantmodel.config.errors import ConfigError, UserInputError
from giantmodel.config.model import ModelConfig
from giantmodel.core.traffic import mesh_traffic, param_counts
from giantmodel.distributed.links import derive_classes, from_host_matrices, load_topology, parse_topology
from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.distributed.placement import CostModel, megatron_placement, plan_placement
from giantmodel.models import build_model
from giantmodel.planner.placement import place_on_topology

MBIT = 1e6 / 8
REPO = Path(__file__).resolve().parents[1]


def _two_hosts(host_ranks, inter_bytes=200 * MBIT, inter_lat=1e-3):
    """Hosts of 2 ranks, shared memory inside (1 GB/s), a slow link between."""
    return from_host_matrices(["a", "b"], host_ranks,
                              np.array([[5e-5, inter_lat], [inter_lat, 5e-5]]),
                              np.array([[1e9, inter_bytes], [inter_bytes, 1e9]]))


def _cfg(*overrides):
    return load_config(None, ["train.global_batch_size=16", "train.micro_batch_size=4",
                              *overrides])


@pytest.mark.parametrize("kw", [{}, {"arch": "gpt", "num_kv_heads": None},
                                {"tie_embeddings": True}, {"attn_bias": True, "num_layers": 3}])
def test_param_counts_match_the_modules(kw):
    m = ModelConfig(**kw)
    embed, block, head = param_counts(m)
    real = sum(p.numel() for p in build_model(m, device="meta").parameters())
    assert embed + m.num_layers * block + head == real


def test_traffic_names_the_dimensions_that_move_bytes():
    cfg = _cfg("parallel.tp=2", "parallel.zero=3")
    deg = {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    calls = {(t.dims, t.kind, t.what): t
             for t in mesh_traffic(cfg.model, cfg.train, cfg.parallel, deg)}
    act = calls[(("tp",), "all_reduce", "activations")]
    # 4 per layer + embedding/head, per micro-batch (16 / (4 * 2) = 2 of them)
    assert act.count == 2 * (4 * cfg.model.num_layers + 2)
    assert act.nbytes == 4 * cfg.train.seq_len * cfg.model.hidden_size * 4
    gathers = calls[(("dp_shard", "cp"), "all_gather", "parameters")]
    assert gathers.count == 2 * 2  # forward + backward, per micro-batch
    zero0 = mesh_traffic(cfg.model, cfg.train, _cfg("parallel.tp=2").parallel, deg)
    assert [t.kind for t in zero0 if "dp_shard" in t.dims] == ["all_reduce"]


def test_topology_file_round_trip_classes_and_errors(tmp_path):
    raw = {"hosts": [{"name": "n0", "ranks": [0, 1, 2, 3], "nics": 2},
                     {"name": "n1", "ranks": [4, 5, 6, 7], "nics": 2}],
           "classes": [{"name": "nvlink", "latency_us": 2, "bandwidth_gbytes": 100,
                        "groups": [[0, 1], [2, 3], [4, 5], [6, 7]]},
                       {"name": "pcie", "latency_us": 5, "bandwidth_gbytes": 16,
                        "groups": "hosts"},
                       {"name": "ib", "latency_us": 10, "bandwidth_gbytes": 12}]}
    topo = parse_topology(raw)
    assert topo.beta[0, 1] == 100e9 and topo.beta[0, 2] == 16e9 and topo.beta[3, 4] == 12e9
    assert [name for name, _ in topo.levels()] == ["nvlink", "pcie", "ib"]
    path = tmp_path / "topology.yaml"
    topo.save(path)
    again = load_topology(path, world_size=8)
    np.testing.assert_allclose(again.alpha, topo.alpha)
    np.testing.assert_allclose(again.beta, topo.beta)
    assert again.nics == [2, 2] and again.levels() == topo.levels()
    with pytest.raises(UserInputError, match="describes 8 ranks but the job has 4"):
        load_topology(path, world_size=4)
    bad = dict(raw, classes=raw["classes"][:2])
    with pytest.raises(UserInputError, match="no class joins ranks 0 and 4"):
        parse_topology(bad, "t.yaml")
    with pytest.raises(UserInputError, match=r"t.yaml: unknown keys \['bandwith'\]"):
        parse_topology(dict(raw, bandwith=1), "t.yaml")
    with pytest.raises(UserInputError, match="every rank 0..7 exactly once"):
        parse_topology(dict(raw, hosts=[{"name": "x", "ranks": [0, 1, 2, 3, 4, 5, 6, 6]}]))
    with pytest.raises(UserInputError, match="no such file"):
        load_topology(tmp_path / "missing.yaml")


def test_measured_classes_find_fast_islands_and_remap():
    # 4 single-rank hosts; hosts {0,2} and {1,3} share 1 Gbit/s links, the rest 100 Mbit/s
    beta = np.full((4, 4), 100 * MBIT)
    beta[0, 2] = beta[2, 0] = beta[1, 3] = beta[3, 1] = 1000 * MBIT
    alpha = np.full((4, 4), 1e-4)
    topo = from_host_matrices(list("wxyz"), [[0], [1], [2], [3]], alpha, beta)
    assert topo.levels()[0][1] == [[0, 2], [1, 3]]
    classes = derive_classes(topo.alpha, topo.beta, topo.host_ranks)
    assert [c.groups for c in classes] == [[[0, 2], [1, 3]], None]
    moved = topo.remapped(list("zyxw"), [[0], [1], [2], [3]])  # same hosts, new rank order
    assert moved.beta[0, 2] == 1000 * MBIT and moved.beta[0, 1] == 100 * MBIT


def test_auto_puts_tp_on_a_host_when_slurm_deals_ranks_cyclically():
    topo = _two_hosts([[0, 2], [1, 3]])  # ranks 0 and 2 on host a
    cfg = _cfg("parallel.tp=2")
    dims = ParallelDims.from_config(cfg, 4)
    r = plan_placement(cfg, dims, topo)
    tp_groups = np.asarray(r.placement).reshape(2, 2)
    assert all(len({int(topo.host_of[x]) for x in g}) == 1 for g in tp_groups)
    assert r.method == "exhaustive" and r.evaluated == 24
    assert r.identity_s / r.cost_s > 1.5
    # Megatron's tp-cp-dp-pp order is this mesh's identity order
    assert megatron_placement(dims.degree_map) == list(range(4))
    assert r.megatron_s == pytest.approx(r.identity_s)
    assert "placement: auto -> [0, 2, 1, 3]" in r.log_line()


def test_auto_keeps_pipeline_groups_increasing_and_dp_on_a_host():
    topo = _two_hosts([[0, 2], [1, 3]])
    cfg = _cfg("parallel.pp=2", "model.vocab_size=16384")
    dims = ParallelDims.from_config(cfg, 4)
    r = plan_placement(cfg, dims, topo)
    mesh = np.asarray(r.placement).reshape(2, 2)          # [pp, dp]
    assert all(len({int(topo.host_of[x]) for x in stage}) == 1 for stage in mesh)
    assert (np.diff(mesh, axis=0) > 0).all()
    assert r.identity_s / r.cost_s > 2


def test_exhaustive_search_is_the_true_minimum():
    rng = np.random.default_rng(0)
    beta = rng.uniform(10, 1000, (6, 6)) * MBIT
    beta = (beta + beta.T) / 2
    alpha = np.full((6, 6), 1e-4)
    topo = from_host_matrices([f"h{i}" for i in range(6)], [[i] for i in range(6)], alpha, beta)
    cfg = _cfg("parallel.tp=2", "parallel.pp=3", "train.global_batch_size=12",
               "model.num_layers=3")
    dims = ParallelDims.from_config(cfg, 6)
    r = plan_placement(cfg, dims, topo)
    traffic = mesh_traffic(cfg.model, cfg.train, cfg.parallel, dims.degree_map,
                           microbatches=dims.pipeline.n_micro)
    model = CostModel(dims.degree_map, traffic, topo)
    perms = np.asarray(list(itertools.permutations(range(6))))
    costs = np.where(model.valid(perms), model.cost(perms), np.inf)
    assert r.cost_s == pytest.approx(costs.min())


def test_heterogeneous_links_pair_the_fast_ranks_without_being_told():
    beta = np.full((4, 4), 100 * MBIT)
    beta[0, 3] = beta[3, 0] = beta[1, 2] = beta[2, 1] = 1000 * MBIT
    topo = from_host_matrices(list("abcd"), [[0], [1], [2], [3]], np.full((4, 4), 1e-4), beta)
    cfg = _cfg("parallel.tp=2")
    r = plan_placement(cfg, ParallelDims.from_config(cfg, 4), topo)
    pairs = sorted(sorted(g) for g in np.asarray(r.placement).reshape(2, 2).tolist())
    assert pairs == [[0, 3], [1, 2]]


def test_a_1024_rank_plan_takes_under_10_seconds():
    hosts, per = 128, 8
    cyclic = np.arange(hosts * per).reshape(per, hosts).T  # host h: h, h+128, ...
    raw = {"hosts": [{"name": f"n{h}", "ranks": cyclic[h].tolist(), "nics": 8}
                     for h in range(hosts)],
           "classes": [{"name": "nvlink", "latency_us": 3, "bandwidth_gbytes": 150,
                        "groups": "hosts"},
                       {"name": "ib", "latency_us": 12, "bandwidth_gbytes": 12}]}
    topo = parse_topology(raw)
    cfg = load_config(None, [
        "model.hidden_size=8192", "model.num_layers=80", "model.num_heads=64",
        "model.num_kv_heads=8", "model.ffn_hidden_size=28672", "model.vocab_size=128256",
        "model.max_seq_len=4096", "train.seq_len=4096", "train.micro_batch_size=1",
        "train.global_batch_size=1024", "parallel.tp=8", "parallel.pp=4", "parallel.zero=1"])
    dims = ParallelDims.from_config(cfg, 1024)
    # CPU time: a loaded machine stretches wall time, not the work
    t0 = time.process_time()
    r = plan_placement(cfg, dims, topo)
    assert time.process_time() - t0 < 10 and "cap" not in r.method
    tp_groups = np.asarray(r.placement).reshape(-1, 8)
    assert all(len({int(topo.host_of[x]) for x in g}) == 1 for g in tp_groups)
    assert r.cost_s < r.identity_s / 3


def _cyclic_16(tmp_path) -> Path:
    """2 hosts x 8 ranks dealt cyclically (host n0: even ranks), NVLink inside."""
    raw = {"hosts": [{"name": f"n{h}", "ranks": list(range(h, 16, 2)), "nics": 1}
                     for h in range(2)],
           "classes": [{"name": "nvlink", "latency_us": 3, "bandwidth_gbytes": 150,
                        "groups": "hosts"},
                       {"name": "ib", "latency_us": 12, "bandwidth_gbytes": 12}]}
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_plan_topology_and_the_run_choose_the_same_placement(tmp_path, capsys):
    topo_file = _cyclic_16(tmp_path)
    out = tmp_path / "plan.yaml"
    assert cli.main(["plan", "--config", str(REPO / "configs/llama/13b.yaml"), "--gpu",
                     "a100-80g", "--nodes", "2", "--gpus-per-node", "8", "--top", "1",
                     "--topology", str(topo_file), "--out", str(out)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "placement: auto ->" in x]
    printed = json.loads(line.split("-> ")[1].split(" predicted")[0])
    run_cfg = load_config(out, validate=False)
    assert run_cfg.parallel.placement == "auto" and run_cfg.comm.topology == str(topo_file)
    # what resolve_placement does on rank 0 at start-up, with the written config
    dims = ParallelDims.from_config(run_cfg, 16)
    assert plan_placement(run_cfg, dims, load_topology(run_cfg.comm.topology)
                          ).placement == printed
    # a layout with tp (the plan above picks tp1 here): 16 ranks are searched by
    # swaps, which stop on the inputs alone, so plan and run agree exactly
    cfg = _cfg("parallel.tp=4")
    placed = place_on_topology(cfg, str(topo_file), 16)
    dump_config(cfg, tmp_path / "run.yaml")
    again = load_config(tmp_path / "run.yaml", validate=False)
    topo = load_topology(again.comm.topology)
    r = plan_placement(again, ParallelDims.from_config(again, 16), topo)
    assert r.placement == placed.placement and r.method == "nesting orders + swaps"
    tp_groups = np.asarray(r.placement).reshape(-1, 4)
    assert all(len({int(topo.host_of[x]) for x in g}) == 1 for g in tp_groups)
    assert r.cost_s < r.identity_s


def test_auto_config_is_accepted_and_bad_topology_fails_before_any_group(tmp_path):
    cfg = _cfg("parallel.placement=auto", "parallel.tp=2")
    dims = ParallelDims.from_config(cfg, 4)
    assert dims.placement is None
    with pytest.raises(ConfigError, match="resolved to a permutation"):
        dims.build_mesh()
    missing = _cfg("parallel.placement=auto", f"comm.topology={tmp_path}/nope.yaml")
    with pytest.raises(UserInputError, match="comm.topology: no such file"):
        ParallelDims.from_config(missing, 4)
