"""The ``lora:`` section: low-rank adapters on a frozen base model.

Used when the job's objective is ``lora``; the base weights come from
``checkpoint.init_from`` (a Hugging Face directory or a giantmodel run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from giantmodel.config.errors import ConfigError

# Names a target may take: HF LLaMA module names, giantmodel's, or all linears.
HF_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NATIVE_NAMES = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
ALL_LINEAR = ("all_linear", "all-linear")


@dataclass
class LoRAConfig:
    """Adapter shape, initialisation, what is saved, and base quantisation."""

    rank: int = 8
    """Rank r of each adapter (A is r x in, B is out x r)."""
    alpha: float = 16.0
    """Scale numerator: the update is (alpha / rank) * B A."""
    dropout: float = 0.0
    """Dropout on the adapter's input (the base path has none)."""
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Linears that get adapters, in every block: HF names (q_proj, k_proj,
    v_proj, o_proj, gate_proj, up_proj, down_proj), giantmodel names (wq, wk,
    wv, wo, w1, w2, w3), or all_linear (every block linear, not the head)."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """Initialisation of A: Kaiming-uniform (PEFT's default) or Gaussian with
    std 1/rank. B always starts at zero."""
    save_adapter_only: bool = True
    """Checkpoints hold only the adapters (and their optimizer state); the
    base stays in checkpoint.init_from. false: the frozen base is saved too."""
    quantize_base: Literal["none", "nf4"] = "none"
    """QLoRA: store the frozen base linears as 4-bit NormalFloat (torchao's
    NF4 tensor), dequantised per matmul. Needs torchao."""

    def validate(self, arch: str = "llama") -> None:
        if self.rank <= 0:
            raise ConfigError(f"must be a positive integer, got {self.rank}", "lora.rank")
        if self.alpha <= 0:
            raise ConfigError(f"must be positive, got {self.alpha}", "lora.alpha")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"must be in [0, 1), got {self.dropout}", "lora.dropout")
        if not self.targets:
            raise ConfigError("name at least one module (e.g. [q_proj, v_proj] or "
                              "[all_linear])", "lora.targets")
        known = set(HF_NAMES) | set(NATIVE_NAMES) | set(ALL_LINEAR)
        if arch == "gpt":  # the GPT MLP has no gate/up pair
            known -= {"up_proj", "w3"}
        for i, t in enumerate(self.targets):
            if t not in known:
                raise ConfigError(
                    f"target {t!r} matches no module of a {arch} block; use "
                    f"{', '.join(n for n in HF_NAMES if n in known)}, "
                    f"{', '.join(n for n in NATIVE_NAMES if n in known)} or all_linear",
                    f"lora.targets[{i}]")
