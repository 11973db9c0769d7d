"""Gemma 3 (text) and Phi-3: parity with transformers' own classes on tiny
random configs (fp32), round trips and the convert CLI both ways, LoRA
merged exports, config checks, the banded CPU sliding kernel, and Gemma 3
under tp2 + sp, pp2 (stages holding different layer types), cp2 and ZeRO-3
at dp2 against one process."""

from __future__ import annotations

import argparse
import json

import layout_harness as H
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import logits as _logits
from hf_helpers import perturb

from giantmodel.checkpoint.convert import add_arguments, main  # noqa: E402
from giantmodel.config.errors import ConfigError, UserInputError  # noqa: E402
from giantmodel.config.model import ModelConfig, RopeScaling  # noqa: E402
from giantmodel.models import build_model  # noqa: E402
from giantmodel.models.hf import from_hf, hf_config_to_model_config, to_hf  # noqa: E402
from giantmodel.testing import run_ranks  # noqa: E402

TOL = 1e-5
BASE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-6)
GEMMA_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def make_hf(family: str, **overrides):
    """A tiny random transformers model, every tensor perturbed (Gemma's
    norms start at 0, i.e. a scale of 1, which would hide a missing + 1)."""
    classes = {"gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
               "phi3": ("Phi3Config", "Phi3ForCausalLM")}
    if family == "phi3":  # Phi3Config's special ids (32000) are outside this vocabulary
        overrides = {"pad_token_id": None, "eos_token_id": 1, "bos_token_id": 0, **overrides}
    cfg_cls, model_cls = (getattr(transformers, n) for n in classes[family])
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**BASE, **overrides})).eval()
    return perturb(model)


CASES = {
    # local and global layers, a window (8) shorter than the sequence (32),
    # head_dim != hidden / heads, query_pre_attn_scalar != head_dim, linear
    # RoPE scaling on the global layers only
    "gemma3": lambda: make_hf(
        "gemma3", head_dim=24, sliding_window=8, layer_types=GEMMA_TYPES,
        query_pre_attn_scalar=20,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 50_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}}),
    # the older sliding_window_pattern (every 3rd layer global), untied head
    "gemma3_pattern": lambda: make_hf("gemma3", head_dim=16, sliding_window=6,
                                      sliding_window_pattern=3, tie_word_embeddings=False),
    "phi3": lambda: make_hf("phi3"),
    # LongRoPE (long factors past 16 tokens) with 3/4 of each head rotated
    "phi3_longrope": lambda: make_hf(
        "phi3", original_max_position_embeddings=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                         "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + 0.1 * i for i in range(6)],
                         "long_factor": [2.0 + 0.3 * i for i in range(6)]}),
    "phi3_window": lambda: make_hf("phi3", sliding_window=8, num_key_value_heads=4),
}


def _tokens(B=2, T=32):
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(2))


@pytest.mark.timeout(120)
def test_parity_and_round_trip(tmp_path):
    """from_hf logits == transformers' at 32 tokens (past the window, and
    LongRoPE's long factors) and 12 (short factors); giantmodel -> HF gives
    the tensors and the logits back in transformers."""
    tokens = _tokens()
    for case, make in CASES.items():
        hf = make()
        src, dst = tmp_path / case, tmp_path / f"{case}-back"
        hf.save_pretrained(src)
        model = from_hf(src)
        assert model.cfg.family == hf.config.model_type, case
        for T in (32, 12):
            ref = _logits(hf, tokens[:, :T])
            assert (_logits(model, tokens[:, :T]) - ref).abs().max().item() <= TOL, (case, T)
        to_hf(model, model.cfg, dst)
        back = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
        assert type(back) is type(hf), case
        assert (_logits(back, tokens) - _logits(hf, tokens)).abs().max().item() <= TOL, case
        back_sd = back.state_dict()
        for name, t in hf.state_dict().items():  # norms pass through 1 + w and back
            torch.testing.assert_close(back_sd[name], t, rtol=0, atol=1e-7, msg=(case, name))


def test_config_fields_and_bad_input():
    gemma = hf_config_to_model_config(CASES["gemma3"]().config.to_dict())
    assert gemma.layer_types == GEMMA_TYPES and gemma.sliding_window == 8
    assert [gemma.window_of(i) for i in range(4)] == [8, None, 8, 8]
    assert (gemma.rope_theta, gemma.rope_local_theta) == (50_000.0, 1_000.0)
    assert gemma.rope_scaling.type == "linear" and gemma.tie_embeddings
    assert abs(gemma.attn_scale - 20 ** -0.5) < 1e-12
    phi = hf_config_to_model_config(CASES["phi3_longrope"]().config.to_dict())
    assert phi.rope_scaling.type == "longrope" and phi.rotary_dim == 12
    # the model built from each has the windows by global index and the
    # parameter count the config predicts (four norms per Gemma block)
    for cfg in (gemma, phi):
        model = build_model(cfg)
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    windows = [build_model(gemma).layers[str(i)].attention.window for i in range(4)]
    assert windows == [8, None, 8, 8]
    # bad input fails in one line, naming the key
    with pytest.raises(ConfigError, match="model.layer_types") as e:
        ModelConfig(sliding_window=8, layer_types=["sliding_attention"]).validate()
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="short_factor"):
        ModelConfig(rope_scaling=RopeScaling(type="longrope", short_factor=[1.0])).validate()
    with pytest.raises(ConfigError, match="model.sliding_window"):
        ModelConfig(sliding_window=128, max_seq_len=64).validate()
    # a HF window no sequence can reach (Phi-3 128k: 262144) means full attention
    wide = {**CASES["phi3_window"]().config.to_dict(), "sliding_window": 262_144}
    assert hf_config_to_model_config(wide).sliding_window is None
    with pytest.raises(UserInputError, match="attn_logit_softcapping"):
        hf_config_to_model_config({**CASES["gemma3"]().config.to_dict(),
                                   "attn_logit_softcapping": 50.0})
    with pytest.raises(UserInputError, match="cannot be written in the phi3"):
        to_hf(build_model(gemma, "cpu"), ModelConfig(**{**gemma.__dict__, "family": "phi3"}),
              "/nonexistent")


@pytest.mark.timeout(120)
def test_convert_cli_both_ways_and_lora_merge(tmp_path):
    """HF -> giantmodel run -> HF with the CLI keeps the family and logits;
    a LoRA run over each base merges (--merge-lora) into a HF model that
    transformers runs like giantmodel does."""
    from hf_helpers import lora_run_dir

    from giantmodel.checkpoint import load_model_from_checkpoint

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    tokens = _tokens()
    for case in ("gemma3", "phi3_longrope"):
        hf = CASES[case]()
        base = tmp_path / f"{case}-hf"
        hf.save_pretrained(base)
        run, back = tmp_path / f"{case}-run", tmp_path / f"{case}-back"
        assert main(parser.parse_args([str(base), str(run)])) == 0
        assert main(parser.parse_args([str(run), str(back)])) == 0
        assert json.loads((back / "config.json").read_text())["model_type"] == \
            hf.config.model_type
        model = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
        assert (_logits(model, tokens) - _logits(hf, tokens)).abs().max().item() <= TOL, case
        lora, merged = tmp_path / f"{case}-lora", tmp_path / f"{case}-merged"
        lora_run_dir(lora, base, ["all_linear"])
        assert main(parser.parse_args([str(lora), str(merged), "--to", "hf",
                                       "--merge-lora"])) == 0
        ours = _logits(load_model_from_checkpoint(lora), tokens)
        theirs = _logits(transformers.AutoModelForCausalLM.from_pretrained(merged).eval(),
                         tokens)
        assert (ours - _logits(hf, tokens)).abs().max().item() > 1e-3, case  # adapters matter
        assert (ours - theirs).abs().max().item() <= TOL, case


def test_banded_cpu_sliding_kernel_matches_the_band():
    """The blocked CPU path (queries in blocks of the window, each against
    its own keys) equals SDPA with the full band mask, values and
    gradients, with GQA, with more keys than queries (context parallelism's
    chunks, generation) and with rows not a multiple of the window."""
    from giantmodel.models.common import masks

    g = torch.Generator().manual_seed(0)
    for B, Hq, Hkv, rows, span, D, w in [(2, 4, 2, 40, 40, 8, 6), (1, 4, 4, 37, 50, 8, 5),
                                         (2, 4, 2, 16, 64, 8, 4)]:
        q = torch.randn(B, Hq, rows, D, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(B, Hkv, span, D, generator=g, dtype=torch.float64,
                            requires_grad=True) for _ in range(2))
        band = masks.window_band(rows, span, w, "cpu")
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band,
                                                               enable_gqa=Hq != Hkv)
        out = masks.sliding_attention(q, k, v, w)
        torch.testing.assert_close(out, ref)
        grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), grad),
                        torch.autograd.grad(ref, (q, k, v), grad), strict=True):
            torch.testing.assert_close(a, b)


LAYOUT_CASES = [
    ("gemma3", ["parallel.tp=2", "parallel.sp=true"]),
    ("gemma3", ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    ("gemma3", ["parallel.cp=2"]),
    ("gemma3", ["parallel.dp=2", "parallel.zero=3"]),
]


@pytest.mark.timeout(300)
def test_gemma3_layouts_match_single_process():
    results = run_ranks(H.run_cases, 2, LAYOUT_CASES, timeout=240)[0]
    failures = []
    for (arch, overrides), result in zip(LAYOUT_CASES, results, strict=True):
        if any("pp=" in o for o in overrides):  # tied: the head is the embedding
            result["params"].pop("output.weight", None)
        try:
            H.assert_matches(result, H.reference(arch, overrides), f"{arch} {overrides}")
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
def test_recipes_tiny_models_and_multimodal_checkpoints(tmp_path):
    """The recipes validate; each tiny one's model section is what giantmodel
    reads from its built-in model, built in HF format on first use and run
    by transformers as by giantmodel. A multimodal Gemma 3 checkpoint
    (model_type gemma3, text model under language_model.model.) reads as
    its text model, the vision tower skipped."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from giantmodel.config import load_config
    from giantmodel.data.sft_builtin import TINY_CHAT_MODEL, TINY_FAMILIES, ensure_tiny_chat_model

    root = Path(__file__).resolve().parents[1] / "configs" / "finetune"
    assert load_config(root / "gemma3-4b-lora.yaml").model.family == "gemma3_text"
    tokens = _tokens()
    for name in ("tiny-gemma3-lora", "tiny-phi3-lora"):
        cfg = load_config(root / f"{name}.yaml")
        which = cfg.checkpoint.init_from.removeprefix("builtin:")
        hf = {"hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              **TINY_CHAT_MODEL, **TINY_FAMILIES[which]}
        assert hf_config_to_model_config(hf, name=which) == cfg.model, name
        built = ensure_tiny_chat_model(tmp_path, which)
        ref = _logits(transformers.AutoModelForCausalLM.from_pretrained(built).eval(), tokens)
        assert (_logits(from_hf(built), tokens) - ref).abs().max().item() <= TOL, name
    # multimodal layout: config under text_config, tensors under a prefix
    hf = CASES["gemma3"]()
    hf.save_pretrained(tmp_path / "text")
    mm = tmp_path / "mm"
    mm.mkdir()
    text_cfg = json.loads((tmp_path / "text" / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text_cfg, "vision_config": {"hidden_size": 8}}))
    state = load_file(str(tmp_path / "text" / "model.safetensors"))
    state = {k.replace("model.", "language_model.model.", 1): v for k, v in state.items()}
    state["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    save_file(state, str(mm / "model.safetensors"))
    model = from_hf(mm)
    assert model.cfg.family == "gemma3_text"
    assert (_logits(model, tokens) - _logits(hf, tokens)).abs().max().item() <= TOL
