"""The frozen base of a LoRA model, in the dtypes giantmodel.objectives.lora keeps it.

Under ``precision=bf16`` the objective re-makes every frozen floating-point
parameter in bf16 (``cast_frozen``): the autocast matmuls would cast it for
every call anyway. Parameters that are DTensors when the cast runs keep
their dtype (their wrappers own them): under tensor parallelism the
embedding, the head and every block linear (weight and bias, row-parallel
biases replicated), and the norms under sequence parallelism; under FSDP2
every parameter (sharded fp32; its mixed-precision policy gathers them in
bf16). With ``lora.quantize_base=nf4`` (QLoRA: tp 1, no FSDP) each adapted
linear's weight whose size is a multiple of 64 x 256 values is a torchao NF4
tensor in the frozen dtype; other weights and all biases stay float.

Consequences beyond the parameters' bytes, which the memory model takes from
here: a frozen linear already in the compute dtype (or NF4: torchao's linear
saves the 4-bit weight and dequantises again in backward) needs no cast,
and a bf16 token embedding makes the residual stream bf16 (see
:func:`giantmodel.planner.memory.layer_terms`).

Which linears run which forward (:func:`fused_groups`): the adapted ones
are :class:`~giantmodel.models.lora.LoRALinear` modules with a forward of
their own, and so is every linear sharing a fused group with one (q|k|v,
gate|up). A group none of whose linears is adapted is plain ``nn.Linear``
and runs the fused GEMM (:mod:`giantmodel.models.common.fused`, the
projectors of :mod:`giantmodel.parallel.sp_linear` under tp): it saves its
input although no weight of the group needs a gradient, and keeps its
weights' compute-dtype cast on the module for the whole step
(``train.weight_cast=step``) instead of autocast's per-call copy.
"""

from __future__ import annotations

import math

from giantmodel.models.lora import NF4_BLOCK

_BLOCK_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def nf4_bytes(numel: int, itemsize: int) -> float:
    """Bytes of one torchao NF4 tensor of ``numel`` values dequantising to a
    dtype of ``itemsize`` bytes: 4-bit codes, an int8 scale per 64 values, a
    scale (in that dtype) per 256 of those, plus the 16-entry code table and
    the scales' mean."""
    return numel / 2 + numel / 64 + numel / (64 * 256) * itemsize + 17 * itemsize


def tp_dtensor(name: str, sp: bool) -> bool:
    """Whether the tensor-parallel plan (giantmodel.parallel.tensor) turns
    parameter ``name`` (a block's parameters named inside the block) into a
    DTensor: token embedding, head, block linears, and norms under sp."""
    parts = name.split(".")
    if parts[0] in ("tok_embeddings", "output"):
        return True
    if len(parts) >= 2 and parts[-2] in _BLOCK_LINEARS:
        return True
    return sp and any(p == "norm" or p.endswith("_norm") for p in parts[:-1])


def casts_base(layout, sharded: bool) -> bool:
    """Whether the frozen float parameters that are plain tensors are kept
    in bf16 (``precision=bf16``; nothing is plain under FSDP2)."""
    return bool(layout.lora_rank) and layout.precision == "bf16" and not sharded


def nf4_weight(name: str, shape: tuple[int, ...], layout) -> bool:
    """Whether QLoRA stores this block parameter (full shape) in NF4."""
    path, _, leaf = name.rpartition(".")
    return (layout.lora_nf4 and leaf == "weight" and path in layout.lora_paths
            and math.prod(shape) % NF4_BLOCK == 0)


def frozen_param_bytes(params, in_block: list[bool], layout, param_bytes: int,
                       sharded: bool, numel_of) -> float:
    """Bytes of the frozen base parameters ``params`` (planner ``Param``s;
    ``in_block[i]`` says whether ``params[i]`` belongs to a block) on one
    rank. ``param_bytes``: the precision style's bytes per float parameter;
    ``numel_of(param)``: its local element count (tp and FSDP shards)."""
    cast = casts_base(layout, sharded)
    itemsize = 2 if cast else param_bytes
    total = 0.0
    for p, block in zip(params, in_block):
        n = numel_of(p)
        if block and not sharded and nf4_weight(p.name, p.shape, layout):
            total += nf4_bytes(n, itemsize)
        elif cast and not (layout.tp > 1 and tp_dtensor(p.name, layout.sp)):
            total += 2 * n
        else:
            total += param_bytes * n
    return total


# The block linears that read one input, run as one GEMM when all are plain
# (giantmodel.models.common.layers: Attention and SwiGLU call fused.project).
_ATTENTION_GROUPS = (("attention.wq", "attention.wk", "attention.wv"), ("attention.wo",))
_SWIGLU_GROUPS = (("feed_forward.w1", "feed_forward.w3"), ("feed_forward.w2",))


def fused_groups(m, paths: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The groups of block linears that run the fused path under LoRA with
    adapters on ``paths``: attention's (not MLA's) and a dense gated MLP's
    (not GPT's GeluMLP, whose linears run alone), none of whose linears is
    adapted."""
    groups = list(_ATTENTION_GROUPS) if m.mla is None else []
    if m.arch == "llama" and m.moe is None:
        groups += _SWIGLU_GROUPS
    return [g for g in groups if not any(p in paths for p in g)]


def base_copy_numel(m, layer_params, layout, sharded: bool) -> tuple[int, int]:
    """Elements of one block's frozen linear weights that are cast to the
    compute dtype (``bf16``/``fp16``, zero 0/1): those neither already in
    it nor NF4. Returned as (per forward, per step): a linear running its
    own forward is cast by autocast at each call (a frozen weight is not in
    autocast's cache) and autograd keeps that copy until backward, in a
    block that does not recompute; a linear of a fused group
    (:func:`fused_groups`) keeps its cast on the module through the step
    whatever the block recomputes (none with ``train.weight_cast=use``)."""
    cast = casts_base(layout, sharded)
    fused = {p for g in fused_groups(m, layout.lora_paths) for p in g}
    per_use = per_step = 0
    for p in layer_params:
        parts = p.name.split(".")
        if len(parts) < 2 or parts[-2] not in _BLOCK_LINEARS or parts[-1] != "weight":
            continue
        if nf4_weight(p.name, p.shape, layout):
            continue
        if cast and not (layout.tp > 1 and tp_dtensor(p.name, layout.sp)):
            continue
        n = math.prod(p.local_shape(layout.tp))
        if p.name.rpartition(".")[0] in fused:
            per_step += n if layout.weight_cast == "step" else 0
        else:
            per_use += n
    return per_use, per_step


def bf16_residual(layout, sharded: bool) -> bool:
    """Whether the residual stream is bf16 because the frozen token embedding
    is (a plain parameter cast to bf16: tensor parallelism keeps it fp32)."""
    return casts_base(layout, sharded) and layout.tp == 1
