"""Gemma 2: parity with transformers' Gemma2ForCausalLM on a tiny random
config (fp32) with both soft-caps binding and a sequence past the window,
the round trip back to HF, the KV-cache path and packed rows under the
capped kernel, and the plain-loss fallback of a capped head. Soft-caps on
export: Gemma 3 writes them too (Gemma3ForCausalLM applies them), every
other family refuses them in one line."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import logits as _logits  # noqa: E402
from hf_helpers import perturb  # noqa: E402

from giantmodel.config.model import ModelConfig  # noqa: E402
from giantmodel.core.loss import resolve_loss_impl  # noqa: E402
from giantmodel.models.common.layers import KVCache  # noqa: E402
from giantmodel.models.hf import from_hf, hf_config_to_model_config, to_hf  # noqa: E402

TOL = 1e-5


def make_hf():
    cfg = transformers.Gemma2Config(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-6,
        head_dim=24, sliding_window=8, query_pre_attn_scalar=20,
        attn_logit_softcapping=0.5, final_logit_softcapping=1.5)
    torch.manual_seed(0)
    return perturb(transformers.Gemma2ForCausalLM(cfg).eval(), scale=0.3)


def _tokens(B=2, T=32):
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(2))


def test_parity_round_trip_cache_and_packing(tmp_path):
    hf = make_hf()
    hf.save_pretrained(tmp_path / "src")
    model = from_hf(tmp_path / "src").eval()
    cfg = model.cfg
    assert (cfg.family, cfg.attn_softcap, cfg.final_softcap) == ("gemma2", 0.5, 1.5)
    assert [cfg.window_of(i) for i in range(4)] == [8, None, 8, None]
    assert not cfg.qk_norm and cfg.rope_local_theta is None
    tokens = _tokens()
    ref = _logits(hf, tokens)
    assert ref.abs().max() > 1.0  # the final cap (1.5) binds
    assert (_logits(model, tokens) - ref).abs().max().item() <= TOL
    # without the caps the logits differ: the test would see a dropped cap
    cores = [layer.attention.core for layer in model.layers.values()]
    for core in cores:
        core.softcap = None
    assert (_logits(model, tokens) - ref).abs().max().item() > 1e-3
    for core in cores:
        core.softcap = 0.5

    to_hf(model, cfg, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf)
    assert back.config.attn_logit_softcapping == 0.5
    assert back.config.final_logit_softcapping == 1.5
    back_sd = back.state_dict()
    for name, t in hf.state_dict().items():
        # 1 + w and back in fp32 loses the low bits of w (up to ~1e-7 at |w| ~ 1)
        torch.testing.assert_close(back_sd[name], t, rtol=0, atol=3e-7, msg=name)

    # generation: 20 tokens, then 12 one at a time through the KV cache
    cache = KVCache()
    with torch.no_grad():
        steps = [model(tokens[:, :20], cache=cache)]
        steps += [model(tokens[:, t:t + 1], cache=cache) for t in range(20, 32)]
    assert (torch.cat(steps, dim=1) - ref).abs().max().item() <= TOL

    # packed rows: two documents in a row == each run alone
    ids = torch.tensor([[0] * 20 + [1] * 12] * 2)
    positions = torch.cat([torch.arange(20), torch.arange(12)])
    with torch.no_grad():
        packed = model(tokens, positions=positions, document_ids=ids)
        first, second = model(tokens[:, :20]), model(tokens[:, 20:])
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), rtol=0, atol=TOL)


def test_capped_head_takes_plain_loss():
    hf_cfg = make_hf().config.to_dict()
    from giantmodel.models import build_model

    model = build_model(hf_config_to_model_config(hf_cfg))
    impl, why = resolve_loss_impl("chunked", model.output, "cpu")
    assert impl == "plain" and "final_softcap" in why
    uncapped = build_model(hf_config_to_model_config({**hf_cfg, "final_logit_softcapping": None}))
    assert resolve_loss_impl("chunked", uncapped.output, "cpu") == ("chunked", "")


def test_soft_capping_bad_values_and_cp_fail_before_launch():
    from giantmodel.config import ConfigError, load_config
    from giantmodel.distributed.parallel_dims import ParallelDims

    base = ["model.family=gemma2", "model.hidden_size=64", "model.num_heads=4",
            "model.num_kv_heads=2", "model.ffn_hidden_size=96", "model.vocab_size=4096",
            "model.num_layers=2", "model.max_seq_len=64", "train.seq_len=32",
            "train.global_batch_size=4", "train.micro_batch_size=2"]
    with pytest.raises(ConfigError, match="model.attn_softcap"):
        load_config(None, [*base, "model.attn_softcap=0"])
    cfg = load_config(None, [*base, "model.attn_softcap=50.0", "parallel.cp=2"])
    with pytest.raises(ConfigError, match="parallel.cp"):
        ParallelDims.from_config(cfg, 2)


def test_soft_caps_on_export_each_format_writes_its_own_and_refuses_the_rest(tmp_path):
    """Gemma 3's format carries the final-logit cap (Gemma3ForCausalLM
    applies it; its attention ignores attn_logit_softcapping): a capped
    Gemma 3 reads, runs like transformers' and writes the cap back
    (convert --to hf's save_hf). A cap that a family's format has no key
    for (or transformers would not apply) fails in one line naming the key
    and where it can go, before anything is written; Gemma 2 writes both
    (test_parity_round_trip_cache_and_packing)."""
    import json

    from giantmodel.config.errors import UserInputError
    from giantmodel.models import build_model
    from giantmodel.models.families import FAMILIES
    from giantmodel.models.hf import model_config_to_hf_config

    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-6,
        head_dim=24, sliding_window=8, query_pre_attn_scalar=20, final_logit_softcapping=1.5)
    torch.manual_seed(0)
    hf = perturb(transformers.Gemma3ForCausalLM(cfg).eval(), scale=0.3)
    hf.save_pretrained(tmp_path / "src")
    model = from_hf(tmp_path / "src").eval()
    assert (model.cfg.family, model.cfg.attn_softcap, model.cfg.final_softcap) == \
        ("gemma3_text", None, 1.5)
    tokens = _tokens()
    ref = _logits(hf, tokens)
    assert ref.abs().max() > 1.0  # the cap (1.5) binds
    assert (_logits(model, tokens) - ref).abs().max().item() <= TOL
    to_hf(model, model.cfg, tmp_path / "back")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["final_logit_softcapping"] == 1.5
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert (_logits(back, tokens) - ref).abs().max().item() <= TOL

    assert {n for n, f in FAMILIES.items() if "attn_softcap" in f.softcaps} == {"gemma2"}
    assert {n for n, f in FAMILIES.items() if "final_softcap" in f.softcaps} \
        == {"gemma2", "gemma3_text"}
    refused = 0
    for name, family in sorted(FAMILIES.items()):
        for key in set(("attn_softcap", "final_softcap")) - family.softcaps:
            bad = ModelConfig(**{**model.cfg.__dict__, "family": name, key: 30.0})
            with pytest.raises(UserInputError, match=f"model.{key}=30.0 cannot be written in "
                                                     f"the {name} format") as e:
                model_config_to_hf_config(bad)
            assert "\n" not in str(e.value) and "export it as gemma2" in str(e.value)
            refused += 1
    assert refused == 2 * len(FAMILIES) - 3
    for family, key in (("mistral", "final_softcap"), ("gemma3_text", "attn_softcap")):
        out = tmp_path / f"as_{family}"
        bad = ModelConfig(**{**model.cfg.__dict__, "family": family, key: 30.0})
        with pytest.raises(UserInputError, match=f"model.{key}"):
            to_hf(build_model(bad), bad, out)
        assert not out.exists() or not any(out.iterdir())
