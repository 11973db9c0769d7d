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


# ---------------------------------------------------------------- zero 1/2 padding
def test_padding_of_whole_parameter_ownership():
    from giantmodel.parallel.flat_buffer import padding
    from giantmodel.parallel.strategy import strategy_name

    # eight equal parameters share out over 2, 4 and 8 owners; over 16, half
    # the owners hold nothing and every chunk is one parameter wide
    assert padding([100] * 8, owners=2, bucket_numel=10) == 0.0
    assert padding([100] * 8, owners=8, bucket_numel=10) == 0.0
    assert padding([100] * 8, owners=16, bucket_numel=10) == 1.0
    # one large parameter: the others cannot balance it
    assert padding([1000, 10, 10], owners=2, bucket_numel=10) > 0.9
    assert padding([1000, 10, 10], owners=1, bucket_numel=10) == 0.0
    name = lambda z, pad: strategy_name(zero=z, dp_cp=16, hybrid=False, pp=1, padding=pad)  # noqa: E731
    assert [name(z, 0.05) for z in (0, 1, 2, 3)] == ["own", "own", "own", "fsdp"]
    assert [name(z, 1.0) for z in (0, 1, 2, 3)] == ["own", "fsdp", "fsdp", "fsdp"]


def test_first_bucket_that_holds_most_gradients_goes_to_fsdp_where_comm_overlaps():
    from giantmodel.parallel.flat_buffer import padding_and_first_bucket
    from giantmodel.parallel.strategy import strategy_name

    # many equal parameters balance in small buckets: the first is small
    pad, first = padding_and_first_bucket([100] * 64, owners=4, bucket_numel=400)
    assert pad == 0.0 and first == pytest.approx(4 / 64)
    # one large parameter that backward finishes first (a head) balances over
    # 4 owners only with nearly everything after it: one bucket, no padding
    pad, first = padding_and_first_bucket([100] * 30 + [1000], owners=4, bucket_numel=400)
    assert pad < 0.02 and first == 1.0
    assert padding_and_first_bucket([100] * 8, owners=1, bucket_numel=10) == (0.0, 0.0)

    def name(zero, first, overlaps, pp=1):
        return strategy_name(zero=zero, dp_cp=8, hybrid=False, pp=pp, padding=0.01,
                             first_bucket=first, comm_overlaps=overlaps)
    # on a GPU the one bucket would leave the whole reduction exposed
    assert [name(z, 1.0, True) for z in (0, 1, 2)] == ["own", "fsdp", "fsdp"]
    assert name(1, 0.4, True) == "own"
    # a CPU's ranks run the collectives themselves; under pipelines the
    # buckets are reduced after the schedule anyway
    assert name(1, 1.0, False) == "own" and name(1, 1.0, True, pp=2) == "own"


def test_planner_follows_the_engine_to_fsdp_where_buffers_would_pad():
    from giantmodel.config.model import ModelConfig
    from giantmodel.planner.hardware import cpu_profile
    from giantmodel.planner.layout import Layout
    from giantmodel.planner.memory import layout_strategy, param_table

    # Llama 3 8B: its 128256 x 4096 embedding and head are the two largest of
    # 291 tensors; whole tensors cannot balance 32 owners
    m = ModelConfig(arch="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    ffn_hidden_size=14336, vocab_size=128256, max_seq_len=8192)
    table = param_table(m)

    def strategy(dp, zero, hw=None):
        lay = Layout(tp=1, pp=1, dp=dp, dp_shard=dp, cp=1, sp=False, zero=zero, virtual=1,
                     schedule="1f1b", micro_batch=1, n_micro=1, seq_len=8192, precision="bf16",
                     recompute="none", offload_activations=False, stage_layers=(32,))
        return layout_strategy(table, lay, hw)

    assert strategy(64, 1) == "fsdp"
    assert strategy(64, 2) == "fsdp"
    assert strategy(64, 0) == "own"
    # at dp 8 the flat buffers pad by 0.3%, but their first bucket, the head's,
    # holds every gradient: on a GPU (None: the planner's default device) FSDP2,
    # on a CPU host the flat buffers; at dp 4 the first bucket is a quarter
    assert strategy(8, 1) == "fsdp"
    assert strategy(8, 1, cpu_profile()) == "own"
    assert strategy(4, 1) == "own"


def _strategy_worker(rank, world):
    import layout_harness as H
    import torch
    from torch.distributed.tensor import DTensor

    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.parallel.fsdp import FSDP

    out = []
    for extra in ([], ["model.tie_embeddings=true", "model.vocab_size=4096"]):
        cfg = H.make_config("llama", ["parallel.dp=2", "parallel.zero=1"] + extra)
        dims = ParallelDims.from_config(cfg, world)
        dims.build_mesh("cpu")
        engine = H.build_engine(cfg, dims)
        s, model = engine.strategy, engine.parts[0]
        row = [type(s).__name__]
        if isinstance(s, FSDP):
            ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len))
            sharded = []
            for last in (False, True):
                s.before_backward(last)
                model(ids).float().sum().backward()
                # gathered (plain tensors, gradients unsharded) until the last
                # micro-batch's backward reduce-scatters and reshards
                sharded.append(all(isinstance(p, DTensor) and p.grad is not None
                                   for p in model.parameters()))
            row += [s.sync_every, sharded]
        dims.destroy_mesh()
        out.append(row)
    return out


@pytest.mark.timeout(120)
def test_engine_takes_fsdp_for_zero1_that_would_pad_and_syncs_once():
    results = run_ranks(_strategy_worker, 2, timeout=110)
    assert results[0] == results[1]
    assert results[0][0] == ["OwnZero"]
    assert results[0][1] == ["FSDP", False, [False, True]]
