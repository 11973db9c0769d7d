"""Model shape section of the job config (``model.*``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from giantmodel.config.errors import ConfigError
from giantmodel.config.mla import MLAConfig
from giantmodel.config.modes import refuse_unused
from giantmodel.config.moe import MoEConfig


@dataclass
class RopeScaling:
    """RoPE frequency scaling: Llama 3.1's (the default), linear position
    interpolation (Gemma 3's global layers), LongRoPE (Phi-3) or YaRN (DeepSeek-V3)."""

    type: Literal["llama3", "linear", "longrope", "yarn"] = "llama3"
    """'llama3': low frequencies divided by factor, a smooth band between; 'linear': every frequency divided by factor; 'longrope': per-frequency divisors (short_factor, or long_factor when a sequence runs past original_max_seq_len) and cos/sin scaled by attention_factor."""
    factor: float = 8.0
    """Divisor applied to low frequencies (long wavelengths); 'linear': to all of them; 'longrope': max_seq_len / original_max_seq_len, which sets the default attention_factor."""
    low_freq_factor: float = 1.0
    """Wavelengths longer than original_max_seq_len / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths shorter than original_max_seq_len / high_freq_factor are left unscaled."""
    original_max_seq_len: int = 8192
    """Context length the unscaled model was trained at."""
    short_factor: list[float] | None = None
    """'longrope': divisor of each inverse frequency (head_dim * partial_rotary_factor / 2 of them) for sequences up to original_max_seq_len."""
    long_factor: list[float] | None = None
    """'longrope': the divisors for sequences longer than original_max_seq_len."""
    attention_factor: float | None = None
    """'longrope': scale of cos and sin; null: sqrt(1 + ln(factor) / ln(original_max_seq_len)) (1 when factor <= 1). 'yarn': the same scale; null: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else mscale(factor, 1), where mscale(s, m) = 0.1 m ln(s) + 1."""
    beta_fast: float = 32.0
    """'yarn': rotations over the original context above which a frequency is kept (extrapolated)."""
    beta_slow: float = 1.0
    """'yarn': rotations below which a frequency is divided by factor (interpolated); a linear ramp between."""
    mscale: float | None = None
    """'yarn': the numerator's multiplier of the default attention_factor (DeepSeek-V3: 1.0)."""
    mscale_all_dim: float | None = None
    """'yarn': when set, the attention softmax scale is multiplied by mscale(factor, mscale_all_dim)**2 and the default attention_factor divided by mscale(factor, mscale_all_dim) (DeepSeek-V3: 1.0)."""

    def longrope_attention_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_seq_len))

    def yarn_attention_factor(self) -> float:
        """'yarn': the scale of cos and sin (transformers' ``_compute_yarn_parameters``)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor,
                                                                       self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_mscale(self) -> float:
        """Multiplier of the attention softmax scale: mscale(factor, mscale_all_dim)**2 under
        'yarn' with mscale_all_dim set (DeepSeek's ``yarn_apply_mscale``), else 1."""
        if self.type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class ModelConfig:
    """Architecture and shape of the transformer."""

    arch: Literal["llama", "gpt"] = "llama"
    """Model family: 'llama' (RMSNorm, RoPE, SwiGLU, GQA) or 'gpt' (GPT-2/3: LayerNorm, learned positions, GELU, biases)."""
    name: str = "llama-tiny"
    """Free-form name; used in run metadata and as the comm autotuner's cache key."""
    hidden_size: int = 256
    """Width of the residual stream (d_model)."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 8
    """Attention (query) heads; hidden_size must be divisible by it."""
    num_kv_heads: int | None = 4
    """Key/value heads for grouped-query attention; null means num_heads (multi-head)."""
    head_dim: int | None = None
    """Per-head width; null means hidden_size // num_heads."""
    ffn_hidden_size: int = 768
    """Inner width of the MLP (SwiGLU gate/up width for llama, 4*hidden for classic GPT)."""
    vocab_size: int = 4096
    """Rows of the embedding table; must be at least the tokenizer's vocabulary size."""
    max_seq_len: int = 512
    """Longest sequence the model supports (RoPE table / learned position table size)."""
    rope_theta: float = 10000.0
    """RoPE base frequency (llama only)."""
    rope_scaling: RopeScaling | None = None
    """Llama-3 frequency scaling; null disables it."""
    tie_embeddings: bool = False
    """Share the token embedding matrix with the output head."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm / LayerNorm."""
    init_std: float = 0.02
    """Standard deviation of the normal init; output projections are scaled by 1/sqrt(2*num_layers)."""
    dropout: float = 0.0
    """Dropout on attention probabilities and residual branches (GPT); 0 disables it."""
    attn_bias: bool = False
    """Bias on the q/k/v/o projections (GPT uses biases regardless)."""
    moe: MoEConfig | None = None
    """Mixture-of-Experts feed-forward layers (router, experts, shared experts, balancing); null: every block dense."""
    mla: MLAConfig | None = None
    """Multi-head latent attention (DeepSeek-V3: low-rank query and key/value projections, split RoPE/no-RoPE head dims) in every block; null: standard multi-head / grouped-query attention."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections only, none on o (Qwen2); attn_bias=true implies it."""
    qk_norm: bool = False
    """RMSNorm over each head's query and key (weights [head_dim], shared by the heads) before RoPE (Qwen3)."""
    sliding_window: int | None = None
    """Each token attends to the last sliding_window tokens, itself included (Mistral v0.1); null: full causal attention."""
    layer_types: list[str] | None = None
    """Per layer, 'sliding_attention' (the sliding_window, and the local RoPE base) or 'full_attention' (Gemma's local/global pattern); null: every layer windowed when sliding_window is set."""
    rope_local_theta: float | None = None
    """RoPE base of the sliding_attention layers, without rope_scaling (Gemma 3: 10 000 against a global 1 000 000); null: every layer uses rope_theta and rope_scaling."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates (the first ones; Phi-4-mini: 0.75); the rest pass unrotated."""
    attn_scale: float | None = None
    """Softmax scale of the attention scores (Gemma: query_pre_attn_scalar ** -0.5); null: head_dim ** -0.5."""
    post_norms: bool = False
    """RMSNorm on the attention and feed-forward outputs before each residual add, besides the pre-norms (Gemma 2/3: four norms per block)."""
    mlp_activation: Literal["silu", "gelu_tanh"] = "silu"
    """Gate activation of the gated MLP: 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU with tanh-approximated GELU, Gemma)."""
    embed_scale: bool = False
    """Multiply token embeddings by sqrt(hidden_size), rounded to the embedding's dtype (Gemma)."""
    attn_softcap: float | None = None
    """Soft-cap of the attention scores before the softmax, s -> tanh(s / cap) * cap (Gemma 2's attn_logit_softcapping; a math or flex kernel, never SDPA); null: none."""
    final_softcap: float | None = None
    """Soft-cap of the output logits, tanh(logits / cap) * cap (Gemma 2's final_logit_softcapping; the loss then runs plain, not chunked); null: none."""
    family: str | None = None
    """Hugging Face model family the weights convert to and from (config.json's model_type: llama, gpt2, qwen2, qwen3, mistral, gemma2, gemma3_text, phi3, mixtral, qwen3_moe, deepseek_v3); null: the arch's own (llama or gpt2). Set by conversion from Hugging Face."""

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def has_qkv_bias(self) -> bool:
        return self.attn_bias or self.qkv_bias

    def validate(self) -> None:
        for key in ("hidden_size", "num_layers", "num_heads", "ffn_hidden_size",
                    "vocab_size", "max_seq_len"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"must be positive, got {getattr(self, key)}", f"model.{key}")
        if self.num_kv_heads is not None and self.num_kv_heads <= 0:
            raise ConfigError("must be positive or null", "model.num_kv_heads")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads "
                f"{self.num_heads}; change one of them or set model.head_dim", "model.num_heads")
        if self.num_heads % self.kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not divisible by num_kv_heads "
                f"{self.kv_heads}; each kv head must serve a whole group of query heads",
                "model.num_kv_heads")
        if self.dim_per_head % 2 and self.arch == "llama":
            raise ConfigError(f"RoPE needs an even head dim, got {self.dim_per_head}", "model.head_dim")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"must be in [0, 1), got {self.dropout}", "model.dropout")
        if self.moe is not None:
            if self.arch != "llama":
                raise ConfigError(f"MoE layers need arch llama, not {self.arch}", "model.moe")
            self.moe.validate(self.num_layers)
        if self.mla is not None:
            self._validate_mla()
        if self.sliding_window is not None and not 0 < self.sliding_window <= self.max_seq_len:
            raise ConfigError(
                f"sliding_window {self.sliding_window} must be between 1 and model.max_seq_len "
                f"{self.max_seq_len}; use null for full causal attention", "model.sliding_window")
        self._validate_layer_pattern()
        for key in ("attn_softcap", "final_softcap"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ConfigError(f"must be positive or null, got {getattr(self, key)}",
                                  f"model.{key}")
        # GPT has learned positions: RoPE settings would be ignored; its
        # block has biases everywhere and no window or qk-norm.
        llama_only = ("rope_theta", "rope_scaling", "qkv_bias", "qk_norm", "sliding_window",
                      "layer_types", "rope_local_theta", "partial_rotary_factor", "attn_scale",
                      "post_norms", "mlp_activation", "embed_scale", "mla", "attn_softcap",
                      "final_softcap")
        refuse_unused(self, "model", "arch", {k: ("llama",) for k in llama_only})

    def _validate_layer_pattern(self) -> None:
        if self.layer_types is not None:
            kinds = {"sliding_attention", "full_attention"}
            bad = sorted(set(self.layer_types) - kinds)
            if bad or len(self.layer_types) != self.num_layers:
                raise ConfigError(
                    f"needs num_layers ({self.num_layers}) entries, each 'sliding_attention' or "
                    f"'full_attention'; got {len(self.layer_types)} entries"
                    + (f" including {bad}" if bad else ""), "model.layer_types")
            if self.sliding_window is None and "sliding_attention" in self.layer_types:
                raise ConfigError("sliding_attention layers need model.sliding_window",
                                  "model.layer_types")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ConfigError(f"must be in (0, 1] and rotate an even number of dimensions; got "
                              f"{self.partial_rotary_factor} (head_dim {self.dim_per_head})",
                              "model.partial_rotary_factor")
        s = self.rope_scaling
        if s is not None and s.type == "longrope":
            for key in ("short_factor", "long_factor"):
                got = getattr(s, key)
                if got is None or len(got) != self.rotary_dim // 2:
                    raise ConfigError(f"'longrope' needs {self.rotary_dim // 2} values (one per "
                                      f"rotated frequency), got {None if got is None else len(got)}",
                                      f"model.rope_scaling.{key}")
        if self.moe is not None and self.mlp_activation != "silu":
            raise ConfigError("MoE experts are SwiGLU; use mlp_activation silu",
                              "model.mlp_activation")

    def _validate_mla(self) -> None:
        self.mla.validate()
        # MLA has no separate k/v heads or per-head qk-norm, and its kernels
        # run full causal attention.
        for key, plain in (("num_kv_heads", (None, self.num_heads)), ("attn_bias", (False,)),
                           ("qkv_bias", (False,)), ("qk_norm", (False,)),
                           ("sliding_window", (None,)), ("partial_rotary_factor", (1.0,))):
            if getattr(self, key) not in plain:
                use = "null" if plain[0] is None else repr(plain[0])
                raise ConfigError(f"is not supported with multi-head latent attention "
                                  f"(model.mla); use {use}", f"model.{key}")
        if self.dim_per_head != self.mla.qk_head_dim:
            raise ConfigError(f"must be qk_nope_head_dim + qk_rope_head_dim "
                              f"({self.mla.qk_head_dim}) with model.mla, got {self.dim_per_head}",
                              "model.head_dim")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (its global index), or None (full causal)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` takes the local RoPE base (rope_local_theta)."""
        return (self.rope_local_theta is not None and self.layer_types is not None
                and self.layer_types[layer] == "sliding_attention")

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.dim_per_head * self.partial_rotary_factor)

    def mla_params(self) -> int:
        """Parameters of one multi-head latent attention (projections and latent norms)."""
        m, h, heads = self.mla, self.hidden_size, self.num_heads
        q_out = heads * m.qk_head_dim
        q = h * q_out if m.q_lora_rank is None else m.q_lora_rank * (h + 1 + q_out)
        kv = (h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
              + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim))
        return q + kv + heads * m.v_head_dim * h

    def moe_ffn_params(self, active: bool = False) -> int:
        """Parameters of one MoE feed-forward (router, experts, shared experts);
        ``active``: only the top_k routed experts a token uses."""
        m, h = self.moe, self.hidden_size
        expert = 3 * h * m.expert_width(self.ffn_hidden_size)
        shared = 3 * h * m.shared_width(self.ffn_hidden_size)
        return (h * m.num_experts + (m.top_k if active else m.num_experts) * expert + shared
                + (h if m.shared_expert_gate else 0))

    def num_params(self, include_embeddings: bool = True) -> int:
        """Exact parameter count of the model this config builds."""
        h, f, v, L = self.hidden_size, self.ffn_hidden_size, self.vocab_size, self.num_layers
        q = self.num_heads * self.dim_per_head
        kv = self.kv_heads * self.dim_per_head
        if self.arch == "llama":
            bias = (q + 2 * kv if self.has_qkv_bias else 0) + (h if self.attn_bias else 0)
            qk_norm = 2 * self.dim_per_head if self.qk_norm else 0
            per_layer = (h * (q + 2 * kv) + q * h + bias + qk_norm + 3 * h * f
                         + (4 if self.post_norms else 2) * h)
            final_norm = h
            pos = 0
        else:
            per_layer = (h * (q + 2 * kv) + (q + 2 * kv) + q * h + h
                         + 2 * h * f + f + h + 4 * h)
            final_norm = 2 * h
            pos = self.max_seq_len * h
        total = L * per_layer + final_norm
        if self.mla is not None:  # MLA blocks swap q/k/v/o (no biases, no qk-norm) for its own
            total += L * (self.mla_params() - h * (q + 2 * kv) - q * h)
        if self.moe is not None:  # MoE blocks swap the dense SwiGLU for router + experts
            total += len(self.moe.sparse_layers(L)) * (self.moe_ffn_params() - 3 * h * f)
        if include_embeddings:
            total += v * h + pos + (0 if self.tie_embeddings else v * h)
        return total

