"""The planner against the project's parallel code on 4 gloo ranks (one
spawn for both tests: starting ranks dominates their cost).

* Model-state bytes, rank by rank, at dp=4 for every ZeRO stage and a
  tp=2 x dp=2 layout, after a real forward, backward and optimizer step.
* Activation bytes per layer under the tensor-parallel DTensor plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_planner_activations import B, T, autocast, tiny

from giantmodel.config.model import ModelConfig
from giantmodel.planner.measure import LiveStorageCounter
from giantmodel.planner.memory import layer_activation_bytes, layer_weight_copies
from giantmodel.testing import run_ranks

TP = 2
TP_CASES = [(arch, prec, mode, sp) for arch in ("llama", "gpt")
            for prec, mode in (("bf16", "none"), ("bf16", "selective"), ("bf16", "full"),
                               ("fp32", "none"), ("fp32", "full"))
            for sp in (False, True) if not (sp and mode == "selective")]
# Selective recompute under sp: the live-storage count here comes out below
# the planner (by the casts kept on the modules, it seems); the per-block
# measurement in tests/test_activation_saves.py covers selective under sp.
CP = 2
CP_CASES = [("llama", "bf16", mode) for mode in ("none", "selective", "full")]

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


def _worker(rank, world, layouts, tp_cases, cp_cases):
    return (_states(rank, world, layouts), _tp_activations(world, tp_cases),
            _cp_activations(world, cp_cases))


@pytest.fixture(scope="module")
def rank_results():
    return run_ranks(_worker, 4, LAYOUTS, TP_CASES, CP_CASES, timeout=170)


def _states(rank, world, layouts):
    """Model-state bytes of the real engine after one step: what its
    strategy allocates for parameters and gradients, and AdamW's moments."""
    import layout_harness as H

    from giantmodel.config.schema import JobConfig
    from giantmodel.core.precision import Precision
    from giantmodel.distributed.parallel_dims import ParallelDims

    out = []
    for zero, tp in layouts:
        cfg = JobConfig(model=_model_cfg())
        cfg.parallel.zero, cfg.parallel.tp = zero, tp
        cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.seq_len = 8, 2, 16
        dims = ParallelDims.from_config(cfg, world)
        dims.build_mesh("cpu")
        engine = H.build_engine(cfg, dims)
        opt = engine.build_optimizer(cfg.optim)
        ids = torch.randint(0, cfg.model.vocab_size, (2, 17),
                            generator=torch.Generator().manual_seed(rank // tp))
        engine.forward_backward([{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}],
                                Precision("fp32", "cpu"))
        params = list(engine.parameters())
        flat = engine.strategy.buffer_bytes() if hasattr(engine.strategy, "buffer_bytes") else {}
        grads = flat.get("grads") or _nbytes(p.grad for p in params if p.grad is not None)
        engine.optimizer_step(opt)
        moments = [v for st in opt.state.values() for k, v in st.items()
                   if k in ("exp_avg", "exp_avg_sq")]
        out.append({"params": flat.get("params") or _nbytes(params), "grads": grads,
                    "optimizer": _nbytes(moments), "dp_rank": dims.coordinate("dp"),
                    "strategy": type(engine.strategy).__name__})
        dims.destroy_mesh()
    return out


@pytest.mark.timeout(180)
def test_model_states_match_parallel_code_exactly(rank_results):
    from giantmodel.parallel.strategy import strategy_name
    from giantmodel.planner.memory import model_state_bytes, param_table, stage_params

    m = _model_cfg()
    per_rank = [r[0] for r in rank_results]
    table = param_table(m)
    for i, (zero, tp) in enumerate(LAYOUTS):
        shapes = stage_params(table, 0, 1, m.num_layers, tp)
        for rank, results in enumerate(per_rank):
            got = results[i]
            strategy = strategy_name(zero=zero, dp_cp=4 // tp, hybrid=False, pp=1)
            want = model_state_bytes(shapes, zero, 4 // tp, "autocast", got["dp_rank"],
                                     strategy=strategy)
            assert {k: got[k] for k in want} == want, (zero, tp, rank, got, want)


def _tp_forward_bytes(m: ModelConfig, prec: str, mode: str, sp: bool, dims) -> tuple[int, int]:
    """Bytes the forward + loss leave alive on this rank (tp, or cp inputs
    cut the way the engine cuts them), and the aten ops forward, loss and
    backward dispatch on DTensors."""
    from giantmodel.config.schema import JobConfig
    from giantmodel.objectives import LanguageModel
    from giantmodel.parallel.context import balanced_positions, shard_sequence
    from giantmodel.parallel.objective import StageSpec
    from giantmodel.parallel.parallelize import parallelize
    from giantmodel.parallel.strategy import NoDataParallel
    from giantmodel.parallel.tensor import vocab_parallel_cross_entropy
    from giantmodel.planner.measure import DTensorOpCounter

    cfg = JobConfig(model=m, recompute=mode)
    objective = LanguageModel(m, data=cfg.data, train=cfg.train)
    model = objective.build(StageSpec())
    parallelize(model, objective, dims, NoDataParallel(dims), sp=sp, recompute=mode,
                offload=cfg.offload, compile=False)
    objective.init_weights(model, torch.device("cpu"))
    ids = torch.randint(0, m.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    positions = None
    if dims.cp > 1:
        rank = dims.coordinate("cp")
        ids, positions = shard_sequence(ids, dims.cp, rank), balanced_positions(T, dims.cp, rank)
    live = LiveStorageCounter()
    with DTensorOpCounter() as ops:
        with live, objective.loss_context():
            with autocast(prec):
                logits = model(ids, positions)
            loss, _ = vocab_parallel_cross_entropy(logits, ids)
        net = live.live_bytes()
        with objective.loss_context():
            loss.backward()
    return net, ops.n


def _tp_activations(world, cases):
    from giantmodel.distributed.parallel_dims import ParallelDims

    dims = ParallelDims(world_size=world, dp_replicate=world // TP, tp=TP)
    dims.build_mesh("cpu")
    if dims.coordinate("dp_replicate") != 0:
        return None  # one tp group measures; the other has identical shapes
    out = []
    for arch, prec, mode, sp in cases:
        m3, m1 = tiny(arch), dataclasses.replace(tiny(arch), num_layers=1)
        (b3, n3), (b1, n1) = (_tp_forward_bytes(m, prec, mode, sp, dims) for m in (m3, m1))
        out.append(((b3 - b1) / 2, (n3 - n1) / 2))
    return out


def _cp_activations(world, cases):
    from giantmodel.distributed.parallel_dims import ParallelDims

    dims = ParallelDims(world_size=world, dp_replicate=world // CP, cp=CP)
    dims.build_mesh("cpu")
    if dims.coordinate("dp_replicate") != 0:
        return None
    out = []
    for arch, prec, mode in cases:
        m3, m1 = tiny(arch), dataclasses.replace(tiny(arch), num_layers=1)
        out.append((_tp_forward_bytes(m3, prec, mode, False, dims)[0]
                    - _tp_forward_bytes(m1, prec, mode, False, dims)[0]) / 2)
    return out


def test_context_parallel_layer_activations(rank_results):
    """Per-layer activation bytes under the project's context parallelism
    (all-gathered K/V, load-balanced causal chunks), cp=2."""
    per_rank = [r[2] for r in rank_results if r[2] is not None]
    assert len(per_rank) == CP
    bad = []
    for i, (arch, prec, mode) in enumerate(CP_CASES):
        pred = sum(layer_activation_bytes(tiny(arch), prec, mode, B, T, cp=CP).values())
        pred += layer_weight_copies(tiny(arch), prec, 1, mode)
        measured = max(r[i] for r in per_rank)
        print("cp-activation", arch, prec, mode, measured, pred, pred / measured - 1)
        if abs(pred / measured - 1) > 0.02:
            bad.append((arch, prec, mode, measured, pred))
    assert not bad, bad


def test_tensor_parallel_layer_activations(rank_results):
    """Per-layer activation and weight-copy bytes under the project's tp=2
    plan, with and without sequence parallelism (whose projections keep
    their input sharded)."""
    tp = TP
    per_rank = [r[1] for r in rank_results if r[1] is not None]
    assert len(per_rank) == TP
    bad = []
    for i, (arch, prec, mode, sp) in enumerate(TP_CASES):
        m = tiny(arch)
        pred = sum(layer_activation_bytes(m, prec, mode, B, T, tp=tp, sp=sp).values())
        pred += layer_weight_copies(m, prec, tp, mode)
        measured = max(r[i][0] for r in per_rank)
        print("tp-activation", arch, prec, mode, "sp" if sp else "-", measured, pred,
              pred / measured - 1)
        if abs(pred / measured - 1) > 0.02:
            bad.append((arch, prec, mode, sp, measured, pred))
    assert not bad, bad




def test_tensor_parallel_dtensor_ops_per_block(rank_results):
    """The DTensor ops the planner charges per block (perf.dtensor_ops) are
    the ones the project's tp=2 plan dispatches, forward and backward."""
    from giantmodel.planner.perf import _block_tp_tensors, block_dtensor_ops

    per_rank = [r[1] for r in rank_results if r[1] is not None]
    bad = []
    for i, (arch, prec, mode, sp) in enumerate(TP_CASES):
        measured = max(r[i][1] for r in per_rank)
        # one micro-batch: plus the op of each parameter's gradient
        pred = block_dtensor_ops(tiny(arch), TP, sp, prec, mode) + _block_tp_tensors(tiny(arch))[1]
        print("tp-dtensor-ops", arch, prec, mode, measured, pred)
        if abs(pred / measured - 1) > 0.05:
            bad.append((arch, prec, mode, sp, measured, pred))
    assert not bad, bad
