"""Activation recomputation: ``none``, ``selective`` or ``full``.

* ``full`` checkpoints whole transformer blocks: only block inputs are kept
  and each block's forward runs again in backward.
* ``selective`` checkpoints each block under an op-level policy: matmul
  outputs and collective results are saved, everything else (the attention
  core's softmax, the MLP activation, norms, rotary) is recomputed. This is
  the split of Korthikanti et al. (2022): the cheap-to-recompute, large
  activations go, the expensive ones stay, and no collective runs twice.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten.embedding.default,
}


def _is_collective(op) -> bool:
    ns = getattr(op, "namespace", "")
    return ns in ("_c10d_functional", "c10d_functional", "c10d", "_dtensor")


def _policy(ctx, op, *args, **kwargs):
    if op in _SAVE_OPS or _is_collective(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def apply_recompute(model: nn.Module, block_names: list[str], mode: str) -> None:
    """Wrap each block (dotted names in ``model``) for ``mode`` (none|selective|full)."""
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"recompute must be none, selective or full; got {mode!r}")
    kwargs: dict = {}
    if mode == "selective":
        kwargs["context_fn"] = _selective_context
    for name in block_names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, checkpoint_wrapper(owner.get_submodule(leaf), **kwargs))

