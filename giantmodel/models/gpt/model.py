"""GPT-2/3: pre-norm LayerNorm, learned positions, GELU MLP, biases everywhere."""

from __future__ import annotations

import torch
from torch import nn

from giantmodel.config.model import ModelConfig
from giantmodel.models.common.fused import LayerNorm
from giantmodel.models.common.layers import Attention, GeluMLP
from giantmodel.models.common.transformer import Transformer


class GPTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.attention_norm = LayerNorm(h, eps=cfg.norm_eps)
        self.attention = Attention(h, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head,
                                   bias=True, dropout=cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.ffn_norm = LayerNorm(h, eps=cfg.norm_eps)
        self.feed_forward = GeluMLP(h, cfg.ffn_hidden_size, cfg.dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None,
                mask=None, cache=None) -> torch.Tensor:
        x = x + self.resid_dropout(self.attention(self.attention_norm(x), mask=mask,
                                                  cache=cache))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(Transformer):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, GPTBlock, LayerNorm, learned_positions=True)
