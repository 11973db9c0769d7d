"""Hugging Face parity: giantmodel's LLaMA and GPT against transformers on tiny
random configs in fp32, loading through from_hf and exporting through to_hf."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import perturb

from giantmodel.config.errors import UserInputError
from giantmodel.models.hf import from_hf, hf_config_to_model_config, load_hf_into, to_hf

TOL = 1e-5




def _llama(**overrides):
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, vocab_size=128, max_position_embeddings=64,
              rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    kw.update(overrides)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**kw)
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2(**overrides):
    kw = dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=128,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    kw.update(overrides)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw)).eval()


def _randomize(model):
    """HF inits norms to ones and biases to zeros; perturb every tensor so a
    swapped or untransposed weight cannot hide."""
    return perturb(model)


CASES = {
    "llama_gqa": lambda: _llama(attention_bias=True),
    "llama_tied": lambda: _llama(num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope_scaling": lambda: _llama(
        rope_theta=500000.0, max_position_embeddings=64, num_key_value_heads=1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama_wide_heads": lambda: _llama(head_dim=24),  # heads * head_dim != hidden
    "gpt2_tied": lambda: _gpt2(),
    "gpt2_untied": lambda: _gpt2(tie_word_embeddings=False, n_inner=96),
}


def _tokens(vocab=128, B=2, T=48):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(2))


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_from_hf_logits_and_round_trip(case, tmp_path):
    hf = _randomize(CASES[case]())
    src = tmp_path / "src"
    hf.save_pretrained(src)
    tokens = _tokens()
    ref = _hf_logits(hf, tokens)

    model = from_hf(src)
    assert model.cfg.arch == ("gpt" if case.startswith("gpt") else "llama")
    with torch.no_grad():
        out = model(tokens)
    assert out.shape == ref.shape == (2, 48, 128)
    assert (out - ref).abs().max().item() <= TOL

    # Round trip: giantmodel -> HF directory -> transformers -> same logits.
    dst = tmp_path / "dst"
    to_hf(model, model.cfg, dst)
    back = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    assert type(back).__name__ == type(hf).__name__
    assert (_hf_logits(back, tokens) - ref).abs().max().item() <= TOL
    # every tensor HF reads back is bitwise the original
    hf_sd, back_sd = hf.state_dict(), back.state_dict()
    for name, t in hf_sd.items():
        assert torch.equal(back_sd[name], t), name


def test_config_mapping_gqa_tied_rope():
    hf = CASES["llama3_rope_scaling"]().config.to_dict()
    cfg = hf_config_to_model_config(hf)
    assert (cfg.num_heads, cfg.kv_heads, cfg.rope_theta) == (4, 1, 500000.0)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.original_max_seq_len == 16
    assert cfg.norm_eps == 1e-6 and not cfg.tie_embeddings
    # the older config style (rope_theta / rope_scaling at top level) maps the same
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}
    legacy.update(rope_theta=500000.0, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})
    assert hf_config_to_model_config(legacy).rope_scaling == cfg.rope_scaling
    gpt = hf_config_to_model_config(CASES["gpt2_tied"]().config.to_dict())
    assert gpt.arch == "gpt" and gpt.tie_embeddings and gpt.ffn_hidden_size == 256


@pytest.mark.timeout(60)
def test_sharded_index_and_bin(tmp_path):
    hf = _randomize(_llama())
    tokens = _tokens()
    ref = _hf_logits(hf, tokens)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    with torch.no_grad():
        assert (from_hf(sharded)(tokens) - ref).abs().max().item() <= TOL

    # legacy pytorch_model.bin, read with weights_only=True
    legacy = tmp_path / "bin"
    legacy.mkdir()
    (legacy / "config.json").write_text((sharded / "config.json").read_text())
    torch.save(hf.state_dict(), legacy / "pytorch_model.bin")
    with torch.no_grad():
        assert (from_hf(legacy)(tokens) - ref).abs().max().item() <= TOL

    # sharded export: index plus several files, and transformers loads it
    model = from_hf(sharded)
    out = tmp_path / "export"
    files = to_hf(model, model.cfg, out, max_shard_bytes=50_000)
    assert len(files) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert (_hf_logits(back.eval(), tokens) - ref).abs().max().item() <= TOL
    with pytest.raises(UserInputError, match="already holds model weights"):
        to_hf(model, model.cfg, out)


def test_load_into_pipeline_stage_parts(tmp_path):
    """Two parts that each hold some layers (a pipeline split) together take
    every weight; their union computes the same logits."""
    from giantmodel.models import build_model

    hf = _randomize(_llama(tie_word_embeddings=True, num_key_value_heads=4))
    hf.save_pretrained(tmp_path)
    cfg = hf_config_to_model_config(hf.config.to_dict())
    first, last = build_model(cfg, "cpu"), build_model(cfg, "cpu")
    del first.layers["1"]
    first.norm = first.output = None
    del last.layers["0"]
    last.tok_embeddings = None
    load_hf_into([first, last], tmp_path, cfg)
    for part in (first, last):
        part.init_buffers()
    tokens = _tokens()
    with torch.no_grad():
        out = last(first(tokens))
    assert (out - _hf_logits(hf, tokens)).abs().max().item() <= TOL


def test_bad_inputs(tmp_path):
    with pytest.raises(UserInputError, match="no config.json"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UserInputError, match="unsupported Hugging Face model_type 'bert'"):
        from_hf(tmp_path)
    cfg = CASES["llama_gqa"]().config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserInputError, match="no weights found"):
        from_hf(tmp_path)
    with pytest.raises(UserInputError, match="RoPE scaling type 'yarn'"):
        hf_config_to_model_config({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
