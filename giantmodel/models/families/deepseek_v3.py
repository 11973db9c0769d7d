"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention
(:mod:`giantmodel.models.common.mla`) with YaRN RoPE, the first
``first_k_dense_replace`` layers dense and the rest MoE: sigmoid scores with
a correction bias (``e_score_correction_bias``) used to choose experts only,
group-limited top-k (``n_group`` / ``topk_group``), ``routed_scaling_factor``
and ``n_shared_experts`` shared experts ``moe_intermediate_size`` wide each.

The multi-token-prediction layers (``model.layers.{num_hidden_layers}...``,
``num_nextn_predict_layers`` of them) are not part of giantmodel's model:
reading skips their tensors with a one-line note, and exports have none.
Experts: see :mod:`giantmodel.models.families.experts`.
"""

from __future__ import annotations

import logging
import re

import torch

from giantmodel.config.errors import UserInputError
from giantmodel.config.mla import MLAConfig
from giantmodel.config.model import ModelConfig, RopeScaling
from giantmodel.config.moe import MoEConfig
from giantmodel.models.families.base import Family, NameMap
from giantmodel.models.families.experts import ExpertLayout, StackedExperts
from giantmodel.models.families.llama import TOP

log = logging.getLogger(__name__)

LAYER = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attention.wq",
    "self_attn.q_a_proj": "attention.wq_a",
    "self_attn.q_a_layernorm": "attention.q_norm",
    "self_attn.q_b_proj": "attention.wq_b",
    "self_attn.kv_a_proj_with_mqa": "attention.wkv_a",
    "self_attn.kv_a_layernorm": "attention.kv_norm",
    "self_attn.kv_b_proj": "attention.wkv_b",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.gate": "feed_forward.router.gate",
    "mlp.shared_experts.gate_proj": "feed_forward.shared_experts.w1",
    "mlp.shared_experts.up_proj": "feed_forward.shared_experts.w3",
    "mlp.shared_experts.down_proj": "feed_forward.shared_experts.w2",
}
DEEPSEEK_V3_NAMES = NameMap(base="model.", layers="layers", top=TOP, layer=LAYER)
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def yarn_from_hf(hf: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` / ``rope_scaling`` (DeepSeek's own config.json): none or 'yarn'."""
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    s = hf.get("rope_scaling") or params
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise UserInputError(f"deepseek_v3 RoPE scaling type {kind!r} is not supported; "
                             "giantmodel reads none or 'yarn'")
    if s.get("truncate", True) is False:
        raise UserInputError("deepseek_v3 yarn with truncate=false is not supported")
    original = int(s["original_max_position_embeddings"])
    factor = s.get("factor") or int(hf.get("max_position_embeddings", 4096)) / original
    opt = {k: float(s[k]) for k in ("mscale", "mscale_all_dim", "attention_factor")
           if s.get(k) is not None}
    return theta, RopeScaling(type="yarn", factor=float(factor), original_max_seq_len=original,
                              beta_fast=float(s.get("beta_fast") or 32),
                              beta_slow=float(s.get("beta_slow") or 1), **opt)


def yarn_to_hf(theta: float, s: RopeScaling | None) -> dict:
    """``rope_theta``, ``rope_scaling`` and ``rope_parameters``, so either
    transformers generation reads them."""
    if s is None:
        return {"rope_theta": theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    scaling = {"rope_type": "yarn", "type": "yarn", "factor": s.factor,
               "original_max_position_embeddings": s.original_max_seq_len,
               "beta_fast": s.beta_fast, "beta_slow": s.beta_slow}
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(s, key) is not None:
            scaling[key] = getattr(s, key)
    return {"rope_theta": theta, "rope_scaling": scaling,
            "rope_parameters": {**scaling, "rope_theta": theta}}


class DeepseekV3Family(StackedExperts, Family):
    name = "deepseek_v3"
    model_types = ("deepseek_v3",)
    architectures = ("DeepseekV3ForCausalLM",)
    names = DEEPSEEK_V3_NAMES
    experts = ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj",
                           bias="e_score_correction_bias")

    def config_from_hf(self, hf: dict) -> dict:
        if hf.get("hidden_act", "silu") != "silu":
            raise UserInputError(f"deepseek_v3 hidden_act {hf['hidden_act']!r} is not "
                                 "supported; expected 'silu'")
        if hf.get("attention_bias"):
            raise UserInputError("deepseek_v3 with attention_bias=true is not supported")
        theta, scaling = yarn_from_hf(hf)
        # Defaults are DeepseekV3Config's, for keys a config.json leaves out.
        mla = MLAConfig(q_lora_rank=hf.get("q_lora_rank", 1536),
                        kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
                        qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
                        qk_rope_head_dim=int(hf.get("qk_rope_head_dim", 64)),
                        v_head_dim=int(hf.get("v_head_dim", 128)),
                        rope_interleave=bool(hf.get("rope_interleave", True)))
        moe = MoEConfig(num_experts=int(hf.get("n_routed_experts",
                                                  hf.get("num_local_experts", 256))),
                        top_k=int(hf.get("num_experts_per_tok", 8)), router="sigmoid",
                        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                        n_group=int(hf.get("n_group") or 1),
                        topk_group=int(hf.get("topk_group") or 1),
                        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
                        expert_ffn_hidden_size=int(hf.get("moe_intermediate_size", 2048)),
                        num_shared_experts=int(hf.get("n_shared_experts", 1)),
                        first_k_dense=int(hf.get("first_k_dense_replace", 3)))
        return dict(
            arch="llama", hidden_size=int(hf["hidden_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=int(hf["num_attention_heads"]), num_kv_heads=None,
            head_dim=mla.qk_head_dim, ffn_hidden_size=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", 4096)), rope_theta=theta,
            rope_scaling=scaling, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            init_std=float(hf.get("initializer_range", 0.02)), dropout=0.0, mla=mla, moe=moe)

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        a, m = cfg.mla, cfg.moe
        return {
            "architectures": [self.architectures[0]], "model_type": self.name,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size,
            "moe_intermediate_size": m.expert_width(cfg.ffn_hidden_size),
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_heads, "n_shared_experts": m.num_shared_experts,
            "n_routed_experts": m.num_experts, "routed_scaling_factor": m.routed_scaling_factor,
            "kv_lora_rank": a.kv_lora_rank, "q_lora_rank": a.q_lora_rank,
            "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim,
            "qk_nope_head_dim": a.qk_nope_head_dim, "rope_interleave": a.rope_interleave,
            "n_group": m.n_group, "topk_group": m.topk_group, "num_experts_per_tok": m.top_k,
            "first_k_dense_replace": m.first_k_dense, "norm_topk_prob": m.norm_topk_prob,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
            "attention_dropout": 0.0, "num_nextn_predict_layers": 0,
            **yarn_to_hf(cfg.rope_theta, cfg.rope_scaling),
        }

    def check(self, cfg: ModelConfig) -> None:
        if cfg.mla is None:
            raise UserInputError("the deepseek_v3 format needs multi-head latent attention "
                                 "(model.mla)")
        self.refuse(cfg, arch="llama", post_norms=False, embed_scale=False,
                    mlp_activation="silu")
        self.refuse_rope(cfg, "yarn")
        m = cfg.moe
        self.refuse_moe(cfg, router="sigmoid", dense_layers=[], sparse_step=1,
                        shared_expert_gate=False)
        if m.shared_expert_ffn_hidden_size not in (None, m.expert_ffn_hidden_size):
            raise UserInputError("model.moe.shared_expert_ffn_hidden_size cannot be written in "
                                 "the deepseek_v3 format (shared experts are "
                                 "moe_intermediate_size wide); leave it null")

    def to_native(self, name: str, tensor: torch.Tensor,
                  cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
        m = _LAYER_INDEX.match(name)
        if m is not None and int(m.group(1)) >= cfg.num_layers:
            # Noted once per MTP layer and read: on the projection every such layer has.
            if name.endswith(".eh_proj.weight"):
                log.warning("deepseek_v3: skipping model.layers.%s.* (a multi-token-prediction "
                            "layer; giantmodel's DeepSeek-V3 has no MTP head)", m.group(1))
            return []
        return super().to_native(name, tensor, cfg)


FAMILY = DeepseekV3Family()
