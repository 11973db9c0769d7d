"""Qwen3, dense (``Qwen3ForCausalLM``): LLaMA with RMSNorm over each head's
query and key (qk-norm, before RoPE) and a ``head_dim`` of its own (128 on
every size, whatever hidden_size / num_heads is); no biases."""

from __future__ import annotations

from giantmodel.config.model import ModelConfig
from giantmodel.models.families.base import NameMap
from giantmodel.models.families.llama import LAYER, TOP, LlamaFamily
from giantmodel.models.families.qwen2 import refuse_layer_windows

QWEN3_NAMES = NameMap(base="model.", layers="layers", top=TOP,
                      layer={**LAYER, "self_attn.q_norm": "attention.q_norm",
                             "self_attn.k_norm": "attention.k_norm"})


class Qwen3Family(LlamaFamily):
    name = "qwen3"
    model_types = ("qwen3",)
    architectures = ("Qwen3ForCausalLM",)
    names = QWEN3_NAMES

    def config_from_hf(self, hf: dict) -> dict:
        refuse_layer_windows(self.name, hf)
        # Qwen3Config's own default head_dim is 128, not hidden / heads.
        hf = {"head_dim": 128, **hf}
        fields = super().config_from_hf(hf)
        fields.update(qk_norm=True)
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        out = super().config_to_hf(cfg)
        out.pop("mlp_bias")
        out.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg.num_layers)
        return out

    def check(self, cfg: ModelConfig) -> None:
        self.refuse(cfg, arch="llama", qkv_bias=False, qk_norm=True,
                    sliding_window=None)


FAMILY = Qwen3Family()
