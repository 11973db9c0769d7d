"""Model zoo: GPT and LLaMA as plain nn.Modules, plus Hugging Face interop."""

from giantmodel.models.registry import build_model, canonical_name, count_params, init_weights

__all__ = ["build_model", "canonical_name", "count_params", "init_weights"]
