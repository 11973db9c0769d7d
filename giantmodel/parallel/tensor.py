"""Tensor and sequence parallelism as DTensor plans over the model's fixed names.

Megatron's split, expressed with ``parallelize_module``:

* attention: ``wq/wk/wv`` column-parallel (each tp rank gets whole query *and*
  key/value heads, so GQA's kv heads are sharded too; their biases shard with
  their columns), ``wo`` row-parallel (its bias replicated); qk-norm runs on
  each rank's heads with its weight replicated (:func:`_qk_norm_plan`);
* MLP: ``w1``/``w3`` column-parallel, ``w2`` row-parallel;
* token embedding row-parallel over the vocabulary (vocab-parallel embedding);
* output head column-parallel with logits left as ``Shard(-1)`` DTensors: the
  loss runs under ``loss_parallel()`` and logits are never gathered.

With ``sp`` the residual stream between blocks is sharded along the sequence
(``Shard(1)``): norms run on sequence shards, the row-parallel outputs
reduce-scatter instead of all-reduce, and each block all-gathers its input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from giantmodel.core.loss import IGNORE_INDEX, cross_entropy_sum
from giantmodel.models.common.layers import Attention, SwiGLU
from giantmodel.models.common.moe import MoE
from giantmodel.parallel.sp_linear import install_projector


def _block_plan(sp: bool, rope: bool, projected: tuple[str, ...] = ()) -> dict:
    """``projected``: the sub-blocks ("attention", "feed_forward") whose
    column-parallel linears run through a sequence-parallel projector
    (giantmodel.parallel.sp_linear): they take the residual stream as it is,
    so they get no input preparation."""
    # Under sp the residual stream stays a DTensor (global shape), so the
    # model still sees the full sequence length when it indexes RoPE.
    residual = Shard(1) if sp else Replicate()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual, use_local_output=not sp),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual, use_local_output=not sp),
    }
    # Each sub-block takes its input as one DTensor (gathered along the
    # sequence under sp), so the gradients of wq/wk/wv (and w1/w3) meet as
    # one Partial sum and backward does one collective per sub-block rather
    # than one per column-parallel linear.
    prepare = {
        # attention(x[, rope]): rope stays a plain tensor.
        "attention": PrepareModuleInput(
            input_layouts=(residual, None) if rope else (residual,),
            desired_input_layouts=(Replicate(), None) if rope else (Replicate(),)),
        "feed_forward": PrepareModuleInput(input_layouts=(residual,),
                                           desired_input_layouts=(Replicate(),)),
    }
    plan.update({k: v for k, v in prepare.items() if k not in projected})
    if sp:
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
    return plan


def _moe_plan(sp: bool) -> dict:
    """An MoE feed-forward is not split by tp (expert tensor parallelism of
    1; expert parallelism splits the experts): every tp rank runs the router,
    its experts and the shared experts on the whole, identical tokens, and
    their weights stay plain tensors whose gradients agree across tp. Under
    sp the layer takes the sequence gathered and gives back its own shard."""
    return {"feed_forward": _GatheredModule()} if sp else {}


class _GatheredModule(ParallelStyle):
    """Sequence-sharded DTensor in, whole local tensor to the module, its
    output back as the sequence-sharded DTensor (no reduction: the module's
    output is the same on every tp rank)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                           use_local_output=True)._apply(module, device_mesh)
        PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
                            use_local_output=False)._apply(module, device_mesh)
        return module


def _projected(block: nn.Module) -> tuple[str, ...]:
    """The sub-blocks whose fused projections take the sequence-parallel
    projector: llama-style attention and gated MLPs (GPT's MLP and MoE
    layers keep their plans)."""
    out = []
    if type(getattr(block, "attention", None)) is Attention:
        out.append("attention")
    if type(getattr(block, "feed_forward", None)) is SwiGLU:
        out.append("feed_forward")
    return tuple(out)


def _qk_norm_plan(block: nn.Module) -> dict:
    """qk-norm (Qwen3): q and k arrive as [B, T, local heads, D] local shards
    of the column-parallel projections. The norm runs on them as DTensors
    sharded along the heads (dim 2) with its [D] weight replicated, so each
    rank normalises its own heads and the weight's gradient, a sum over all
    heads, is reduced across the tp group."""
    attention = getattr(block, "attention", None)
    if attention is None or not hasattr(attention, "q_norm"):
        return {}
    return {f"attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True)
            for n in ("q_norm", "k_norm")}


def _post_norm_plan(block: nn.Module, sp: bool) -> dict:
    """Gemma's post-attention and post-feed-forward norms sit after the
    row-parallel outputs: under sp those are sequence shards, so the norms
    run as SequenceParallel (weights replicated, their gradients reduced
    across the tp group); without sp their input is whole on every rank."""
    if not sp:
        return {}
    return {path: SequenceParallel() for path in ("attention.out_norm", "feed_forward.out_norm")
            if _has_submodule(block, path)}


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


StyleFor = Callable[[nn.Module, ParallelStyle], ParallelStyle]
"""``style_for(module, style)``: the style to apply to a block's ``module``
where the plan says ``style`` (a model that swapped a linear for another
module, such as a LoRA linear, gives that module its own style)."""


def apply_tensor_parallel(model: nn.Module, tp_mesh, sp: bool,
                          style_for: StyleFor | None = None) -> None:
    """Shard ``model`` (a whole model or a pipeline stage) in place over
    ``tp_mesh``; ``style_for`` may replace the style of any block module."""
    residual = Shard(1) if sp else Replicate()
    top: dict = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                                use_local_output=not sp)
    if getattr(model, "pos_embeddings", None) is not None and sp:
        # Learned positions stay replicated; as a DTensor they add onto the
        # sequence-sharded token embeddings by local slicing (no collective).
        top["pos_embeddings"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False)
    if getattr(model, "norm", None) is not None and sp:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1),
                                        use_local_output=False)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        projected = _projected(block)
        plan = _block_plan(sp, rope=getattr(model, "uses_rope", True), projected=projected)
        if isinstance(block.feed_forward, MoE):
            plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward")}
            plan.update(_moe_plan(sp))
        elif hasattr(block.feed_forward, "w3"):
            plan["feed_forward.w3"] = ColwiseParallel()
        plan.update(_qk_norm_plan(block))
        plan.update(_post_norm_plan(block, sp))
        if style_for is not None:
            plan = {path: style_for(block.get_submodule(path), style)
                    for path, style in plan.items()}
        parallelize_module(block, tp_mesh, plan)
        for name in projected:
            sub = getattr(block, name)
            install_projector(sub, sub.wo if name == "attention" else sub.w2, tp_mesh, sp)
    if hasattr(model, "tie_weights"):
        # parallelize_module swapped the embedding Parameter for a DTensor; the
        # head shares it (both are sharded over vocabulary rows).
        model.tie_weights()


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token cross-entropy and the token count.

    ``logits`` may be a vocab-sharded DTensor (``Shard(-1)``, the output of
    the tensor-parallel head): the loss is then computed on the shards under
    ``loss_parallel()`` (a max, a sum of exponentials and the target logit are
    all-reduced; the [B, T, V] logits never are). Call it, and run backward,
    inside :func:`loss_parallel_context`. The returned sum is a plain tensor
    either way.
    """
    if not isinstance(logits, DTensor):
        return cross_entropy_sum(logits, labels)
    count = (labels != IGNORE_INDEX).sum()
    labels_dt = DTensor.from_local(labels.reshape(-1), logits.device_mesh,
                                   [Replicate()] * logits.device_mesh.ndim)
    loss = F.cross_entropy(logits.float().flatten(0, -2), labels_dt,
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss.to_local(), count


def loss_parallel_context(enabled: bool):
    """``loss_parallel()`` when the head is vocab-parallel, else a no-op.
    Wrap both the loss and its backward in it."""
    return loss_parallel() if enabled else contextlib.nullcontext()
