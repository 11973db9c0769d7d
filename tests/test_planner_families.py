"""The planner on the model features of the newer families (q/k/v biases,
qk-norm, head_dim apart from hidden / heads, sliding windows), the LM loss
as train.loss_impl runs it, and ``giantmodel estimate`` on a pipeline split
with blockless stages."""

from __future__ import annotations

import json
from dataclasses import replace

import torch

from giantmodel.cli import main
from giantmodel.config import load_config
from giantmodel.config.model import ModelConfig
from giantmodel.core.loss import cross_entropy_sum, head_computes_loss
from giantmodel.core.traffic import param_counts
from giantmodel.models import build_model
from giantmodel.models.common.masks import _window_band
from giantmodel.planner.hardware import get_profile
from giantmodel.planner.head import head_loss_impl
from giantmodel.planner.layout import Cluster, Layout, resolve_layout
from giantmodel.planner.measure import LiveStorageCounter, SavedTensorCounter
from giantmodel.planner.memory import memory_report, model_param_count, rank_memory
from giantmodel.planner.perf import (
    PerfOptions,
    attention_pairs,
    layer_time,
    model_flops_per_step,
)

# Llama 3 405B as the paper splits it (README, parallel.pp_layers): 126 blocks on
# pp 16 x virtual 8 = 128 stages, the first holding only the embedding and the
# last only the head and the loss.
LLAMA3_405B_SPLIT = [
    "--config", "configs/llama/llama3-8b.yaml", "--gpu", "h100-sxm", "--nodes", "16",
    "model.num_layers=126", "model.hidden_size=16384", "model.num_heads=128",
    "model.ffn_hidden_size=53248", "parallel.tp=8", "parallel.sp=true", "parallel.pp=16",
    "parallel.pp_virtual=8", "parallel.pp_schedule=interleaved_1f1b", "parallel.dp=1",
    "parallel.zero=1", "train.global_batch_size=16",
    "parallel.pp_layers=" + json.dumps([0] + [1] * 126 + [0]).replace(" ", ""),
]


def test_estimate_pipeline_split_with_blockless_stages(capsys):
    assert main(["estimate", *LLAMA3_405B_SPLIT]) == 0
    text = capsys.readouterr().out
    assert "stage 127 (rank 15):   0 layers" in text
    assert "126 layers cannot give each of 128 stages a block" in text
    assert main(["estimate", *LLAMA3_405B_SPLIT, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    stages = d["pipeline"]["stages"]
    assert len(stages) == 128 and stages[0]["layers"] == stages[-1]["layers"] == 0
    assert d["pipeline"]["suggested_pp_layers"] is None
    # the embedding-only and head-only chunks still cost time
    assert 0 < stages[0]["time_s"] < stages[1]["time_s"]
    assert d["layout"]["stage_layers"] == [0] + [1] * 126 + [0]


# ------------------------------------------------------------ the LM loss
def _tiny(**kw) -> ModelConfig:
    base = {"arch": "llama", "hidden_size": 128, "num_layers": 1, "num_heads": 4,
            "num_kv_heads": 2, "ffn_hidden_size": 256, "vocab_size": 32768, "max_seq_len": 256}
    base.update(kw)
    return ModelConfig(**base)


def _layout(m: ModelConfig, precision: str, B: int, T: int, **kw) -> Layout:
    return Layout(tp=1, pp=1, dp=1, dp_shard=1, cp=1, sp=False, zero=0, virtual=1,
                  schedule="1f1b", micro_batch=B, n_micro=1, seq_len=T, precision=precision,
                  recompute="none", offload_activations=False,
                  stage_layers=(m.num_layers,), **kw)


def _held(m, layout) -> float:
    """What the planner has the forward leave alive: activations, the
    embedding/head tensors and autocast's weight copies."""
    r = rank_memory(m, layout, 0, hw=None)
    return (r.components["activations"] + r.components["embedding_head_activations"]
            + r.components["working_weights"])


def _measured_live(m, precision: str, impl: str, B: int, T: int) -> int:
    torch.manual_seed(0)
    model = build_model(m, "cpu")
    model.init_buffers("cpu")
    ids = torch.randint(0, m.vocab_size, (B, T))
    live = LiveStorageCounter()
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with live, cast:
        if impl == "plain":
            loss, _ = cross_entropy_sum(model(ids), ids)
        else:
            with head_computes_loss(model.output, ids, impl):
                loss = model(ids)
    nbytes = live.live_bytes()
    loss.backward()
    return nbytes


def test_loss_impl_changes_the_head_terms_as_measured():
    """A 32K vocabulary: plain keeps the fp32 log-softmax [tokens, vocab] (and
    the head's input and cast weight), chunked keeps the two gradients it made
    in forward. The planner's difference matches the live storages'."""
    m, B, T = _tiny(), 2, 96   # tokens != hidden: the two paths keep different sizes
    for precision in ("fp32", "bf16"):
        plain, chunked = (_layout(m, precision, B, T, loss_impl=i) for i in ("plain", "chunked"))
        predicted = _held(m, plain) - _held(m, chunked)
        measured = (_measured_live(m, precision, "plain", B, T)
                    - _measured_live(m, precision, "chunked", B, T))
        assert abs(predicted / measured - 1) < 0.02, (precision, predicted, measured)


def test_planner_peak_plain_and_chunked_differ_by_the_logits():
    """Llama 3's vocabulary at 4096 tokens: the plain loss's peak holds the
    fp32 logits and their backward's gradients; the chunked one a chunk."""
    m = _tiny(hidden_size=1024, vocab_size=128256, max_seq_len=4096, num_heads=8)
    logits = 4096 * 128256 * 4
    for precision in ("fp32", "bf16"):
        peaks = {i: memory_report(m, _layout(m, precision, 1, 4096, loss_impl=i), None)
                 .peak_bytes_per_rank for i in ("plain", "chunked", "auto")}
        saved = peaks["plain"] - peaks["chunked"]
        assert 2 * logits < saved < 4 * logits, (precision, saved / logits)
        assert peaks["auto"] <= peaks["plain"] - 2 * logits
    # tensor parallelism and pipelines keep the plain loss
    tp = replace(_layout(m, "bf16", 1, 4096, loss_impl="chunked"), tp=2)
    assert head_loss_impl(tp, None) == "plain"
    cfg = load_config(None, ["train.loss_impl=auto"])
    assert resolve_layout(cfg, Cluster(1, 1)).loss_impl == "auto"
    assert head_loss_impl(resolve_layout(cfg, Cluster(1, 1)), get_profile("cpu")) == "chunked"


# -------------------------------------------------------------- families
def _family(name: str, **kw) -> ModelConfig:
    """The built-in tiny families' shapes (giantmodel.data.sft_builtin)."""
    base = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
            "ffn_hidden_size": 384, "vocab_size": 1024, "max_seq_len": 512}
    base.update({"qwen2": {"qkv_bias": True, "tie_embeddings": True},
                 "qwen3": {"qk_norm": True, "head_dim": 48, "tie_embeddings": True},
                 "mistral": {"sliding_window": 128}}[name])
    base.update(kw)
    return ModelConfig(name=name, family=name, **base)


def test_parameter_counts_follow_the_families():
    for name in ("qwen2", "qwen3", "mistral"):
        m = _family(name)
        real = sum(p.numel() for p in build_model(m, device="meta").parameters())
        embed, block, head = param_counts(m)
        assert model_param_count(m) == m.num_params() == real, name
        assert embed + m.num_layers * block + head == real, name
    # the planner's table is keyed by every shape field: a same-sized llama
    # read first does not answer for qwen2's biases or qwen3's norms
    assert model_param_count(_family("qwen3", qk_norm=False)) + 4 * 2 * 48 \
        == model_param_count(_family("qwen3"))
    assert model_param_count(_family("qwen2", qkv_bias=False)) < model_param_count(_family("qwen2"))


def test_sliding_window_attention_flops_grow_with_the_window():
    full, windowed = _family("mistral", sliding_window=None), _family("mistral")
    T = 4 * windowed.sliding_window
    lay = _layout(full, "bf16", 1, T)
    hw, cluster = get_profile("h100-sxm"), Cluster(1, 1)
    t_full, t_win = (layer_time(m, lay, hw, cluster, PerfOptions()) for m in (full, windowed))
    assert t_win.fwd < t_full.fwd
    w = windowed.sliding_window
    assert attention_pairs(windowed, T) == w * T - w * w / 2 < attention_pairs(full, T)
    assert attention_pairs(windowed, w) == attention_pairs(full, w)   # window >= sequence
    saved = model_flops_per_step(full, 8, T) - model_flops_per_step(windowed, 8, T)
    q = full.num_heads * full.dim_per_head
    assert saved == 24 * 8 * (T * T / 2 - (w * T - w * w / 2)) * full.num_layers * q


def _measure_block(m: ModelConfig, precision: str, B: int, T: int) -> tuple[int, int]:
    torch.manual_seed(0)
    model = build_model(m, "cpu")
    model.init_buffers("cpu")
    ids = torch.randint(0, m.vocab_size, (B, T))
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    _window_band.cache_clear()   # the band is built (and counted) in this forward
    live = LiveStorageCounter()
    with SavedTensorCounter(exclude=tuple(model.parameters())) as saved, live, cast:
        loss, _ = cross_entropy_sum(model(ids), ids)
    nbytes = live.live_bytes()
    loss.backward()
    return nbytes, saved.bytes


def test_qwen3_and_mistral_activation_terms_match_measured():
    """Qwen3's qk-norm (fp32 inputs, x * rstd and rstd of q and k, head_dim
    48 != 128 / 4) and Mistral's window (the CPU's cached [T, T] band, read by
    SDPA) against what the forward keeps, as tests/test_planner_activations.py
    measures a LLaMA block."""
    B, T = 2, 256
    cpu = get_profile("cpu")
    for name, precision in (("qwen3", "fp32"), ("qwen3", "bf16"), ("mistral", "bf16"),
                            ("mistral", "fp32")):
        m = _family(name, vocab_size=2048)
        r = rank_memory(m, _layout(m, precision, B, T), 0, cpu)
        pred = (r.components["activations"] + r.components["embedding_head_activations"]
                + r.components["working_weights"] - B * T * 8)  # ids made outside
        live, saved = _measure_block(m, precision, B, T)
        assert abs(pred / live - 1) < 0.02, (name, precision, pred, live)
        assert abs(pred / saved - 1) < 0.02, (name, precision, pred, saved)
