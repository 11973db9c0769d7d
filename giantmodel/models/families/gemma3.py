"""Gemma 3, text (``Gemma3ForCausalLM``, model_type ``gemma3_text``).

The shared llama block with Gemma's differences, each a ModelConfig field:
local (sliding-window) and global layers (``layer_types``, or the older
``sliding_window_pattern``: every N-th layer global), a RoPE base per kind
(``rope_local_base_freq`` for the local layers, ``rope_theta`` and any
scaling for the global ones), the softmax scale ``query_pre_attn_scalar **
-0.5``, qk-norm, four norms per block (pre- and post-attention, pre- and
post-feed-forward), GeGLU with the tanh GELU, the embedding scaled by
sqrt(hidden) and tied embeddings; the final logits soft-capped when the
config sets ``final_logit_softcapping`` (Gemma3ForCausalLM applies it; its
attention ignores ``attn_logit_softcapping``, which is refused).

Gemma's RMSNorm multiplies by ``1 + w``: checkpoints store ``w``, the model
holds ``1 + w`` (computed in fp32 on load, subtracted on save), so the
shared RMSNorm, its initialisation to ones and its fused kernels serve
Gemma unchanged.
"""

from __future__ import annotations

import torch

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig, RopeScaling
from giantmodel.models.families.base import Family, NameMap
from giantmodel.models.families.llama import TOP


def softcap_from_hf(value) -> float | None:
    """A ``*_softcapping`` key: null (or 0, as some configs write "off") is none."""
    return float(value) if value else None


GEMMA3_NAMES = NameMap(base="model.", layers="layers", top=TOP, layer={
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "attention.out_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "feed_forward.out_norm",
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
})


def rope_scaling_from_hf(params: dict | None, max_len: int) -> RopeScaling | None:
    """A HF rope-parameters dict (``rope_type``/``type`` default, linear,
    llama3 or longrope; 'su' and 'yarn' are Phi-3's old names for longrope)
    as a :class:`RopeScaling`, or None for the default."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(type="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_seq_len=int(params["original_max_position_embeddings"]))
    if kind in ("longrope", "su", "yarn") and "short_factor" in params:
        original = int(params["original_max_position_embeddings"])
        factor = params.get("factor") or max_len / original
        attention = params.get("attention_factor")
        return RopeScaling(type="longrope", factor=float(factor), original_max_seq_len=original,
                           short_factor=[float(x) for x in params["short_factor"]],
                           long_factor=[float(x) for x in params["long_factor"]],
                           attention_factor=None if attention is None else float(attention))
    raise UserInputError(f"RoPE scaling type {kind!r} is not supported; giantmodel implements "
                         "default, linear, llama3 and longrope")


def rope_scaling_to_hf(s: RopeScaling | None) -> dict:
    """The inverse of :func:`rope_scaling_from_hf` (without rope_theta)."""
    if s is None:
        return {"rope_type": "default"}
    if s.type == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    if s.type == "longrope":
        out = {"rope_type": "longrope", "factor": s.factor, "short_factor": s.short_factor,
               "long_factor": s.long_factor,
               "original_max_position_embeddings": s.original_max_seq_len}
        if s.attention_factor is not None:
            out["attention_factor"] = s.attention_factor
        return out
    return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len}


def _int_if_whole(x: float) -> float | int:
    # transformers 5 types query_pre_attn_scalar as int (256, 168, ...).
    return int(round(x)) if abs(x - round(x)) < 1e-6 else x


def _is_norm(hf_name: str) -> bool:
    return hf_name.endswith("norm.weight")


# Multimodal Gemma 3 checkpoints (4B and up, model_type gemma3) hold the
# text model under one of these prefixes (transformers 4 / 5 naming) beside
# the vision tower, which text fine-tuning does not read.
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
           "model.multi_modal_projector.")


class Gemma3Family(Family):
    name = "gemma3_text"
    model_types = ("gemma3_text", "gemma3")
    """'gemma3' (multimodal): its text model only; exports write gemma3_text."""
    architectures = ("Gemma3ForCausalLM",)
    # transformers' Gemma3Attention keeps attn_logit_softcapping but never
    # passes it to its attention functions; Gemma3ForCausalLM caps the logits.
    softcaps = frozenset({"final_softcap"})
    names = GEMMA3_NAMES
    default_window_pattern = 6
    """Gemma 3: five local layers, then one global (``sliding_window_pattern``)."""

    def _layer_types(self, hf: dict, layers: int) -> list[str]:
        types = hf.get("layer_types")
        if types:
            return list(types)
        pattern = int(hf.get("sliding_window_pattern") or self.default_window_pattern)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(layers)]

    def _rope(self, hf: dict) -> tuple[float, float, dict | None]:
        """(global theta, local theta, global scaling) from either config
        style: transformers 5 nests a dict per layer type in
        ``rope_parameters``; older configs use ``rope_theta``,
        ``rope_local_base_freq`` and ``rope_scaling``."""
        params = hf.get("rope_parameters") or {}
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UserInputError("Gemma 3 with a scaled RoPE on its sliding layers is not "
                                 "supported (only the global layers' may be scaled)")
        theta = float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0)))
        local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))
        return theta, local_theta, hf.get("rope_scaling") or full or None

    def config_from_hf(self, hf: dict) -> dict:
        if "text_config" in hf:  # multimodal: the text model's own config
            hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", True),
                  **hf["text_config"]}
        self.check_activation(hf)
        for key in ("use_bidirectional_attention", "attention_bias", "attn_logit_softcapping"):
            if hf.get(key):
                raise UserInputError(f"{self.name} with {key}={hf[key]!r} is not supported")
        theta, local_theta, scaling = self._rope(hf)
        cfg = self.shared_config_from_hf(hf, 131_072, theta, scaling)
        cfg.update(qk_norm=True, rope_local_theta=local_theta if cfg["layer_types"] else None,
                   final_softcap=softcap_from_hf(hf.get("final_logit_softcapping")))
        return cfg

    def check_activation(self, hf: dict) -> None:
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UserInputError(f"{self.name} hidden_activation {act!r} is not supported; "
                                 "expected 'gelu_pytorch_tanh'")

    def shared_config_from_hf(self, hf: dict, default_len: int, theta: float,
                              scaling: dict | None) -> dict:
        """The ModelConfig keys Gemma 2 and Gemma 3 read alike from a text
        config (the reverse of :meth:`shared_hf_config`); ``default_len``:
        the format's max_position_embeddings when absent, ``theta`` and
        ``scaling``: the (global) RoPE base and scaling as each reads them.
        The window and layer pattern are dropped when no layer's window
        ever binds (none sliding, or one no shorter than max_seq_len)."""
        layers = int(hf["num_hidden_layers"])
        max_len = int(hf.get("max_position_embeddings", default_len))
        heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or 256)
        window = hf.get("sliding_window", 4096)
        types = self._layer_types(hf, layers)
        if not window or "sliding_attention" not in types or window >= max_len:
            window, types = None, None
        return dict(
            arch="llama", hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim if head_dim * heads != hidden else None,
            ffn_hidden_size=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
            max_seq_len=max_len, rope_theta=theta,
            rope_scaling=rope_scaling_from_hf(scaling, max_len),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            init_std=float(hf.get("initializer_range", 0.02)), dropout=0.0,
            sliding_window=int(window) if window else None, layer_types=types,
            attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            post_norms=True, mlp_activation="gelu_tanh", embed_scale=True)

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        full = {**rope_scaling_to_hf(cfg.rope_scaling), "rope_theta": cfg.rope_theta}
        scaling = None if cfg.rope_scaling is None else rope_scaling_to_hf(cfg.rope_scaling)
        return {
            **self.shared_hf_config(cfg),
            "rope_theta": cfg.rope_theta, "rope_local_base_freq": local, "rope_scaling": scaling,
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": local}},
            "final_logit_softcapping": cfg.final_softcap, "attn_logit_softcapping": None,
        }

    def shared_hf_config(self, cfg: ModelConfig) -> dict:
        """The config.json keys Gemma 2 and Gemma 3 write alike (their RoPE and
        soft-capping keys differ)."""
        types = cfg.layer_types or ["full_attention"] * cfg.num_layers
        scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.dim_per_head ** -0.5
        return {
            "architectures": [self.architectures[0]], "model_type": self.name,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.dim_per_head, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
            "query_pre_attn_scalar": _int_if_whole(scale ** -2),
            "sliding_window": cfg.sliding_window or cfg.max_seq_len, "layer_types": types,
            "attention_bias": False, "attention_dropout": 0.0,
        }

    def check(self, cfg: ModelConfig) -> None:
        self.refuse(cfg, arch="llama", attn_bias=False, qkv_bias=False, qk_norm=True,
                    post_norms=True, mlp_activation="gelu_tanh", embed_scale=True,
                    partial_rotary_factor=1.0)
        if cfg.sliding_window is not None and cfg.layer_types is None:
            raise UserInputError("model.sliding_window on every layer cannot be written in the "
                                 "gemma3_text format; set model.layer_types")
        if cfg.rope_scaling is not None and cfg.rope_scaling.type == "longrope":
            raise UserInputError("model.rope_scaling.type=longrope cannot be written in the "
                                 "gemma3_text format")

    # Gemma's norms multiply by (1 + w): the model holds 1 + w.
    def to_native(self, name: str, tensor: torch.Tensor,
                  cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
        if name.startswith(_VISION):
            return []
        for prefix in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name.removeprefix(prefix)
        if name == "language_model.lm_head.weight":
            name = "lm_head.weight"
        if _is_norm(name):
            tensor = tensor.float() + 1.0
        return super().to_native(name, tensor, cfg)

    def to_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        out = super().to_hf(state, cfg)
        return {k: (t.float() - 1.0).to(t.dtype) if _is_norm(k) else t for k, t in out.items()}


FAMILY = Gemma3Family()
