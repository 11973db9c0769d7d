"""One entry point that applies a layout to any model chunk.

``parallelize_chunk`` takes the whole model or a pipeline stage (where some
of ``tok_embeddings``/``norm``/``output`` are None and ``layers`` holds a
subset), still on the meta device, and applies, in order:

1. the tensor/sequence-parallel plan (``parallel.tp``, ``parallel.sp``);
2. context-parallel attention (``parallel.cp``);
3. activation recomputation (``recompute``) and activation offload
   (``offload.activations``; a no-op for tensors already in host memory);
4. ``torch.compile`` of each transformer block (``train.compile``);
5. FSDP2 for ``parallel.zero`` 2 and 3 (zero 0/1 are handled after the
   backward by :class:`giantmodel.parallel.data.DataParallel`).

Then call ``init_weights`` on the result: every layout starts from the
single-process weights.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from giantmodel.core.loss import IGNORE_INDEX, cross_entropy_sum


def parallelize_chunk(module: nn.Module, dims, cfg) -> nn.Module:
    from giantmodel.parallel.context import apply_context_parallel
    from giantmodel.parallel.data import apply_fsdp
    from giantmodel.parallel.recompute import apply_recompute
    from giantmodel.parallel.tensor import apply_tensor_parallel

    if dims.tp > 1:
        apply_tensor_parallel(module, dims["tp"], cfg.parallel.sp)
    if dims.cp > 1:
        apply_context_parallel(module, dims["cp"])
    apply_recompute(module, cfg.recompute, cfg.recompute_layers)
    if cfg.offload.activations:
        from giantmodel.parallel.offload import apply_offload

        apply_offload(module, cfg.offload.prefetch_layers)
    if cfg.train.compile:
        # Per block, in place: identical blocks share one compiled graph, and
        # Module.compile() keeps parameter names (and so checkpoints) unchanged.
        for block in module.layers.values():
            block.compile()
    if cfg.parallel.zero >= 2 and dims.dp * dims.cp > 1:
        apply_fsdp(module, dims, cfg)
    return module


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token cross-entropy and the token count.

    ``logits`` may be a vocab-sharded DTensor (``Shard(-1)``, the output of
    the tensor-parallel head): the loss is then computed on the shards under
    ``loss_parallel()`` (a max, a sum of exponentials and the target logit are
    all-reduced; the [B, T, V] logits never are). Call it, and run backward,
    inside :func:`loss_context`. The returned sum is a plain tensor either way.
    """
    if hasattr(logits, "placements"):
        from torch.distributed.tensor import DTensor, Replicate

        count = (labels != IGNORE_INDEX).sum()
        labels_dt = DTensor.from_local(labels.reshape(-1), logits.device_mesh,
                                       [Replicate()] * logits.device_mesh.ndim)
        loss = F.cross_entropy(logits.float().flatten(0, -2), labels_dt,
                               ignore_index=IGNORE_INDEX, reduction="sum")
        return loss.to_local(), count
    return cross_entropy_sum(logits, labels)


def loss_context(dims):
    """``loss_parallel()`` when the head is vocab-parallel, else a no-op.
    Wrap both the loss and its backward in it."""
    if dims.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()
