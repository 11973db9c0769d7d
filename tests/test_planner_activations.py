"""The activation model against what autograd really keeps, on tiny models.

Single process: giantmodel.planner.measure's live-storage counter (storages
created by the forward and still alive after it), with saved-tensor hooks as
a cross-check where no recompute hides tensors from them. Recompute is the
project's own (giantmodel.parallel.recompute). Tensor and sequence
parallelism with the project's plan run on gloo ranks in
tests/test_planner_ranks.py and tests/test_activation_saves.py.
"""

from __future__ import annotations

import pytest
import torch

from giantmodel.config.model import ModelConfig
from giantmodel.core.loss import cross_entropy_sum
from giantmodel.models import build_model
from giantmodel.parallel.recompute import apply_recompute
from giantmodel.planner.layout import Layout
from giantmodel.planner.measure import LiveStorageCounter, SavedTensorCounter
from giantmodel.planner.memory import (
    DTYPE_BYTES,
    cast_weight_numel,
    param_table,
    rank_memory,
)

B, T = 2, 128


def tiny(arch: str, **kw) -> ModelConfig:
    base = {"arch": arch, "hidden_size": 256, "num_layers": 3, "num_heads": 8,
                "num_kv_heads": 4 if arch == "llama" else None, "head_dim": 32,
                "ffn_hidden_size": 768 if arch == "llama" else 1024, "vocab_size": 2048, "max_seq_len": 512}
    base.update(kw)
    return ModelConfig(**base)


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
            # hooks see what autograd saved: everything live but the casts
            # the fused path keeps on the modules (not saved tensors)
            kept = (m.num_layers * cast_weight_numel(m, param_table(m), tp) * DTYPE_BYTES[prec]
                    if DTYPE_BYTES[prec] < 4 else 0)
            assert abs((pred - kept) / saved - 1) < 0.02, (arch, prec, tp, saved, pred - kept)
    for r in rows:
        print("activation", *r)
    bad = [r for r in rows if abs(r[-1]) > 0.02]
    assert not bad, "\n".join(map(str, bad))


