"""zero 3's keep-gathered rule: which blocks stay gathered from forward to
backward, in the engine and in the planner's memory and time models."""

from __future__ import annotations

import pytest

from giantmodel.parallel.fsdp import kept_gathered
from giantmodel.testing import run_ranks

LIMIT = 200_000   # the tiny GPT below: keeps its last two blocks of four


def test_rule_counts_twice_what_runs_after():
    assert kept_gathered([10, 10, 10], 5, 0) == ([False] * 3, False)
    # block 2: 2 * 5 < 31; block 1: 2 * 15 < 31; block 0: 2 * 25 >= 31
    assert kept_gathered([10, 10, 10], 5, 31) == ([False, True, True], False)
    assert kept_gathered([10, 10, 10], 5, 71) == ([True] * 3, True)


def _worker(rank, world, limit):
    import layout_harness as H
    import torch
    from torch.distributed.tensor import DTensor

    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.planner.layout import Cluster, resolve_layout
    from giantmodel.planner.memory import zero3_kept_numel

    cfg = H.make_config("gpt", ["parallel.dp=2", "parallel.zero=3",
                                f"parallel.keep_gathered_numel={limit}"])
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    engine = H.build_engine(cfg, dims)
    model = engine.parts[0]
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len))
    out = model(ids)
    # after forward, a resharded block holds its sharded DTensors again
    gathered = [not any(isinstance(p, DTensor) for p in block.parameters())
                for block in model.layers.values()]
    out.float().sum().backward()
    dims.destroy_mesh()
    layer = sum(p.numel() for p in next(iter(model.layers.values())).parameters())
    return gathered, zero3_kept_numel(cfg.model, resolve_layout(cfg, Cluster(1, world)))[0], layer


@pytest.mark.timeout(120)
def test_engine_keeps_the_blocks_the_rule_and_the_planner_name():
    results = run_ranks(_worker, 2, LIMIT, timeout=110)
    gathered, planned, _ = results[0]
    assert gathered == [False, False, True, True]
    assert results[1][0] == gathered
    # the planner counts the kept elements: two whole blocks (a DTensor's
    # numel is its unsharded size)
    assert planned == 2 * results[0][2]
