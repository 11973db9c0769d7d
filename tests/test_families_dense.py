"""Model families on one process: Qwen2/Qwen2.5, Qwen3 and Mistral against
transformers' own classes on tiny random configs (fp32), conversion both
ways, bad input, sliding-window kernels and the HF tokenizer/chat template."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import logits as _logits  # noqa: E402
from hf_helpers import perturb  # noqa: E402

from giantmodel.checkpoint.convert import add_arguments, main  # noqa: E402
from giantmodel.config.errors import ConfigError, UserInputError  # noqa: E402
from giantmodel.config.model import ModelConfig  # noqa: E402
from giantmodel.models import build_model, init_weights  # noqa: E402
from giantmodel.models.families import FAMILIES, family_for_hf, family_of  # noqa: E402
from giantmodel.models.hf import (  # noqa: E402
    from_hf,
    hf_config_to_model_config,
    model_config_to_hf_config,
    to_hf,
)

TOL = 1e-5
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-6)


def make_hf(family: str, **overrides):
    """A tiny random transformers model of ``family``, every tensor perturbed
    (HF inits norms to ones and biases to zeros, which would hide swaps)."""
    classes = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM")}
    cfg_cls, model_cls = (getattr(transformers, n) for n in classes[family])
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**BASE, **overrides})).eval()
    return perturb(model)


CASES = {
    "qwen2": lambda: make_hf("qwen2"),
    "qwen2_tied": lambda: make_hf("qwen2", tie_word_embeddings=True),
    "qwen3": lambda: make_hf("qwen3", head_dim=24),  # heads * head_dim != hidden
    "qwen3_tied_bias": lambda: make_hf("qwen3", head_dim=16, tie_word_embeddings=True,
                                       attention_bias=True),
    "mistral_window": lambda: make_hf("mistral", sliding_window=8),  # T=32 > window
    "mistral_full": lambda: make_hf("mistral", sliding_window=None, head_dim=8),
}


def _tokens(B=2, T=32):
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(2))


@pytest.mark.timeout(120)
def test_parity_and_round_trip(tmp_path):
    """Every case: from_hf logits == transformers', and giantmodel -> HF gives
    the same tensors and logits back in transformers."""
    tokens = _tokens()
    for case, make in CASES.items():
        hf = make()
        src, dst = tmp_path / case, tmp_path / f"{case}-back"
        hf.save_pretrained(src)
        ref = _logits(hf, tokens)
        model = from_hf(src)
        assert model.cfg.family == hf.config.model_type, case
        assert (_logits(model, tokens) - ref).abs().max().item() <= TOL, case
        to_hf(model, model.cfg, dst)
        back = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
        assert type(back) is type(hf), case
        assert (_logits(back, tokens) - ref).abs().max().item() <= TOL, case
        back_sd = back.state_dict()
        for name, t in hf.state_dict().items():
            assert torch.equal(back_sd[name], t), (case, name)


def test_config_fields():
    qwen2 = hf_config_to_model_config(make_hf("qwen2", tie_word_embeddings=True).config.to_dict())
    assert (qwen2.qkv_bias, qwen2.attn_bias, qwen2.has_qkv_bias) == (True, False, True)
    assert qwen2.tie_embeddings and qwen2.family == "qwen2"
    qwen3 = hf_config_to_model_config(make_hf("qwen3", head_dim=24).config.to_dict())
    assert qwen3.qk_norm and qwen3.dim_per_head == 24 and not qwen3.has_qkv_bias
    mistral = hf_config_to_model_config(make_hf("mistral", sliding_window=8).config.to_dict())
    assert mistral.sliding_window == 8 and mistral.family == "mistral"
    # parameter counts follow the new fields exactly
    for cfg in (qwen2, qwen3, mistral):
        assert cfg.num_params() == sum(p.numel() for p in
                                       dict(build_model(cfg).named_parameters()).values())
    # Qwen3 configs without head_dim mean 128 (Qwen3Config's default), not hidden / heads
    raw = {**make_hf("qwen3").config.to_dict()}
    raw.pop("head_dim")
    assert hf_config_to_model_config(raw).dim_per_head == 128


def test_bad_input_one_line(tmp_path):
    with pytest.raises(UserInputError) as e:
        family_for_hf({"model_type": "falcon"})
    msg = str(e.value)
    assert "\n" not in msg and "'falcon'" in msg
    for name in ("llama", "gpt2", "qwen2", "qwen3", "mistral"):
        assert name in msg
    # a window larger than max_seq_len fails at config time, naming the key
    with pytest.raises(ConfigError, match="sliding_window") as e:
        ModelConfig(sliding_window=1024, max_seq_len=512).validate()
    assert "\n" not in str(e.value)
    raw = make_hf("mistral", sliding_window=8).config.to_dict()
    with pytest.raises(ConfigError, match="sliding_window"):
        hf_config_to_model_config({**raw, "sliding_window": 4096})
    with pytest.raises(ConfigError, match="model.qk_norm"):
        ModelConfig(arch="gpt", qk_norm=True, num_kv_heads=None).validate()
    with pytest.raises(UserInputError, match="use_sliding_window"):
        hf_config_to_model_config({**make_hf("qwen2").config.to_dict(), "use_sliding_window": True})
    # an export never drops what its format cannot hold
    with pytest.raises(UserInputError, match="model.qk_norm=True cannot be written in the llama"):
        model_config_to_hf_config(ModelConfig(qk_norm=True))
    with pytest.raises(UserInputError, match="model.family 'bert'"):
        family_of(ModelConfig(family="bert"))
    # and the convert CLI says it in one line too
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UserInputError, match="giantmodel reads"):
        main(parser.parse_args([str(tmp_path), str(tmp_path / "out")]))


@pytest.mark.timeout(120)
def test_convert_cli_both_ways(tmp_path):
    """HF -> giantmodel run dir -> HF with the CLI keeps the family and the logits."""
    hf = make_hf("qwen3", head_dim=24)
    hf.save_pretrained(tmp_path / "hf")
    tokens = _tokens()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert main(parser.parse_args([str(tmp_path / "hf"), str(tmp_path / "run")])) == 0
    assert main(parser.parse_args([str(tmp_path / "run"), str(tmp_path / "back")])) == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["head_dim"] == 24
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert (_logits(back, tokens) - _logits(hf, tokens)).abs().max().item() <= TOL


def test_trained_from_scratch_exports_as_its_family(tmp_path):
    """A config written by hand (model.family set) exports to that family."""
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=96, vocab_size=128, max_seq_len=64, qkv_bias=True,
                      tie_embeddings=True, family="qwen2")
    model = init_weights(build_model(cfg), cfg, seed=3).eval()
    to_hf(model, cfg, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == "Qwen2ForCausalLM"
    tokens = _tokens()
    assert (_logits(back, tokens) - _logits(model, tokens)).abs().max().item() <= TOL
    assert set(FAMILIES) >= {"llama", "gpt2", "qwen2", "qwen3", "mistral"}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sliding_window_kernels_and_generation():
    """The sliding paths against a reference band mask: unpacked rows longer
    than the window, packed rows (document masks), flex's BlockMask (run
    eagerly here), and generation with a KV cache past the window."""
    from torch.nn.attention.flex_attention import flex_attention

    from giantmodel.models.common import masks

    g = torch.Generator().manual_seed(0)
    B, H, T, D, W = 2, 4, 24, 8, 5
    q, k, v = (torch.randn(B, H if i == 0 else 2, T, D, generator=g) for i in range(3))
    pos = torch.arange(T)
    band = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < W)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band,
                                                           enable_gqa=True)
    assert torch.allclose(masks.sliding_attention(q, k, v, W), ref, atol=1e-6)
    # lower-right aligned: the last 10 queries over all keys
    assert torch.allclose(masks.sliding_attention(q[:, :, -10:], k, v, W), ref[:, :, -10:],
                          atol=1e-6)
    # packed: two documents per row; the window restarts with each document
    docs = torch.tensor([[0] * 15 + [1] * 9, [0] * 7 + [1] * 17])
    allowed = band & (docs[:, :, None] == docs[:, None, :])
    ref_packed = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed[:, None], enable_gqa=True)
    dense = masks.document_mask(docs, torch.float32, kernel="dense")
    assert torch.allclose(masks.masked_attention(q, k, v, dense, window=W), ref_packed,
                          atol=1e-6)
    # the flex BlockMasks (what CUDA runs) encode the same patterns
    flex = masks.document_mask(docs, torch.float32, kernel="flex")
    out = flex_attention(q, k, v, block_mask=flex.for_window(W), enable_gqa=True)
    assert torch.allclose(out, ref_packed, atol=1e-5)
    block = masks._sliding_block_mask(10, T, W, "cpu")
    out = flex_attention(q[:, :, -10:], k, v, block_mask=block, enable_gqa=True)
    assert torch.allclose(out, ref[:, :, -10:], atol=1e-5)

    # generation: prefill then one token at a time, past the window
    from giantmodel.models.common.layers import KVCache

    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=64, vocab_size=64, max_seq_len=64, sliding_window=6)
    model = init_weights(build_model(cfg), cfg, seed=1).eval()
    tokens = torch.randint(0, 64, (1, 20), generator=g)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        steps = [model(tokens[:, :4], cache=cache)]
        steps += [model(tokens[:, i:i + 1], cache=cache) for i in range(4, 20)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_qwen_tokenizer_and_chat_template(tmp_path):
    """A Qwen-style tokenizer.json (byte-level BPE, ChatML special tokens) and
    its own chat template, built here with ``tokenizers``, are used as they are."""
    tokenizers = pytest.importorskip("tokenizers")
    from giantmodel.data.chat import resolve_template
    from giantmodel.data.tokenizer import load_tokenizer

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=special,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, what is the capital of France?"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    # Qwen2.5's template, less its tool branches
    template = (
        "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]"
        "['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, "
        "created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}{%- if message.role != 'system' %}{{- '<|im_start|>' + "
        "message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "tokenizer_class": "Qwen2Tokenizer"}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_id == loaded.encode("<|im_end|>")[0] and loaded.bos_id is None
    ids = loaded.encode("hello world")
    assert loaded.decode(ids) == "hello world"
    chat = resolve_template("auto", loaded, tmp_path)
    assert chat.name == "tokenizer"
    messages = [{"role": "user", "content": "capital of France?"},
                {"role": "assistant", "content": "Paris."}]
    rendered = chat.render(messages)
    assert rendered.text.startswith("<|im_start|>system\nYou are Qwen")
    (start, end), = rendered.spans
    assert rendered.text[start:end] == "Paris.<|im_end|>\n"
    assert chat.prompt(messages[:1]).endswith("<|im_start|>assistant\n")
    # the special tokens are single ids, as in the HF tokenizer
    assert len(loaded.encode("<|im_start|>user")) >= 2
    assert loaded.encode("<|im_start|>")[0] == 1


RECIPES = {"qwen2.5-7b-lora": "qwen2", "qwen3-8b-sft": "qwen3", "mistral-7b-lora": "mistral",
           "tiny-qwen2-lora": "qwen2", "tiny-qwen3-sft": "qwen3", "tiny-mistral-lora": "mistral"}


def test_recipes_load_and_tiny_models_match_their_sections(tmp_path):
    """Every family recipe validates; each tiny one's model section is exactly
    what giantmodel reads from its built-in model's config.json, and the
    built-in is built in HF format on first use (no downloads)."""
    from pathlib import Path

    from giantmodel.config import load_config
    from giantmodel.data.sft_builtin import TINY_CHAT_MODEL, TINY_FAMILIES, ensure_tiny_chat_model

    root = Path(__file__).resolve().parents[1] / "configs" / "finetune"
    for name, family in RECIPES.items():
        cfg = load_config(root / f"{name}.yaml")
        assert cfg.model.family == family, name
        if name.startswith("tiny-"):
            which = cfg.checkpoint.init_from.removeprefix("builtin:")
            hf = {"hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                  **TINY_CHAT_MODEL, **TINY_FAMILIES[which]}
            assert hf_config_to_model_config(hf, name=which) == cfg.model, name
    built = ensure_tiny_chat_model(tmp_path, "tiny-mistral")
    assert json.loads((built / "config.json").read_text())["sliding_window"] == 128
    model = from_hf(built)
    assert model.cfg.sliding_window == 128 and (built / "tokenizer.json").is_file()
