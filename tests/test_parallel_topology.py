"""Layout validation before any process group, placement, and the mesh."""

from __future__ import annotations

import layout_harness as H
import pytest
import torch.distributed as dist

from giantmodel.config.errors import ConfigError
from giantmodel.core.layout import validate_placement
from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.testing import run_ranks

BAD = [
    # (overrides, world, key the error must name)
    (["parallel.dp=2", "parallel.tp=2"], 8, "parallel.dp"),
    (["parallel.tp=4"], 6, "parallel"),
    (["model.num_heads=6", "model.num_kv_heads=6", "model.hidden_size=48",
      "model.ffn_hidden_size=96", "parallel.tp=4"], 4, "model.num_heads"),
    (["parallel.tp=4"], 4, "model.num_kv_heads"),  # 4 heads, 2 kv heads
    (["parallel.pp=2", "parallel.pp_virtual=4", "parallel.pp_schedule=interleaved_1f1b",
      "train.global_batch_size=16"], 2, "parallel.pp"),  # 4 layers < 8 stages
    (["parallel.cp=2", "train.seq_len=18"], 2, "train.seq_len"),
    (["parallel.tp=2", "parallel.sp=true", "train.seq_len=15"], 2, "train.seq_len"),
    (["parallel.pp=4", "parallel.pp_schedule=1f1b", "train.global_batch_size=4",
      "train.micro_batch_size=2"], 4, "train.global_batch_size"),  # 2 micro-batches < 4 stages
    (["parallel.dp=4", "train.global_batch_size=6", "train.micro_batch_size=1"], 4,
     "train.global_batch_size"),
    (["parallel.zero=3", "parallel.shard_group_size=3"], 4, "parallel.shard_group_size"),
    (["parallel.placement=[0,1,1,3]"], 4, "parallel.placement"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("overrides,world,key", BAD)
def test_bad_layout_refused_before_process_group(overrides, world, key):
    cfg = H.make_config("llama", overrides)
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_config(cfg, world)
    assert err.value.key == key, str(err.value)
    assert not dist.is_initialized()


def test_unimplemented_cp_method_refused_at_load():
    with pytest.raises(ConfigError) as err:
        H.make_config("llama", ["parallel.cp=2", "parallel.cp_method=ring"])
    assert err.value.key == "parallel.cp_method"


def test_dp_minus_one_fills_world():
    dims = ParallelDims.from_config(H.make_config("llama", ["parallel.tp=2", "parallel.dp=-1"]), 8)
    assert (dims.dp, dims.tp, dims.dp_replicate, dims.dp_shard) == (4, 2, 4, 1)
    hsdp = ParallelDims.from_config(H.make_config(
        "llama", ["parallel.zero=3", "parallel.shard_group_size=2", "train.micro_batch_size=1"]), 8)
    assert (hsdp.dp_replicate, hsdp.dp_shard) == (4, 2)


def test_placement_validation():
    assert validate_placement(None, 3) == [0, 1, 2]
    assert validate_placement([2, 0, 1], 3) == [2, 0, 1]
    with pytest.raises(ConfigError, match="3 entries"):
        validate_placement([0, 1, 2], 4)


def _mesh_coordinates(rank, world, placements):
    out = []
    for placement in placements:
        cfg = H.make_config("llama", ["parallel.dp=2", "parallel.tp=2"]
                            + ([f"parallel.placement={placement}"] if placement else []))
        dims = ParallelDims.from_config(cfg, world)
        dims.build_mesh("cpu")
        res = {name: (dims.coordinate(name), sorted(dist.get_process_group_ranks(dims.group(name))))
               for name in ("tp", "dp", "dp_cp", "cp")}
        dims.destroy_mesh()
        # A permuted placement must still train exactly like one process.
        res["losses"] = H.run_steps(cfg, steps=2)["losses"]
        out.append(res)
    return out


@pytest.mark.timeout(120)
def test_mesh_groups_follow_placement():
    ranks = run_ranks(_mesh_coordinates, 4, [None, "[0,2,1,3]"], timeout=110)
    default, permuted = [r[0] for r in ranks], [r[1] for r in ranks]
    # identity: tp innermost -> consecutive ranks share a tp group
    assert default[0]["tp"] == (0, [0, 1]) and default[1]["tp"] == (1, [0, 1])
    assert default[0]["dp"] == (0, [0, 2])
    # placement [0,2,1,3]: mesh positions (dp0,tp0)=0 (dp0,tp1)=2 (dp1,tp0)=1 (dp1,tp1)=3
    assert permuted[0]["tp"] == (0, [0, 2]) and permuted[2]["tp"] == (1, [0, 2])
    assert permuted[1]["dp"] == (1, [0, 1])
    ref = H.reference("llama", [], steps=2)["losses"]
    for res in default + permuted:
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(res["losses"], ref))
