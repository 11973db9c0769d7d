"""Small tensor helpers with one home: DTensor unwrapping and de-duplication."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a (possibly DTensor) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` in order, each object once (tied weights appear once)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def unique_params(parts: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Every parameter of ``parts`` once, in registration order."""
    return unique(p for part in parts for p in part.parameters())
