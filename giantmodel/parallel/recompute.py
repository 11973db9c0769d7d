"""Activation recomputation, per transformer block: ``none``, ``selective`` or ``full``.

* ``full`` checkpoints whole blocks: only each block's input is kept and the
  block's forward runs again in backward.
* ``selective`` checkpoints each block under an op-level policy that keeps
  only the expensive results backward needs: matmul outputs, the fused
  attention kernel's output and log-sum-exp (SDPA's kernels, and for packed
  sequences the varlen op and the flex-attention op), and the sequence-parallel
  reduce-scatter results (a 1/tp slice). Everything else is recomputed from
  those and the block input: norms, rotary embedding, autocast's casts, the
  MLP activation and gating product, masks, and the collectives whose
  results are full size: the sequence- and context-parallel all-gathers and
  the tensor-parallel all-reduce (re-run in backward, as Megatron re-gathers
  for sequence parallelism; the row-parallel partial sums they read are kept
  as matmul outputs). So selective keeps strictly less than ``none`` (the fp32
  norm outputs, the per-linear low-precision copies of their inputs, the
  rotated q/k and the activation outputs all go) and recomputes no matmul
  and no attention; under tensor or context parallelism it re-runs two
  collectives per block in backward.

  Where it pays: with a fused attention kernel (SDPA's flash / efficient path,
  the CPU flash kernel) ``none`` never holds the s x s scores, so selective
  trades elementwise recompute (about 5-10% of a block's time) for roughly
  half of a block's activations. Under sequence parallelism it also drops the
  gathered full-sequence norm outputs, at one extra all-gather per sub-block
  in backward.
* ``recompute_layers`` (a per-block list) mixes modes: ``giantmodel plan``
  writes it when recomputing only some blocks is enough to fit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

MODES = ("none", "selective", "full")

_aten = torch.ops.aten
# Matmuls: bmm is left out on purpose: outside a fused kernel it computes the
# s x s attention scores, which are cheap to recompute and large to keep.
# The routed experts' grouped GEMM (CUDA, bf16) counts as a matmul: keeping its
# outputs is what the planner's selective terms assume (torch.ops.aten grew
# _grouped_mm after 2.7; older torch never reaches that path).
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten._scaled_mm.default}
if hasattr(_aten, "_grouped_mm"):
    _MATMULS.add(_aten._grouped_mm.default)
_ATTENTION = {
    getattr(_aten, name).default
    for name in ("_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention",
                 "_flash_attention_forward", "_efficient_attention_forward")
    if hasattr(_aten, name)
}


def _packed_attention_ops() -> set:
    """The packed-sequence attention kernels, whose names move between torch
    releases: varlen's custom op (namespace ``torch_attn``, earlier
    ``torch_nn_attention``) and the flex-attention higher-order op (which
    torch routes through the checkpoint policy). Probed, so a missing one is
    simply absent. A custom op is opaque to the policy (its inner flash call
    is never seen), so it must be listed itself or it reruns in backward.
    ``_varlen_attn_out`` (the out= form) is left out: it writes into its
    argument, which a cached result would skip."""
    found = set()
    try:
        import torch.nn.attention.varlen  # noqa: F401  (registers the custom op)
    except ImportError:
        pass
    for ns in ("torch_attn", "torch_nn_attention"):
        packet = getattr(getattr(torch.ops, ns), "_varlen_attn", None)
        if packet is not None and hasattr(packet, "default"):
            found.add(packet.default)
    try:
        from torch._higher_order_ops.flex_attention import flex_attention
    except ImportError:
        return found
    found.add(flex_attention)
    return found


_ATTENTION |= _packed_attention_ops()
# Reduce-scatter results are a 1/tp slice: kept. All-reduce and all-gather
# results are full size: re-run in backward.
_SAVED_COLLECTIVES = ("reduce_scatter",)


def _collective_kind(op) -> str | None:
    """The name of a functional collective (or its wait). In-place c10d
    collectives (the sequence-parallel projections' all-gather) have no
    wait_tensor: they count as ordinary ops, recomputed."""
    ns = getattr(op, "namespace", "")
    if ns not in ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
                  "_dtensor"):
        return None
    return str(getattr(op, "__name__", op)).split(".")[0]


class _SelectivePolicy:
    """The selective policy for one checkpointed block call (forward and its
    recompute). ``wait_tensor`` returns the tensor a collective produced, so
    it is saved exactly when that collective was: waits come in the order
    their collectives were issued, tracked per phase."""

    def __init__(self):
        self._pending: dict[bool, list[bool]] = {False: [], True: []}

    def __call__(self, ctx, op, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        if op in _MATMULS or op in _ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        kind = _collective_kind(op)
        if kind is None:
            return CheckpointPolicy.PREFER_RECOMPUTE
        pending = self._pending[ctx.is_recompute]
        if kind == "wait_tensor":
            save = pending.pop(0) if pending else False
        else:
            save = kind.startswith(_SAVED_COLLECTIVES)
            pending.append(save)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_SelectivePolicy())


def apply_recompute(model: nn.Module, modes: dict[str, str]) -> None:
    """Wrap each block of ``model`` for its mode: ``modes`` maps a block's
    dotted name to none, selective or full."""
    for name, mode in modes.items():
        if mode not in MODES:
            raise ValueError(f"recompute must be none, selective or full; got {mode!r}")
        if mode == "none":
            continue
        kwargs = {"context_fn": _selective_context} if mode == "selective" else {}
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, checkpoint_wrapper(owner.get_submodule(leaf), **kwargs))
