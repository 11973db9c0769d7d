"""The ``dpo:`` section: preference tuning (objective ``dpo``).

DPO and its relatives train on pairs (a prompt, a chosen and a rejected
answer; ``data.source: preference``). The names follow TRL's ``DPOConfig``
so a TRL recipe carries over key for key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from giantmodel.config.errors import ConfigError

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


@dataclass
class DPOConfig:
    """Loss, reference model and truncation of a preference-tuning run."""

    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"] = "sigmoid"
    """sigmoid (DPO), ipo, hinge, robust (label-noise robust DPO), simpo (reference-free, length-normalised) or orpo (reference-free odds ratio plus the chosen answer's NLL)."""
    beta: float = 0.1
    """Temperature of the implicit reward: how far the policy may move from the reference (ORPO: the odds-ratio weight)."""
    label_smoothing: float = 0.0
    """Probability that a pair's preference is flipped (conservative DPO for sigmoid; robust and simpo read it too); in [0, 0.5)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (its loss is -log sigmoid(beta * avg-logp margin - gamma))."""
    use_lora: bool = False
    """Train LoRA adapters (the lora section) on a frozen base; the reference is then that base with the adapters switched off, with no second copy. false: full fine-tuning against a frozen copy of the initial weights (sharded like the policy under FSDP)."""
    precompute_ref: bool = False
    """Score every training and validation pair with the reference model in one pass at setup, before the first step (each data-parallel rank its share, then every rank holds the whole table; under pp the pass walks the pipeline), keep the log-probs in run.dir/ref_logps.pt (a resumed run reuses them) and train with no reference forward."""
    max_length: int | None = None
    """Longest prompt + answer in tokens (TRL's max_length); longer sequences are cut by truncation_mode. null: train.seq_len + 1, the most one row holds."""
    max_prompt_length: int | None = None
    """Longest prompt in tokens; longer prompts keep their last tokens (TRL 0.x's rule, applied before max_length). null: no limit (TRL 1.x)."""
    max_completion_length: int | None = None
    """Longest answer in tokens (its first tokens are kept). null: no limit."""
    truncation_mode: Literal["keep_end", "keep_start"] = "keep_start"
    """When prompt + answer exceed max_length: keep_start (TRL's default) drops the sequence's last tokens (the answer's end), keep_end its first (the prompt's start)."""

    def validate(self, seq_len: int) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"unknown loss {self.loss_type!r}; use one of "
                              f"{', '.join(LOSS_TYPES)}", "dpo.loss_type")
        if not self.beta > 0:
            raise ConfigError(f"must be > 0, got {self.beta}", "dpo.beta")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"must be in [0, 0.5), got {self.label_smoothing}",
                              "dpo.label_smoothing")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust", "simpo"):
            raise ConfigError(f"loss {self.loss_type} has no label smoothing; set "
                              "dpo.label_smoothing=0 or use sigmoid, robust or simpo",
                              "dpo.label_smoothing")
        if self.precompute_ref and self.loss_type in REFERENCE_FREE:
            raise ConfigError(f"loss {self.loss_type} uses no reference model; set "
                              "dpo.precompute_ref=false", "dpo.precompute_ref")
        for key in ("max_length", "max_prompt_length", "max_completion_length"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"must be a positive token count or null, got {value}",
                                  f"dpo.{key}")
        if self.max_length is not None and self.max_length > seq_len + 1:
            raise ConfigError(f"{self.max_length} exceeds train.seq_len + 1 = {seq_len + 1}, "
                              "the most one row holds; lower it or raise train.seq_len",
                              "dpo.max_length")

    def resolved_max_length(self, seq_len: int) -> int:
        return self.max_length if self.max_length is not None else seq_len + 1
