"""Mixtral, Qwen3-MoE and DeepSeek-V3: parity with transformers' own classes
on tiny random configs (fp32), round trips, both expert layouts, the convert
CLI and ``checkpoint.init_from`` both ways, DeepSeek-V3's multi-token-prediction
layers skipped on load, YaRN against transformers' frequencies, config
checks, LoRA on attention of a Mixtral base (trained, exported to peft), and
the full-size recipes."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from hf_helpers import logits as _logits

from giantmodel.checkpoint import load_model_from_checkpoint  # noqa: E402
from giantmodel.checkpoint.convert import add_arguments, main  # noqa: E402
from giantmodel.checkpoint.weights import load_model_weights  # noqa: E402
from giantmodel.config import load_config  # noqa: E402
from giantmodel.config.errors import ConfigError, UserInputError  # noqa: E402
from giantmodel.config.loader import to_dict  # noqa: E402
from giantmodel.config.mla import MLAConfig  # noqa: E402
from giantmodel.config.model import ModelConfig, RopeScaling  # noqa: E402
from giantmodel.config.moe import MoEConfig  # noqa: E402
from giantmodel.models import build_model  # noqa: E402
from giantmodel.models.common.layers import rope_inv_freq  # noqa: E402
from giantmodel.models.common.moe import moe_layers  # noqa: E402
from giantmodel.models.hf import from_hf, hf_config_to_model_config, to_hf  # noqa: E402

TOL = 1e-5
BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-6)
YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
DEEPSEEK = dict(BASE, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
                moe_intermediate_size=32, n_shared_experts=2, n_group=4, topk_group=2,
                first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)


def make_hf(kind: str, **kw):
    """A tiny transformers model with every weight perturbed and, for
    DeepSeek, a random non-zero routing correction bias."""
    classes = {"mixtral": ("MixtralConfig", "MixtralForCausalLM"),
               "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
               "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}
    cfg_cls, model_cls = (getattr(transformers, n) for n in classes[kind])
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kw)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.2)
    return model


CASES = {
    # top-3 of 6, every layer MoE
    "mixtral": lambda: make_hf("mixtral", **BASE, num_local_experts=6, num_experts_per_tok=3),
    # no renormalisation, a dense first layer, head_dim != hidden / heads
    "qwen3_moe": lambda: make_hf("qwen3_moe", **BASE, head_dim=24, num_experts=8,
                                 num_experts_per_tok=3, moe_intermediate_size=32,
                                 mlp_only_layers=[0], norm_topk_prob=False),
    # renormalised, every second layer MoE (decoder_sparse_step)
    "qwen3_moe_step": lambda: make_hf("qwen3_moe", **BASE, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                      decoder_sparse_step=2, norm_topk_prob=True),
    # MLA with a low-rank query, YaRN (the sequence runs past 4x16), group-limited
    # routing (2 of 4 groups) with a bias, two shared experts, a dense first layer
    "deepseek_v3": lambda: make_hf("deepseek_v3", **DEEPSEEK, q_lora_rank=24,
                                   rope_parameters=YARN),
    # a full query projection, half-split RoPE, no scaling, top-k from all groups
    "deepseek_v3_plain": lambda: make_hf("deepseek_v3", **{**DEEPSEEK, "n_group": 1,
                                                           "topk_group": 1},
                                         q_lora_rank=None, rope_interleave=False),
}


def _tokens(B=2, T=40):
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(2))


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.timeout(120)
def test_parity_and_round_trip(tmp_path):
    """from_hf logits == transformers'; the config predicts the parameter
    count; the correction bias is loaded (and matters); giantmodel -> HF
    writes tensors transformers loads back exactly."""
    tokens = _tokens()
    for case, make in CASES.items():
        hf = make()
        src, dst = tmp_path / case, tmp_path / f"{case}-back"
        hf.save_pretrained(src)
        model = from_hf(src)
        assert model.cfg.family == hf.config.model_type, case
        assert model.cfg.num_params() == sum(p.numel() for p in model.parameters()), case
        ref = _logits(hf, tokens)
        assert _max_diff(_logits(model, tokens), ref) <= TOL, case
        to_hf(model, model.cfg, dst)
        back = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
        assert type(back) is type(hf), case
        assert _max_diff(_logits(back, tokens), ref) <= TOL, case
        back_sd = back.state_dict()
        for name, t in hf.state_dict().items():
            assert torch.equal(back_sd[name], t), (case, name)
        if case == "deepseek_v3":
            hf_bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
            moe = moe_layers(model)
            assert len(moe) == 2 and torch.equal(moe[0].router.expert_bias, hf_bias)
            for m in moe:
                m.router.expert_bias.zero_()
            assert _max_diff(_logits(model, tokens), ref) > 1e-3  # the bias changes routing


@pytest.mark.timeout(60)
def test_stacked_expert_layout_and_init_from(tmp_path):
    """transformers 5's stacked experts (gate_up_proj / down_proj, written with
    save_original_format=False) read the same as the per-expert layout, and
    checkpoint.init_from fills a model built from the config (bias included)."""
    tokens = _tokens()
    for case in ("mixtral", "deepseek_v3"):
        hf = CASES[case]()
        hf.save_pretrained(tmp_path / case, save_original_format=False)
        keys = set(json.loads((tmp_path / case / "model.safetensors.index.json").read_text())
                   ["weight_map"]) if (tmp_path / case / "model.safetensors.index.json").exists() \
            else set(_safetensors_keys(tmp_path / case))
        assert "model.layers.1.mlp.experts.gate_up_proj" in keys, case
        ref = _logits(hf, tokens)
        assert _max_diff(_logits(from_hf(tmp_path / case), tokens), ref) <= TOL, case
        cfg = hf_config_to_model_config(json.loads((tmp_path / case / "config.json").read_text()))
        model = build_model(cfg, "cpu")
        load_model_weights(model, tmp_path / case)
        for m in model.modules():
            if hasattr(m, "init_buffers"):
                m.init_buffers()
        assert _max_diff(_logits(model.eval(), tokens), ref) <= TOL, case


def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


@pytest.mark.timeout(60)
def test_convert_cli_both_ways_and_mtp_layers_skipped(tmp_path, caplog):
    """HF -> giantmodel run (DCP, bias included) -> HF with the CLI keeps the
    logits; a checkpoint with a multi-token-prediction layer loads, skipping
    it with a one-line note."""
    from safetensors.torch import load_file, save_file

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    tokens = _tokens()
    hf = CASES["deepseek_v3"]()
    base = tmp_path / "hf"
    hf.save_pretrained(base)
    ref = _logits(hf, tokens)
    # an MTP layer as DeepSeek ships it: model.layers.{num_hidden_layers}.*
    state = load_file(str(base / "model.safetensors"))
    state.update({"model.layers.3.eh_proj.weight": torch.randn(64, 128),
                  "model.layers.3.enorm.weight": torch.ones(64),
                  "model.layers.3.self_attn.kv_b_proj.weight": torch.randn(80, 16)})
    save_file(state, str(base / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**hf_cfg, "num_nextn_predict_layers": 1}))
    run, back = tmp_path / "run", tmp_path / "back"
    with caplog.at_level(logging.WARNING):
        assert main(parser.parse_args([str(base), str(run)])) == 0
    notes = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(notes) == 1 and "\n" not in notes[0] and "model.layers.3" in notes[0]
    assert _max_diff(_logits(load_model_from_checkpoint(run), tokens), ref) <= TOL
    assert main(parser.parse_args([str(run), str(back)])) == 0
    out_cfg = json.loads((back / "config.json").read_text())
    assert out_cfg["model_type"] == "deepseek_v3" and out_cfg["num_nextn_predict_layers"] == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert _max_diff(_logits(model, tokens), ref) <= TOL


def test_yarn_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.DeepseekV3Config(**DEEPSEEK, q_lora_rank=24, rope_parameters=YARN)
    inv, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    cfg = hf_config_to_model_config(hf_cfg.to_dict())
    assert cfg.rope_scaling.type == "yarn" and cfg.rotary_dim == 8
    assert torch.allclose(rope_inv_freq(8, cfg.rope_theta, cfg.rope_scaling), inv, rtol=1e-6)
    assert cfg.rope_scaling.yarn_attention_factor() == pytest.approx(attention_factor)
    # DeepSeek's softmax scale: qk_head_dim ** -0.5 * mscale(factor, mscale_all_dim) ** 2
    attn = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(hf_cfg, 0)
    mla = build_model(cfg).layers["0"].attention
    assert mla.q_mult * cfg.mla.qk_head_dim ** -0.5 == pytest.approx(attn.scaling)


def test_config_checks_and_bad_input():
    mixtral = hf_config_to_model_config(CASES["mixtral"]().config.to_dict())
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.router) == (6, 3, "softmax")
    deepseek = hf_config_to_model_config(CASES["deepseek_v3"]().config.to_dict())
    m = deepseek.moe
    assert (m.n_group, m.topk_group, m.first_k_dense, m.num_shared_experts) == (4, 2, 1, 2)
    assert m.router == "sigmoid" and m.routed_scaling_factor == 2.5
    assert deepseek.mla == MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                                     qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True)
    # a format that cannot hold something refuses before writing, naming the key
    shared = ModelConfig(**{**mixtral.__dict__,
                            "moe": MoEConfig(num_experts=6, top_k=3, num_shared_experts=1)})
    with pytest.raises(UserInputError, match="model.moe.num_shared_experts"):
        to_hf(build_model(shared), shared, "/nonexistent")
    balanced = ModelConfig(**{**mixtral.__dict__,
                              "moe": MoEConfig(num_experts=6, top_k=3, bias_update_rate=0.01)})
    with pytest.raises(UserInputError, match="model.moe.bias_update_rate"):
        to_hf(build_model(balanced), balanced, "/nonexistent")
    with pytest.raises(UserInputError, match="model.mla"):
        to_hf(build_model(mixtral), ModelConfig(**{**mixtral.__dict__, "family": "deepseek_v3"}),
              "/nonexistent")
    yarn = ModelConfig(**{**mixtral.__dict__, "rope_scaling": RopeScaling(type="yarn")})
    with pytest.raises(UserInputError, match="model.rope_scaling.type"):
        to_hf(build_model(yarn), yarn, "/nonexistent")
    with pytest.raises(UserInputError, match="'yarn'"):
        hf_config_to_model_config({**deepseek_hf(), "rope_scaling": {"type": "dynamic",
                                                                     "factor": 2.0}})
    # MLA settings are validated where the config is built, naming the key
    with pytest.raises(ConfigError, match="model.head_dim") as e:
        ModelConfig(num_kv_heads=None, head_dim=32,
                    mla=MLAConfig(qk_nope_head_dim=8, qk_rope_head_dim=8)).validate()
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="model.num_kv_heads"):
        ModelConfig(num_kv_heads=2, head_dim=16,
                    mla=MLAConfig(qk_nope_head_dim=8, qk_rope_head_dim=8)).validate()
    with pytest.raises(ConfigError, match="model.mla.qk_rope_head_dim"):
        ModelConfig(num_kv_heads=None, head_dim=16,
                    mla=MLAConfig(qk_nope_head_dim=9, qk_rope_head_dim=7)).validate()


def deepseek_hf() -> dict:
    return transformers.DeepseekV3Config(**DEEPSEEK, q_lora_rank=24).to_dict()


@pytest.mark.timeout(120)
def test_lora_on_mixtral_attention_trains_and_exports_to_peft(tmp_path):
    """LoRA on a Mixtral base's attention through the real trainer: the
    adapters train, and convert --to peft gives adapters that transformers +
    peft apply to the HF base with giantmodel's logits."""
    peft = pytest.importorskip("peft")
    from giantmodel.train.trainer import Trainer

    hf = CASES["mixtral"]()
    base, run, adapter = tmp_path / "base", tmp_path / "run", tmp_path / "peft"
    hf.save_pretrained(base)
    model_cfg = hf_config_to_model_config(json.loads((base / "config.json").read_text()))
    raw = {"objective": "lora", "model": to_dict(model_cfg),
           "lora": {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]},
           "data": {"source": "synthetic"}, "checkpoint": {"init_from": str(base), "every": 2},
           "run": {"dir": str(run), "tensorboard": False, "progress": False},
           "train": {"steps": 2, "seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2,
                     "eval_every": 0, "sample_tokens": 0, "device": "cpu"},
           "optim": {"lr": 0.01, "warmup_steps": 0, "schedule": "constant"},
           "precision": "fp32"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    trainer = Trainer(load_config(tmp_path / "job.yaml"))
    try:
        trainer.train()
    finally:
        trainer.close()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert main(parser.parse_args([str(run), str(adapter), "--to", "peft"])) == 0
    tokens = _tokens(T=24)
    ours = _logits(load_model_from_checkpoint(run).eval(), tokens)
    assert _max_diff(ours, _logits(hf, tokens)) > 1e-4  # the adapters trained
    with_adapter = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    assert _max_diff(ours, _logits(with_adapter, tokens)) <= TOL


PUBLISHED = {  # total parameters (config.json shapes, HF model cards)
    "mixtral-8x7b.yaml": 46.70e9, "qwen3-30b-a3b.yaml": 30.53e9, "deepseek-v3.yaml": 671.0e9,
}


def test_full_size_recipes_load_with_published_sizes():
    root = Path(__file__).resolve().parents[1] / "configs" / "moe"
    for name, total in PUBLISHED.items():
        cfg = load_config(root / name)
        assert cfg.model.moe is not None and cfg.model.family, name
        assert abs(cfg.model.num_params() - total) / total < 0.01, (name, cfg.model.num_params())


def test_mla_packed_documents_and_kv_cache():
    """DeepSeek-V3's latent attention under a packed-document mask equals each
    document run alone (the value width padded to the query's there), and
    generation with a KV cache gives the full forward's logits."""
    from giantmodel.models.common.layers import KVCache

    cfg = hf_config_to_model_config(CASES["deepseek_v3"]().config.to_dict())
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    for m in model.modules():
        if hasattr(m, "init_buffers"):
            m.init_buffers()
    model.eval()
    tokens = _tokens(B=1, T=20)
    doc = torch.tensor([[0] * 12 + [1] * 8])
    positions = torch.cat([torch.arange(12), torch.arange(8)])
    with torch.no_grad():
        packed = model(tokens, positions=positions[None], document_ids=doc)
        first, second = model(tokens[:, :12]), model(tokens[:, 12:])
        assert _max_diff(packed, torch.cat([first, second], dim=1)) <= TOL
        cache = KVCache()
        model(tokens[:, :15], cache=cache)
        step = model(tokens[:, 15:16], cache=cache)
        assert _max_diff(step[:, -1], model(tokens[:, :16])[:, -1]) <= TOL


def test_latent_attention_refuses_tensor_parallelism_before_launch():
    from giantmodel.config import ConfigError, load_config
    from giantmodel.distributed.parallel_dims import ParallelDims

    cfg = load_config("configs/moe/deepseek-v3.yaml", ["parallel.tp=2", "parallel.pp=1",
                                                       "parallel.ep=1", "parallel.dp=1",
                                                       "parallel.pp_layers=null"])
    with pytest.raises(ConfigError, match="parallel.tp"):
        ParallelDims.from_config(cfg, 2)
