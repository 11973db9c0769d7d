"""LLaMA (1, 2 and 3): pre-norm RMSNorm, RoPE, SwiGLU, grouped-query attention."""

from __future__ import annotations

import torch
from torch import nn

from giantmodel.config.model import ModelConfig
from giantmodel.models.common.layers import Attention, RMSNorm, SwiGLU
from giantmodel.models.common.transformer import Transformer


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.attention_norm = RMSNorm(h, cfg.norm_eps)
        self.attention = Attention.from_config(cfg)
        self.ffn_norm = RMSNorm(h, cfg.norm_eps)
        self.feed_forward = SwiGLU(h, cfg.ffn_hidden_size)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask=None,
                cache=None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, mask=mask, cache=cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(Transformer):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, LlamaBlock, RMSNorm, learned_positions=False)
