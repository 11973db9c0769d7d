"""The activation model against what autograd really keeps, on tiny models.

Single process: giantmodel.planner.measure's live-storage counter (storages
created by the forward and still alive after it), with saved-tensor hooks as
a cross-check where no recompute hides tensors from them. Recompute is the
project's own (giantmodel.parallel.recompute). Tensor parallelism with the
project's DTensor plan runs on gloo ranks in tests/test_planner_ranks.py;
sequence parallelism is simulated here (see its test).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from giantmodel.config.model import ModelConfig
from giantmodel.core.loss import cross_entropy_sum
from giantmodel.models import build_model
from giantmodel.parallel.recompute import apply_recompute
from giantmodel.planner.layout import Layout
from giantmodel.planner.measure import LiveStorageCounter, SavedTensorCounter
from giantmodel.planner.memory import DTYPE_BYTES, layer_activation_bytes, rank_memory

B, T = 2, 128


def tiny(arch: str, **kw) -> ModelConfig:
    base = {"arch": arch, "hidden_size": 256, "num_layers": 3, "num_heads": 8,
                "num_kv_heads": 4 if arch == "llama" else None, "head_dim": 32,
                "ffn_hidden_size": 768 if arch == "llama" else 1024, "vocab_size": 2048, "max_seq_len": 512}
    base.update(kw)
    return ModelConfig(**base)


def sliced(m: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one tensor-parallel rank computes with."""
    return dataclasses.replace(m, num_heads=m.num_heads // tp,
                        num_kv_heads=(m.num_kv_heads // tp) if m.num_kv_heads else None,
                        ffn_hidden_size=m.ffn_hidden_size // tp, vocab_size=m.vocab_size // tp)


def autocast(precision: str):
    if precision == "fp32":
        return torch.autocast("cpu", enabled=False)
    return torch.autocast("cpu", dtype=torch.bfloat16)


def single_layout(m: ModelConfig, precision: str, mode: str, tp: int = 1) -> Layout:
    return Layout(tp=tp, pp=1, dp=1, dp_shard=1, cp=1, sp=False, zero=0, virtual=1,
                  schedule="1f1b", micro_batch=B, n_micro=1, seq_len=T, precision=precision,
                  recompute=mode, offload_activations=False,
                  stage_layers=(m.num_layers,))


def predicted_model_bytes(m: ModelConfig, precision: str, mode: str, tp: int = 1) -> float:
    """Activations + embedding/head tensors + autocast weight copies, as the
    planner counts them for one micro-batch on one rank."""
    r = rank_memory(m, single_layout(m, precision, mode, tp), 0, hw=None)
    ids = B * T * 8  # token ids are created outside the measured forward
    return (r.components["activations"] + r.components["embedding_head_activations"] - ids
            + r.components["working_weights"])


def _build(m: ModelConfig):
    torch.manual_seed(0)
    model = build_model(m, "cpu")  # torch's default init: fast, and values do not matter here
    model.init_buffers("cpu")
    return model


def measure_model(m: ModelConfig, precision: str, mode: str) -> tuple[int, int]:
    model = _build(m)
    apply_recompute(model, {f"layers.{k}": mode for k in model.layers})
    ids = torch.randint(0, m.vocab_size, (B, T))
    live = LiveStorageCounter()
    with SavedTensorCounter(exclude=tuple(model.parameters())) as saved, live, autocast(precision):
        # as the trainer's step: nothing holds the logits beyond the loss
        loss, _ = cross_entropy_sum(model(ids), ids)
    nbytes = live.live_bytes()
    loss.backward()  # the graph is usable: nothing was broken by measuring
    return nbytes, saved.bytes


CASES = [(arch, prec, mode, 1) for arch in ("llama", "gpt") for prec in ("fp32", "bf16")
         for mode in ("none", "selective", "full")]


@pytest.mark.timeout(120)
def test_activation_model_within_10_percent_of_measured():
    rows = []
    for arch, prec, mode, tp in CASES:
        m = tiny(arch)
        live, saved = measure_model(m, prec, mode)
        pred = predicted_model_bytes(m, prec, mode, tp)
        rows.append((arch, prec, mode, tp, live, pred, pred / live - 1))
        if mode == "none":
            # hooks see what autograd saved: everything live
            assert abs(pred / saved - 1) < 0.02, (arch, prec, tp, saved, pred)
    for r in rows:
        print("activation", *r)
    bad = [r for r in rows if abs(r[-1]) > 0.02]
    assert not bad, "\n".join(map(str, bad))


class _Gather(torch.autograd.Function):
    """Stand-in for the sequence all-gather: allocates the full-length tensor
    the collective would; backward keeps this rank's chunk."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return torch.cat([x] * tp, dim=1)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.tp, dim=1)[0].clone(), None


class _Scatter(torch.autograd.Function):
    """Stand-in for the reduce-scatter back to this rank's sequence shard."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.chunk(tp, dim=1)[0].clone()

    @staticmethod
    def backward(ctx, g):
        return torch.cat([g] * ctx.tp, dim=1), None


def _sp_block(blk, x, rope, tp):
    a = blk.attention(_Gather.apply(blk.attention_norm(x), tp), rope)
    x = x + _Scatter.apply(a, tp)
    f = blk.feed_forward(_Gather.apply(blk.ffn_norm(x), tp))
    return x + _Scatter.apply(f, tp)


@pytest.mark.timeout(60)
def test_sequence_parallel_layer_activations_simulated():
    """Per-rank shapes on one process, norms on sequence shards, gathered
    inputs for the column-parallel linears. Covers none and full recompute
    (selective's policy keys on real collective ops, so it needs the real
    plan)."""
    from torch.utils.checkpoint import checkpoint

    tp, layers = 2, 2
    for arch in ("llama", "gpt"):
        m = tiny(arch)
        local = dataclasses.replace(sliced(m, tp), num_layers=layers)
        for prec in ("fp32", "bf16"):
            for mode in ("none", "full"):
                model = _build(local)
                rope = model.rope[:T] if arch == "llama" else None
                x0 = torch.randn(B, T // tp, m.hidden_size, requires_grad=True)
                live = LiveStorageCounter()
                with live, autocast(prec):
                    x = x0 * 1.0  # created inside: the first block's input counts
                    for blk in model.layers.values():
                        if mode == "full":
                            x = checkpoint(_sp_block, blk, x, rope, tp, use_reentrant=False)
                        else:
                            x = _sp_block(blk, x, rope, tp)
                measured = live.live_bytes(exclude=(x,))
                pred = layers * sum(layer_activation_bytes(m, prec, mode, B, T, tp=tp,
                                                           sp=True).values())
                if mode == "none" and DTYPE_BYTES[prec] < 4:
                    from giantmodel.planner.memory import param_table
                    pred += layers * param_table(m).layer_linear_numel(tp) * DTYPE_BYTES[prec]
                print("sp-activation", arch, prec, mode, measured, pred, pred / measured - 1)
                assert abs(pred / measured - 1) < 0.02, (arch, prec, mode, measured, pred)
