"""Token-level cross-entropy, summed so callers normalise by global token count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token losses and the number of counted tokens.

    Summing (rather than averaging per micro-batch) lets the caller divide by
    the token count of the whole global batch, so the loss is the same token
    mean however the batch is split across micro-batches and ranks.
    """
    loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (labels != IGNORE_INDEX).sum()
