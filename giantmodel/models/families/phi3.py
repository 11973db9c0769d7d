"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``, model_type ``phi3``).

LLaMA's block with q, k and v fused in one ``qkv_proj`` and gate and up in
one ``gate_up_proj`` in the checkpoint (split on load, concatenated on
save), LongRoPE on the long-context sizes (short and long per-frequency
factors, cos/sin scaled by the attention factor), a partial rotary factor
(Phi-4-mini rotates 3/4 of each head) and, on some sizes, a sliding window
on every layer (Phi-3-mini-4k: 2047).
"""

from __future__ import annotations

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig
from giantmodel.models.families.base import Fused, NameMap
from giantmodel.models.families.gemma3 import rope_scaling_from_hf, rope_scaling_to_hf
from giantmodel.models.families.llama import TOP, LlamaFamily

PHI3_NAMES = NameMap(
    base="model.", layers="layers", top=TOP,
    layer={"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.o_proj": "attention.wo", "mlp.down_proj": "feed_forward.w2"},
    fused={
        "self_attn.qkv_proj": Fused(
            ("attention.wq", "attention.wk", "attention.wv"),
            lambda c: (c.num_heads * c.dim_per_head, c.kv_heads * c.dim_per_head,
                       c.kv_heads * c.dim_per_head)),
        "mlp.gate_up_proj": Fused(("feed_forward.w1", "feed_forward.w3"),
                                  lambda c: (c.ffn_hidden_size, c.ffn_hidden_size)),
    })


class Phi3Family(LlamaFamily):
    name = "phi3"
    model_types = ("phi3",)
    architectures = ("Phi3ForCausalLM",)
    names = PHI3_NAMES

    def config_from_hf(self, hf: dict) -> dict:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UserInputError(f"phi3 hidden_act {act!r} is not supported; expected 'silu'")
        params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        params.setdefault("original_max_position_embeddings",
                          hf.get("original_max_position_embeddings", 4096))
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
        partial = float(params.get("partial_rotary_factor",
                                   hf.get("partial_rotary_factor", 1.0)))
        max_len = int(hf.get("max_position_embeddings", 4096))
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        kv = hf.get("num_key_value_heads")
        window = hf.get("sliding_window")
        if window and window >= max_len:  # never binding (Phi-3 128k: 262144)
            window = None
        return dict(
            arch="llama", hidden_size=hidden, num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(kv) if kv else None,
            ffn_hidden_size=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
            max_seq_len=max_len, rope_theta=theta,
            rope_scaling=rope_scaling_from_hf(params, max_len), partial_rotary_factor=partial,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            init_std=float(hf.get("initializer_range", 0.02)), dropout=0.0,
            sliding_window=int(window) if window else None)

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        s = cfg.rope_scaling
        rope = {**rope_scaling_to_hf(s), "rope_theta": cfg.rope_theta,
                "partial_rotary_factor": cfg.partial_rotary_factor}
        original = s.original_max_seq_len if s is not None else cfg.max_seq_len
        # Phi3Config's default special ids (32000) are outside a small
        # vocabulary, where transformers refuses them as padding_idx.
        special = 32000 if cfg.vocab_size > 32000 else None
        return {
            "architectures": [self.architectures[0]], "model_type": self.name,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
            "original_max_position_embeddings": original, "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
            "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor,
            "rope_scaling": None if s is None else rope_scaling_to_hf(s),
            "rope_parameters": rope, "sliding_window": cfg.sliding_window,
            "attention_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "pad_token_id": special, "eos_token_id": special,
        }

    def check(self, cfg: ModelConfig) -> None:
        self.refuse(cfg, arch="llama", attn_bias=False, qkv_bias=False, qk_norm=False,
                    layer_types=None, attn_scale=None, post_norms=False, mlp_activation="silu",
                    embed_scale=False)
        if cfg.dim_per_head * cfg.num_heads != cfg.hidden_size:
            raise UserInputError(f"model.head_dim={cfg.head_dim} cannot be written in the phi3 "
                                 "format (head_dim is hidden_size / num_heads there)")


FAMILY = Phi3Family()
