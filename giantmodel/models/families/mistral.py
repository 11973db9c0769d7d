"""Mistral (``MistralForCausalLM``): LLaMA with a sliding attention window on
every layer where ``sliding_window`` is set (v0.1: 4096); later versions set
it to null (full causal attention). No biases."""

from __future__ import annotations

from giantmodel.config.model import ModelConfig
from giantmodel.models.families.llama import LlamaFamily


class MistralFamily(LlamaFamily):
    name = "mistral"
    model_types = ("mistral",)
    architectures = ("MistralForCausalLM",)

    def config_from_hf(self, hf: dict) -> dict:
        fields = super().config_from_hf(hf)
        window = hf.get("sliding_window")
        fields.update(attn_bias=False, sliding_window=int(window) if window else None)
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        out = super().config_to_hf(cfg)
        for key in ("attention_bias", "mlp_bias"):
            out.pop(key)
        out["sliding_window"] = cfg.sliding_window
        return out

    def check(self, cfg: ModelConfig) -> None:
        self.refuse(cfg, arch="llama", attn_bias=False, qkv_bias=False, qk_norm=False)


FAMILY = MistralFamily()
