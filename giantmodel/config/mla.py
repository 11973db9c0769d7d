"""The ``model.mla`` section: multi-head latent attention (DeepSeek-V2/V3).

Set, it replaces each block's attention by MLA: queries through an optional
low-rank projection (``q_lora_rank``), keys and values from one shared
low-rank latent (``kv_lora_rank``) plus a single RoPE key shared by every
head; each head's query/key is ``qk_nope_head_dim`` unrotated dimensions
followed by ``qk_rope_head_dim`` rotated ones, its value ``v_head_dim`` wide.
Field names follow Hugging Face's ``DeepseekV3Config``.
"""

from __future__ import annotations

from dataclasses import dataclass

from giantmodel.config.errors import ConfigError


@dataclass
class MLAConfig:
    """Low-rank query and key/value projections and the split head dims."""

    q_lora_rank: int | None = 1536
    """Rank of the query's low-rank projection (wq_a, an RMSNorm, wq_b); null: one full wq (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """Width of the shared key/value latent that wkv_b expands into every head's key and value."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dimensions without RoPE (taken from the latent)."""
    qk_rope_head_dim: int = 64
    """Per-head query/key dimensions RoPE rotates (the key's are one set shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value width."""
    rope_interleave: bool = True
    """The rotated dimensions pair up interleaved, (0, 1), (2, 3), ..., as DeepSeek's weights are
    laid out (HF's rope_interleave); false: half-split pairs (i, i + d/2) as in LLaMA."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self) -> None:
        p = "model.mla"
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"must be positive or null, got {self.q_lora_rank}",
                              f"{p}.q_lora_rank")
        for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"must be positive, got {getattr(self, key)}", f"{p}.{key}")
        if self.qk_nope_head_dim < 0:
            raise ConfigError(f"must be non-negative, got {self.qk_nope_head_dim}",
                              f"{p}.qk_nope_head_dim")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"RoPE needs an even width, got {self.qk_rope_head_dim}",
                              f"{p}.qk_rope_head_dim")
