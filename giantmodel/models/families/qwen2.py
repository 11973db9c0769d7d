"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): LLaMA with biases on q, k and v
(none on o); the small sizes tie the embedding to the head."""

from __future__ import annotations

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig
from giantmodel.models.families.llama import LlamaFamily


def refuse_layer_windows(family: str, hf: dict) -> None:
    """Qwen's ``use_sliding_window`` windows only the layers from
    ``max_window_layers`` on; no released dense checkpoint sets it."""
    if hf.get("use_sliding_window"):
        raise UserInputError(f"{family} with use_sliding_window=true (a window on some layers "
                             "only) is not supported; giantmodel windows every layer or none")


class Qwen2Family(LlamaFamily):
    name = "qwen2"
    model_types = ("qwen2",)
    architectures = ("Qwen2ForCausalLM",)

    def config_from_hf(self, hf: dict) -> dict:
        refuse_layer_windows(self.name, hf)
        fields = super().config_from_hf(hf)
        fields.update(attn_bias=False, qkv_bias=True)
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        out = super().config_to_hf(cfg)
        for key in ("attention_bias", "mlp_bias", "head_dim"):
            out.pop(key)
        out.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg.num_layers)
        return out

    def check(self, cfg: ModelConfig) -> None:
        self.refuse(cfg, arch="llama", attn_bias=False, qkv_bias=True, qk_norm=False,
                    sliding_window=None)
        if cfg.dim_per_head * cfg.num_heads != cfg.hidden_size:
            raise UserInputError(f"model.head_dim={cfg.head_dim} cannot be written in the qwen2 "
                                 "format (head_dim is hidden_size / num_heads there)")


FAMILY = Qwen2Family()
