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
from giantmodel.planner.memory import (
    cast_weight_numel,
    memory_report,
    model_param_count,
    param_table,
    rank_memory,
)
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
        # the weight casts kept on the modules are live, not saved tensors
        kept = (m.num_layers * cast_weight_numel(m, param_table(m), 1) * 2
                if precision == "bf16" else 0)
        assert abs((pred - kept) / saved - 1) < 0.02, (name, precision, pred - kept, saved)


# ------------------------------------------------------------------ Gemma
def _gemma(**kw) -> ModelConfig:
    """A tiny Gemma 3 block (qk-norm, GeGLU, head_dim 48 != 128 / 4); ``kw``
    adds the post-norms, soft-capping or a local/global pattern."""
    base = dict(arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=48, ffn_hidden_size=384, vocab_size=1024, max_seq_len=1024,
                qk_norm=True, mlp_activation="gelu_tanh", embed_scale=True,
                tie_embeddings=True, attn_scale=48 ** -0.5)
    base.update(kw)
    return ModelConfig(**base)


def test_gemma_post_norms_and_capped_scores_match_measured():
    """What Gemma's post-norms and Gemma 2's soft-capped scores (the CPU's
    math path: [s, s] scores kept, k and v repeated to the query heads, no
    log-sum-exp) add to a block, against the saved tensors' difference
    with and without them (family_extra_bytes: what layer_terms does not
    count yet). On a GPU the flex kernel caps the scores fused: nothing added."""
    from giantmodel.planner.terms import family_extra_bytes, softcap_score_bytes

    B, T = 2, 96
    g2 = {"qk_norm": False}   # Gemma 2's block
    cases = {"post_norms": ({"post_norms": True}, {}),
             "softcap": ({"attn_softcap": 50.0, **g2}, g2),
             "softcap_window": ({"attn_softcap": 50.0, "sliding_window": 32, **g2},
                                {"sliding_window": 32, **g2})}
    for precision in ("fp32", "bf16"):
        for name, (with_kw, without_kw) in cases.items():
            m = _gemma(**with_kw)
            _, saved_with = _measure_block(m, precision, B, T)
            _, saved_without = _measure_block(_gemma(**without_kw), precision, B, T)
            extra = family_extra_bytes(m, precision, B, T, 1, False, 1, accelerator=False)
            pred = m.num_layers * sum(extra.values())
            assert pred > 0 and pred == saved_with - saved_without, (precision, name, extra)
    assert softcap_score_bytes(_gemma(attn_softcap=50.0), "bf16", B, T, 1, True) == {}


def test_gemma_attention_time_follows_local_global_layers_and_caps():
    """Gemma 3's local layers score a window's pairs, its global ones the
    causal triangle; a pipeline rank holding more global layers is the
    slower by exactly their difference. Gemma 2's capped scores on the CPU
    (the math path) cost the whole [s, s] whatever the window, and more than
    the fused kernel; on a GPU (flex, fused) the window counts."""
    from giantmodel.planner.attention import attention_time, rank_attention_skew
    from giantmodel.planner.perf import stage_times

    T, w = 1024, 128
    local, glob = "sliding_attention", "full_attention"
    last = _gemma(num_layers=6, sliding_window=w, layer_types=[local] * 5 + [glob])
    first = _gemma(num_layers=6, sliding_window=w, layer_types=[glob] + [local] * 5)
    win, full = w * T - w * w / 2, T * T / 2
    assert attention_pairs(last, T, 0) == win and attention_pairs(last, T, 5) == full
    assert attention_pairs(last, T) == (5 * win + full) / 6
    all_local = _gemma(num_layers=6, sliding_window=w)
    assert model_flops_per_step(all_local, 8, T) < model_flops_per_step(last, 8, T) \
        < model_flops_per_step(_gemma(num_layers=6), 8, T)

    hw, cluster, opts = get_profile("h100-sxm"), Cluster(1, 1), PerfOptions()
    lay = replace(_layout(last, "bf16", 1, T), pp=2, stage_layers=(3, 3))
    a_l, a_g = (attention_time(last, lay, hw, opts, i) for i in (0, 5))
    skews = [rank_attention_skew(last, lay, hw, opts, r) for r in (0, 1)]
    assert abs(skews[0][0] + skews[1][0]) < 1e-12 * a_g[0]
    assert abs(skews[1][0] - skews[0][0] - (a_g[0] - a_l[0])) < 1e-9 * a_g[0]
    s_last, s_first = (stage_times(m, lay, hw, cluster, opts) for m in (last, first))
    gap = a_g[0] - a_l[0]
    assert abs(s_first[0].fwd - s_last[0].fwd - gap) < 1e-6 * s_last[0].fwd
    assert abs(s_last[1].fwd - s_first[1].fwd - gap) < 1e-6 * s_last[1].fwd

    cpu = get_profile("cpu")
    lay1 = _layout(last, "fp32", 1, T)
    capped = [_gemma(attn_softcap=50.0, sliding_window=sw, layer_types=None)
              for sw in (None, w)]
    t_full, t_win = (attention_time(m, lay1, cpu, opts) for m in capped)
    assert t_full == t_win   # the math path computes every score
    fused = attention_time(_gemma(), lay1, cpu, opts)
    assert t_full[0] > fused[0] and t_full[1] > fused[1]
    g_full, g_win = (attention_time(m, lay1, hw, opts) for m in capped)
    assert g_win[0] < g_full[0]   # flex on a GPU skips the blocks outside the window
    # and the block's time carries the math path's score traffic
    assert layer_time(capped[0], lay1, cpu, cluster, opts).fwd \
        > layer_time(_gemma(), lay1, cpu, cluster, opts).fwd + t_full[0] - fused[0]


def test_capped_scores_count_in_the_memory_model_on_a_cpu():
    """Gemma 2's soft-capped scores on the CPU's math path are part of a
    block's memory (no recompute), once, and absent where flex attention
    applies the cap (an accelerator)."""
    from giantmodel.planner.terms import softcap_score_bytes

    m = _gemma(attn_softcap=50.0, final_softcap=30.0, qk_norm=False)
    lay = _layout(m, "bf16", 2, 256)
    cpu = rank_memory(m, lay, 0, get_profile("cpu"))
    gpu = rank_memory(m, lay, 0, get_profile("h100-sxm"))
    extra = softcap_score_bytes(m, "bf16", 2, 256, 1, False)
    assert extra and all(cpu.per_layer[k] == v for k, v in extra.items())
    assert not any(k in gpu.per_layer for k in extra)
    # what perf adds from family_extra_bytes is already there: nothing twice
    assert sum(cpu.per_layer.values()) > sum(gpu.per_layer.values())
