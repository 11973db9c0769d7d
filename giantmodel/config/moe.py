"""The ``model.moe`` section: Mixture-of-Experts feed-forward layers.

Set, it turns the feed-forward of some or all blocks into a routed MoE layer
(router, experts, optional shared experts); null keeps every block dense.
The fields follow the Hugging Face names of Mixtral, Qwen3-MoE and
DeepSeek-V3 where those exist (``norm_topk_prob``, ``n_group``,
``topk_group``, ``routed_scaling_factor``, ``first_k_dense_replace`` as
``first_k_dense``, ``mlp_only_layers`` as ``dense_layers``,
``decoder_sparse_step`` as ``sparse_step``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from giantmodel.config.errors import ConfigError


@dataclass
class MoEConfig:
    """Router, experts, dense/sparse layer pattern and load balancing."""

    num_experts: int = 8
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Experts each token is routed to."""
    router: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts (Mixtral, Qwen-MoE) or per-expert sigmoid (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' weights to sum to 1 (Mixtral always does; Qwen3-MoE's norm_topk_prob)."""
    n_group: int = 1
    """Expert groups for group-limited routing (DeepSeek-V3); 1 disables it."""
    topk_group: int = 1
    """Groups a token may route into, chosen by the sum of each group's two best scores."""
    routed_scaling_factor: float = 1.0
    """Multiplier on the routed experts' weights (DeepSeek-V3's routed_scaling_factor)."""
    expert_ffn_hidden_size: int | None = None
    """Inner width of each routed expert's SwiGLU; null means model.ffn_hidden_size."""
    num_shared_experts: int = 0
    """Shared experts every token goes through, added to the routed output (DeepSeek-V3, Qwen2-MoE)."""
    shared_expert_ffn_hidden_size: int | None = None
    """Inner width per shared expert (the shared SwiGLU is num_shared_experts times it wide); null means expert_ffn_hidden_size."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(a learned linear of the token), as Qwen2-MoE does."""
    first_k_dense: int = 0
    """The first this-many layers keep a dense feed-forward (DeepSeek-V3's first_k_dense_replace)."""
    dense_layers: list[int] = field(default_factory=list)
    """Further layer indices that keep a dense feed-forward (Qwen3-MoE's mlp_only_layers)."""
    sparse_step: int = 1
    """Layer i is MoE only when (i + 1) is a multiple of this (Qwen3-MoE's decoder_sparse_step)."""
    capacity_factor: float | None = None
    """null: dropless, no token is ever dropped. A number: each expert takes at most
    ceil(capacity_factor * tokens * top_k / num_experts) tokens per forward, keeping the
    highest-weighted; the rest are dropped (counted in metrics as moe_dropped_tokens)."""
    aux_loss_coeff: float = 0.0
    """Weight of the Switch/GShard load-balancing loss (num_experts * sum_i f_i * P_i, 1 when balanced); 0 disables it."""
    seq_aux_loss_coeff: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss (the same form within each sequence); 0 disables it."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss (mean squared log-sum-exp of the router logits); 0 disables it."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing: after each optimizer step every expert's routing bias
    moves by this much towards balance (up if under-loaded, down if over-loaded); 0 disables it."""
    experts_impl: Literal["auto", "grouped_mm", "loop"] = "auto"
    """Expert matmuls: one grouped GEMM (torch._grouped_mm), one matmul per expert (loop),
    or auto: grouped on bf16 Hopper-class GPUs, loop elsewhere."""

    @property
    def uses_bias(self) -> bool:
        """Whether the router holds a correction bias (sigmoid routers always
        do, as DeepSeek-V3 checkpoints carry one; others when it is updated)."""
        return self.router == "sigmoid" or self.bias_update_rate > 0

    @property
    def aux_coeffs(self) -> dict[str, float]:
        """The auxiliary losses that are on, by metric name."""
        named = {"aux_loss": self.aux_loss_coeff, "seq_aux_loss": self.seq_aux_loss_coeff,
                 "z_loss": self.z_loss_coeff}
        return {k: v for k, v in named.items() if v > 0}

    def expert_width(self, ffn_hidden_size: int) -> int:
        """Inner width of one routed expert: expert_ffn_hidden_size, else
        the model's ``ffn_hidden_size``."""
        return self.expert_ffn_hidden_size or ffn_hidden_size

    def shared_width(self, ffn_hidden_size: int) -> int:
        """Inner width of the shared experts' one SwiGLU: num_shared_experts
        times shared_expert_ffn_hidden_size (else the routed experts'); 0
        without shared experts."""
        return self.num_shared_experts * (self.shared_expert_ffn_hidden_size
                                          or self.expert_width(ffn_hidden_size))

    def is_sparse(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) has an MoE feed-forward."""
        if layer < self.first_k_dense or layer in self.dense_layers:
            return False
        return (layer + 1) % self.sparse_step == 0

    def validate(self, num_layers: int) -> None:
        p = "model.moe"
        for key in ("num_experts", "top_k", "n_group", "topk_group", "sparse_step"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"must be positive, got {getattr(self, key)}", f"{p}.{key}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"top_k {self.top_k} is above num_experts {self.num_experts}",
                              f"{p}.top_k")
        if self.num_experts % self.n_group:
            raise ConfigError(f"n_group {self.n_group} does not divide num_experts "
                              f"{self.num_experts}", f"{p}.n_group")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group {self.topk_group} is above n_group {self.n_group}",
                              f"{p}.topk_group")
        reachable = self.topk_group * (self.num_experts // self.n_group)
        if self.top_k > reachable:
            raise ConfigError(f"top_k {self.top_k} is above the {reachable} experts that "
                              f"topk_group {self.topk_group} groups hold", f"{p}.top_k")
        for key in ("expert_ffn_hidden_size", "shared_expert_ffn_hidden_size", "capacity_factor"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"must be positive or null, got {value}", f"{p}.{key}")
        for key in ("num_shared_experts", "first_k_dense", "aux_loss_coeff",
                    "seq_aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            if getattr(self, key) < 0:
                raise ConfigError(f"must be non-negative, got {getattr(self, key)}", f"{p}.{key}")
        if self.routed_scaling_factor <= 0:
            raise ConfigError(f"must be positive, got {self.routed_scaling_factor}",
                              f"{p}.routed_scaling_factor")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ConfigError("gates shared experts, but num_shared_experts is 0",
                              f"{p}.shared_expert_gate")
        for i, layer in enumerate(self.dense_layers):
            if not 0 <= layer < num_layers:
                raise ConfigError(f"layer {layer} is not in 0..{num_layers - 1}",
                                  f"{p}.dense_layers[{i}]")
        if not any(self.is_sparse(i) for i in range(num_layers)):
            raise ConfigError("leaves no MoE layer (first_k_dense, dense_layers and sparse_step "
                              f"make all {num_layers} layers dense); set model.moe=null for a "
                              "dense model", p)

    def sparse_layers(self, num_layers: int) -> list[int]:
        return [i for i in range(num_layers) if self.is_sparse(i)]
