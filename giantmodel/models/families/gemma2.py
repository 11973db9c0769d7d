"""Gemma 2 (``Gemma2ForCausalLM``, model_type ``gemma2``).

Gemma 3's block less qk-norm, plus soft-capping: the attention scores
(``attn_logit_softcapping``, ModelConfig.attn_softcap) and the output logits
(``final_logit_softcapping``, ModelConfig.final_softcap) pass through
tanh(x / cap) * cap. Local (sliding-window) and global layers alternate,
the first local (``layer_types``); one RoPE base serves both kinds. The
softmax scale, the (1 + w) norms, the four norms per block, GeGLU and the
embedding scale are Gemma 3's (see :mod:`.gemma3`).
"""

from __future__ import annotations

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig
from giantmodel.models.families.base import NameMap
from giantmodel.models.families.gemma3 import GEMMA3_NAMES, Gemma3Family, softcap_from_hf

GEMMA2_NAMES = NameMap(base=GEMMA3_NAMES.base, layers=GEMMA3_NAMES.layers, top=GEMMA3_NAMES.top,
                       layer={k: v for k, v in GEMMA3_NAMES.layer.items()
                              if not k.endswith(("q_norm", "k_norm"))})


class Gemma2Family(Gemma3Family):
    name = "gemma2"
    model_types = ("gemma2",)
    architectures = ("Gemma2ForCausalLM",)
    softcaps = frozenset({"attn_softcap", "final_softcap"})
    names = GEMMA2_NAMES
    default_window_pattern = 2
    """Gemma 2: local and global layers alternate, the first local."""

    def config_from_hf(self, hf: dict) -> dict:
        self.check_activation(hf)
        if hf.get("attention_bias") or hf.get("use_bidirectional_attention"):
            raise UserInputError("gemma2 with attention biases or bidirectional attention "
                                 "is not supported")
        params = hf.get("rope_parameters") or {}
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
        scaling = hf.get("rope_scaling") or (params if params else None)
        return {**self.shared_config_from_hf(hf, 8192, theta, scaling),
                "attn_softcap": softcap_from_hf(hf.get("attn_logit_softcapping")),
                "final_softcap": softcap_from_hf(hf.get("final_logit_softcapping"))}

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        return {
            **self.shared_hf_config(cfg),
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attn_logit_softcapping": cfg.attn_softcap,
            "final_logit_softcapping": cfg.final_softcap,
        }

    def check(self, cfg: ModelConfig) -> None:
        self.refuse(cfg, arch="llama", attn_bias=False, qkv_bias=False, qk_norm=False,
                    post_norms=True, mlp_activation="gelu_tanh", embed_scale=True,
                    partial_rotary_factor=1.0, rope_local_theta=None, rope_scaling=None)
        if cfg.sliding_window is not None and cfg.layer_types is None:
            raise UserInputError("model.sliding_window on every layer cannot be written in the "
                                 "gemma2 format; set model.layer_types")


FAMILY = Gemma2Family()
