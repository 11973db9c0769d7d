"""Helpers shared by the Hugging Face parity tests of every model family."""

from __future__ import annotations

import torch


def perturb(model: torch.nn.Module, scale: float = 0.05, seed: int = 1) -> torch.nn.Module:
    """Add seeded noise to every tensor: HF inits norms to ones and biases to
    zeros, which would let a swapped or untransposed weight hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """A model's logits without autograd, from a HF output or a plain tensor."""
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)
