"""GPT-2 (``GPT2LMHeadModel``): ``Conv1D`` weights are stored transposed
([in, out]) and ``c_attn`` packs q, k and v in one matrix."""

from __future__ import annotations

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig
from giantmodel.models.families.base import Family, Fused, NameMap

GPT2_NAMES = NameMap(
    base="transformer.", layers="h",
    top={"wte.weight": "tok_embeddings.weight", "wpe.weight": "pos_embeddings.weight",
         "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias"},
    layer={"ln_1": "attention_norm", "ln_2": "ffn_norm", "attn.c_proj": "attention.wo",
           "mlp.c_fc": "feed_forward.w1", "mlp.c_proj": "feed_forward.w2"},
    fused={"attn.c_attn": Fused(("attention.wq", "attention.wk", "attention.wv"),
                                lambda cfg: (cfg.hidden_size,) * 3)},
    transposed=frozenset({"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}))


class GPT2Family(Family):
    name = "gpt2"
    model_types = ("gpt2",)
    architectures = ("GPT2LMHeadModel",)
    arch = "gpt"
    names = GPT2_NAMES

    def config_from_hf(self, hf: dict) -> dict:
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UserInputError(f"GPT-2 activation_function {act!r} is not supported; "
                                 "giantmodel's GPT uses the tanh GELU ('gelu_new')")
        if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
            raise UserInputError("GPT-2 with non-standard attention scaling "
                                 "(scale_attn_weights=false or scale_attn_by_inverse_layer_idx"
                                 "=true) is not supported")
        hidden = int(hf["n_embd"])
        return dict(
            arch="gpt", hidden_size=hidden, num_layers=int(hf["n_layer"]),
            num_heads=int(hf["n_head"]), num_kv_heads=None,
            ffn_hidden_size=int(hf.get("n_inner") or 4 * hidden),
            vocab_size=int(hf["vocab_size"]), max_seq_len=int(hf["n_positions"]),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            init_std=float(hf.get("initializer_range", 0.02)), dropout=0.0, attn_bias=True)

    def check(self, cfg: ModelConfig) -> None:
        self.refuse(cfg, arch="gpt")
        if cfg.kv_heads != cfg.num_heads or cfg.dim_per_head * cfg.num_heads != cfg.hidden_size:
            raise UserInputError(
                "GPT-2 format needs multi-head attention with head_dim = hidden_size / "
                f"num_heads; this model has num_kv_heads={cfg.kv_heads}, "
                f"head_dim={cfg.dim_per_head} (set model.num_kv_heads: null and "
                "model.head_dim: null to train exportable GPTs)")

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        return {
            "architectures": [self.architectures[0]], "model_type": self.name,
            "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len,
            "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
            "n_inner": cfg.ffn_hidden_size, "activation_function": "gelu_new",
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.init_std,
            "scale_attn_weights": True, "tie_word_embeddings": cfg.tie_embeddings,
        }


FAMILY = GPT2Family()
