"""Model-state bytes: the planner's prediction against what the project's
parallel code allocates, rank by rank, at dp=4 for every ZeRO stage (and a
tp=2 x dp=2 layout), after a real forward, backward and optimizer step."""

from __future__ import annotations

import math

import pytest
import torch

from giantmodel.config.model import ModelConfig
from giantmodel.testing import run_ranks

LAYOUTS = [(0, 1), (1, 1), (2, 1), (3, 1), (1, 2)]   # (zero, tp) at world 4


def _model_cfg() -> ModelConfig:
    # Odd sizes on purpose: dim 0 of some weights does not divide by 4, so
    # FSDP's uneven last shards and ZeRO-1's greedy ownership both matter.
    return ModelConfig(arch="llama", hidden_size=72, num_layers=3, num_heads=6, num_kv_heads=2,
                       head_dim=12, ffn_hidden_size=132, vocab_size=250, max_seq_len=32)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _states_worker(rank, world, layouts):
    from giantmodel.config.schema import JobConfig
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.models import build_model, init_weights
    from giantmodel.parallel.apply import loss_context, loss_fn, parallelize_chunk
    from giantmodel.parallel.data import DataParallel

    out = []
    for zero, tp in layouts:
        cfg = JobConfig(model=_model_cfg())
        cfg.parallel.zero, cfg.parallel.tp = zero, tp
        cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.seq_len = 8, 1, 16
        dims = ParallelDims.from_config(cfg, world)
        dims.build_mesh("cpu")
        model = parallelize_chunk(build_model(cfg.model, "meta"), dims, cfg)
        init_weights(model, cfg.model, 0, "cpu")
        dp = DataParallel(dims, cfg)
        opt = dp.build_optimizer([model], cfg.optim, "cpu")
        ids = torch.randint(0, cfg.model.vocab_size, (1, 16),
                            generator=torch.Generator().manual_seed(rank // tp))
        with loss_context(dims):
            loss, _ = loss_fn(model(ids), ids)
            loss.backward()
        dp.reduce_gradients([model])
        opt.step()
        dp.after_step()
        params = {id(p): p for p in model.parameters()}.values()
        moments = [v for st in opt.state.values() for k, v in st.items()
                   if k in ("exp_avg", "exp_avg_sq")]
        out.append({"params": _nbytes(params), "grads": _nbytes(p.grad for p in params),
                    "optimizer": _nbytes(moments), "dp_rank": dims.coordinate("dp")})
    return out


@pytest.mark.timeout(120)
def test_model_states_match_parallel_code_exactly():
    from giantmodel.planner.memory import model_state_bytes, param_table, stage_params

    m = _model_cfg()
    per_rank = run_ranks(_states_worker, 4, LAYOUTS, timeout=110)
    table = param_table(m)
    for i, (zero, tp) in enumerate(LAYOUTS):
        shapes = stage_params(table, 0, 1, m.num_layers, tp)
        for rank, results in enumerate(per_rank):
            got = results[i]
            want = model_state_bytes(shapes, zero, 4 // tp, "autocast", got["dp_rank"])
            assert {k: got[k] for k in want} == want, (zero, tp, rank, got, want)


def test_zero_paper_memory_example():
    """Rajbhandari et al. 2020 (ZeRO), Figure 1: 7.5B parameters, Adam with
    fp16 mixed precision (K = 12), 64 data-parallel GPUs."""
    from giantmodel.planner.memory import model_state_bytes

    shapes = [(7_500_000_000,)]
    got = [sum(model_state_bytes(shapes, z, 64, "mixed", zero1="even").values()) / 1e9
           for z in (0, 1, 2, 3)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]
    assert math.isclose(got[1], 4 * 7.5 + 12 * 7.5 / 64)
