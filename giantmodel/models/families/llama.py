"""LLaMA (``LlamaForCausalLM``), and the llama-like layout other families reuse.

Conversion is a pure renaming: giantmodel's RoPE uses HF's half-split
pairing, so q/k weights need no permutation. RoPE is written in both the
transformers-5 form (``rope_parameters``) and the older ``rope_theta`` /
``rope_scaling`` keys, so either generation reads it.
"""

from __future__ import annotations

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig, RopeScaling
from giantmodel.models.families.base import Family, NameMap

LAYER = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}
"""HF module inside a decoder layer -> giantmodel module inside a block."""
TOP = {"embed_tokens.weight": "tok_embeddings.weight", "norm.weight": "norm.weight"}

LLAMA_NAMES = NameMap(base="model.", layers="layers", top=TOP, layer=LAYER)


def rope_params(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from either config style: transformers 5
    nests both in ``rope_parameters``; older configs use ``rope_theta`` and
    ``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params else None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise UserInputError(
                f"RoPE scaling type {kind!r} is not supported; giantmodel implements the "
                "default and 'llama3' schemes")
    return float(theta), scaling


class LlamaFamily(Family):
    name = "llama"
    model_types = ("llama",)
    architectures = ("LlamaForCausalLM",)
    names = LLAMA_NAMES

    def config_from_hf(self, hf: dict) -> dict:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UserInputError(f"{self.name} hidden_act {act!r} is not supported; "
                                 "expected 'silu'")
        if hf.get("mlp_bias"):
            raise UserInputError(f"{self.name} with mlp_bias=true is not supported "
                                 "(giantmodel's SwiGLU has no biases)")
        theta, scaling = rope_params(hf)
        rope_scaling = None
        if scaling is not None:
            rope_scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                original_max_seq_len=int(scaling["original_max_position_embeddings"]))
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim")
        kv = hf.get("num_key_value_heads")
        return dict(
            arch="llama", hidden_size=hidden, num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(kv) if kv is not None else None,
            head_dim=int(head_dim) if head_dim and head_dim * heads != hidden else None,
            ffn_hidden_size=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)), rope_theta=theta,
            rope_scaling=rope_scaling, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            init_std=float(hf.get("initializer_range", 0.02)), dropout=0.0,
            attn_bias=bool(hf.get("attention_bias", False)))

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        scaling = None
        rope_parameters: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling is not None:
            s = cfg.rope_scaling
            scaling = {"rope_type": "llama3", "factor": s.factor,
                       "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                       "original_max_position_embeddings": s.original_max_seq_len}
            rope_parameters = {**scaling, "rope_theta": cfg.rope_theta}
        return {
            "architectures": [self.architectures[0]], "model_type": self.name,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.dim_per_head, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
            "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
            "rope_parameters": rope_parameters,
            "attention_bias": cfg.attn_bias, "attention_dropout": 0.0, "mlp_bias": False,
        }

    def check(self, cfg: ModelConfig) -> None:
        self.refuse(cfg, arch="llama", qkv_bias=False, qk_norm=False,
                    sliding_window=None)


FAMILY = LlamaFamily()
