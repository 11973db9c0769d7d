"""Feature probes for torch APIs newer than the oldest torch giantmodel supports.

setup.py promises ``torch>=2.11`` (what NGC images and clusters run); the code
is developed on newer releases. Every API used here that 2.11 lacks is
probed once, by signature or attribute, and its call site takes the older
path when the probe says no:

=====================  ======================================================
probe                  what it detects (absent in torch 2.11)
=====================  ======================================================
pipeline_get_mesh      ``PipelineStage(..., get_mesh=...)``: DTensor
                       activations between pipeline stages
varlen_enable_gqa      ``varlen_attn(..., enable_gqa=...)``: fewer k/v heads
                       than query heads; without it k/v are expanded first
all_gather_single      ``dist.all_gather_single`` / ``reduce_scatter_single``;
                       without them ``all_gather_into_tensor`` /
                       ``reduce_scatter_tensor`` (the same collectives)
varlen_window          ``varlen_attn(..., window_size=...)`` (early releases
                       took ``is_causal``): causal and sliding windows;
                       without it packed and sliding attention take flex
grouped_mm             ``torch._grouped_mm(a, b, offs=...)``: the experts of an
                       MoE layer in one grouped GEMM (a fused kernel for bf16
                       on sm90+); without it one matmul per expert
=====================  ======================================================

A probe can be forced off, to test the older path on a new torch: list its
name in the environment variable ``GIANTMODEL_COMPAT_OFF`` (comma-separated,
read once, inherited by spawned ranks) or use :func:`forced_off` in-process.
Probes never import CUDA-only code and never touch a device.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator

import torch

ENV_OFF = "GIANTMODEL_COMPAT_OFF"


def _accepts(fn: Callable | None, keyword: str) -> bool:
    if fn is None:
        return False
    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _pipeline_get_mesh() -> bool:
    try:
        from torch.distributed import pipelining
    except ImportError:  # a torch built without distributed
        return False

    return _accepts(pipelining.PipelineStage.__init__, "get_mesh")


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_enable_gqa() -> bool:
    return _accepts(_varlen_attn(), "enable_gqa")


def _all_gather_single() -> bool:
    import torch.distributed as dist

    return dist.is_available() and hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single")


def _varlen_window() -> bool:
    return _accepts(_varlen_attn(), "window_size")


def _grouped_mm() -> bool:
    # private; the same schema in 2.11 and 2.13: (self, mat2, offs=None, bias=None, out_dtype=None)
    return callable(getattr(torch, "_grouped_mm", None))


PROBES: dict[str, Callable[[], bool]] = {
    "pipeline_get_mesh": _pipeline_get_mesh,
    "varlen_enable_gqa": _varlen_enable_gqa,
    "all_gather_single": _all_gather_single,
    "varlen_window": _varlen_window,
    "grouped_mm": _grouped_mm,
}


def _env_forced_off() -> frozenset[str]:
    names = {n.strip() for n in os.environ.get(ENV_OFF, "").split(",") if n.strip()}
    unknown = names - PROBES.keys()
    if unknown:  # a typo would silently test the new path instead
        raise ValueError(f"{ENV_OFF} names unknown probes {sorted(unknown)}; "
                         f"known: {sorted(PROBES)}")
    return frozenset(names)


# Probed at import, not on first use: a call site may sit inside a
# torch.compile'd block, where tracing ``inspect`` would break the graph;
# there :func:`has` is only dictionary and set lookups.
_results: dict[str, bool] = {name: probe() for name, probe in PROBES.items()}
_forced: set[str] = set(_env_forced_off())


def has(name: str) -> bool:
    """Whether the installed torch has the API ``name`` (a key of :data:`PROBES`)
    and it is not forced off."""
    return _results[name] and name not in _forced


@contextlib.contextmanager
def forced_off(*names: str) -> Iterator[None]:
    """Within the block, :func:`has` answers False for ``names``."""
    for n in names:
        if n not in PROBES:
            raise KeyError(f"unknown torch feature probe {n!r}")
    added = set(names) - _forced  # env-forced names stay off after the block
    _forced.update(added)
    try:
        yield
    finally:
        _forced.difference_update(added)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# ------------------------------------------------------------------ fallbacks
def expand_kv_heads(k: torch.Tensor, v: torch.Tensor, q_heads: int,
                    head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v with their heads (dimension ``head_dim``) repeated up to ``q_heads``,
    so that a kernel without GQA support computes grouped-query attention:
    query head h reads k/v head ``h // (q_heads // kv_heads)``, the grouping
    of SDPA's ``enable_gqa`` (each k/v head repeated in place, not tiled)."""
    kv_heads = k.shape[head_dim]
    if q_heads == kv_heads:
        return k, v
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} k/v heads")
    group = q_heads // kv_heads
    return (k.repeat_interleave(group, dim=head_dim), v.repeat_interleave(group, dim=head_dim))


def pipeline_stage(module, stage_index: int, num_stages: int, device: torch.device, *,
                   group=None, get_mesh: Callable | None = None):
    """``PipelineStage`` with ``get_mesh`` where torch takes it; older torch
    builds the stage without it (it cannot pass DTensor activations; see
    :func:`check_plain_activation`)."""
    from torch.distributed import pipelining

    kwargs = {"group": group}
    if get_mesh is not None and has("pipeline_get_mesh"):
        kwargs["get_mesh"] = get_mesh
    return pipelining.PipelineStage(module, stage_index, num_stages, device, **kwargs)


def check_plain_activation(output) -> None:
    """Raise when a pipeline stage would send a DTensor (sequence-parallel
    activations) through a torch whose pipelining cannot carry one."""
    from torch.distributed.tensor import DTensor

    outs = output if isinstance(output, tuple) else (output,)
    if any(isinstance(o, DTensor) for o in outs) and not has("pipeline_get_mesh"):
        raise RuntimeError(
            f"torch {torch.__version__} cannot pass DTensor activations between pipeline "
            "stages (parallel.pp > 1 with parallel.sp); set parallel.sp=false or use a "
            "torch whose PipelineStage takes get_mesh (2.13 does)")


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None,
                      async_op: bool = False):
    """``dist.all_gather_single``, or ``all_gather_into_tensor`` before it existed."""
    import torch.distributed as dist

    fn = dist.all_gather_single if has("all_gather_single") else dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=None, group=None,
                          async_op: bool = False):
    """``dist.reduce_scatter_single``, or ``reduce_scatter_tensor`` before it existed."""
    import torch.distributed as dist

    fn = dist.reduce_scatter_single if has("all_gather_single") else dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.SUM if op is None else op, group=group,
              async_op=async_op)


def grouped_mm_fused(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs as one fused kernel for ``dtype`` on
    ``device``: bf16 on a CUDA GPU of compute capability 9.x or 10.x (the
    CUTLASS path torch takes there). Elsewhere torch loops over the groups
    itself, no faster than a loop of matmuls. Reads only device properties."""
    if not has("grouped_mm") or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)
