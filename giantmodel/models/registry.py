"""Build models from config: on the meta device, then initialise in place.

Initialisation is layout-independent: every parameter's full value is drawn
from generators seeded by (seed, canonical parameter name, row chunk), and
each rank keeps only its shard. A tp2 x pp2 run therefore starts from exactly
the weights of a single-process run, which is what makes parity tests and
resharding possible.

At scale the draw must not cost minutes per rank, so it is done where the
parameter lives and in bounded pieces (see :func:`init_parameter`): on the
parameter's device (a CUDA generator is orders of magnitude faster than the
CPU's), in chunks of whole rows fixed by the full shape alone, skipping the
chunks that hold none of this rank's rows. Values therefore depend on the
device type that draws them: a CUDA run starts from other numbers than a CPU
run (and, since CUDA's launch grid follows the SM count, possibly another
GPU model's), but every layout on the same hardware starts from the same ones.
"""

from __future__ import annotations

import math
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from giantmodel.config.model import ModelConfig
from giantmodel.models.gpt.model import GPT
from giantmodel.models.llama.model import Llama

# Wrapper names inserted by torch.compile and activation checkpointing.
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(fqn: str) -> str:
    for part in _WRAPPER_PARTS:
        fqn = fqn.replace(part, "")
    return fqn


def model_class(arch: str) -> type[nn.Module]:
    if arch == "llama":
        return Llama
    if arch == "gpt":
        return GPT
    raise ValueError(f"unknown model.arch {arch!r}; expected 'llama' or 'gpt'")


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> nn.Module:
    """Construct the model without allocating (``device='meta'``) or on ``device``."""
    with torch.device(device):
        return model_class(cfg.arch)(cfg)


def _init_std(name: str, cfg: ModelConfig) -> float | None:
    """Std of the normal init for a parameter, or None for ones/zeros."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return None
    if "norm" in name:
        return None
    # Residual-branch output projections: GPT-2's 1/sqrt(2L) scaling.
    # MoE layers: the routed experts' stacked w2 and the shared experts' w2 too.
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight",
                      "feed_forward.experts.w2", "feed_forward.shared_experts.w2.weight")):
        return cfg.init_std / math.sqrt(2 * cfg.num_layers)
    return cfg.init_std


# Elements per generator call (64 MiB of fp32): what a rank holds besides its
# shards while drawing. The chunking depends on the full shape only, never on
# the layout, so that every layout draws the same numbers.
INIT_CHUNK_NUMEL = 2**24


def _chunk_rows(shape: tuple[int, ...]) -> int:
    row = math.prod(shape[1:])
    return max(1, INIT_CHUNK_NUMEL // max(row, 1))


def _chunk_seed(name: str, seed: int, chunk: int) -> int:
    base = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
    # Chunk 0 keeps the seed of the unchunked draw: a parameter of one chunk
    # (every parameter of the test models) has the values it always had on CPU.
    return base if chunk == 0 else (base + chunk * 0x9E3779B97F4A7C15) % 2**63


def _draw_into(out: torch.Tensor, name: str, std: float, seed: int, chunk: int) -> torch.Tensor:
    """Fill ``out`` (contiguous fp32, one chunk's rows) with that chunk's draw."""
    gen = torch.Generator(device=out.device).manual_seed(_chunk_seed(name, seed, chunk))
    return out.normal_(0.0, std, generator=gen)


def _fill_value(name: str) -> float:
    return 0.0 if name.endswith("bias") else 1.0


def full_init_tensor(name: str, shape: torch.Size, cfg: ModelConfig, seed: int,
                     device: str | torch.device = "cpu") -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``, in fp32 on
    ``device``: the values :func:`init_parameter` gives a parameter there."""
    std = _init_std(name, cfg)
    if std is None:
        return torch.full(tuple(shape), _fill_value(name), device=device)
    out = torch.empty(tuple(shape) or (1,), device=device)
    rows = _chunk_rows(tuple(out.shape))
    for c in range(-(-out.shape[0] // rows)):
        _draw_into(out[c * rows:(c + 1) * rows], name, std, seed, c)
    return out.reshape(tuple(shape))


def _global_indices(param: torch.Tensor) -> list[torch.Tensor | None]:
    """Per dimension of ``param``'s global shape, the global indices this rank
    holds, in local order (None: all of them). For a DTensor each dimension
    is sharded on its own by the placements that name it, so a 1-D index
    vector distributed by those placements alone (``distribute_tensor``'s own
    slicing, strided FSDP-over-TP shards included) gives its indices."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(param, DTensor):
        return [None] * param.dim()
    out: list[torch.Tensor | None] = []
    for d in range(param.dim()):
        projected, sharded = [], False
        for pl in param.placements:
            if pl.is_partial():
                raise ValueError(f"cannot initialise a parameter with placement {pl}")
            dim = getattr(pl, "dim", None)
            if dim is not None and dim % param.dim() == d:
                sharded = True
                projected.append(_StridedShard(0, split_factor=pl.split_factor)
                                 if isinstance(pl, _StridedShard) else Shard(0))
            else:
                projected.append(Replicate())
        if not sharded:
            out.append(None)
            continue
        device = param.to_local().device
        index = torch.arange(param.shape[d], device=device)
        # .to(device): distribute_tensor moves to the mesh's device type, which
        # a CPU-offloaded shard does not live on.
        out.append(distribute_tensor(index, param.device_mesh, projected,
                                     src_data_rank=None).to_local().to(device))
    return out


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into ``param``, keeping only this rank's shard when
    ``param`` is a DTensor (tensor-parallel or FSDP-sharded)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds the same full tensor, so
            # slice locally instead of broadcasting.
            local = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh,
                                      param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full.to(param.device, param.dtype))


def init_parameter(param: torch.Tensor, name: str, cfg: ModelConfig, seed: int) -> None:
    """Give ``param`` (plain or DTensor) its part of ``full_init_tensor(name,
    ..., device=param's device)``, drawing on that device one row chunk at a
    time, only the chunks that hold some of this rank's rows, and keeping only
    its own columns: no rank ever holds more than a chunk besides its shards."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.is_meta or local.numel() == 0:
            return
        std = _init_std(name, cfg)
        if std is None:
            local.fill_(_fill_value(name))
            return
        if param.dim() == 0:
            local.copy_(full_init_tensor(name, param.shape, cfg, seed, local.device))
            return
        index = _global_indices(param)
        shape = tuple(param.shape)
        rows = _chunk_rows(shape)
        in_place = all(i is None for i in index) and local.dtype == torch.float32 \
            and local.is_contiguous()

        @torch.no_grad()  # grad mode is per thread: the pool's threads need it too
        def fill(c: int) -> None:
            r0, r1 = c * rows, min(shape[0], (c + 1) * rows)
            if in_place:  # every row and column is ours: draw straight into it
                _draw_into(local[r0:r1], name, std, seed, c)
                return
            keep = None
            if index[0] is not None:
                keep = ((index[0] >= r0) & (index[0] < r1)).nonzero().squeeze(1)
                if keep.numel() == 0:
                    return
            chunk = _draw_into(torch.empty((r1 - r0, *shape[1:]), device=local.device),
                               name, std, seed, c)
            if keep is not None:
                chunk = chunk.index_select(0, index[0][keep] - r0)
            for d, idx in enumerate(index[1:], 1):
                if idx is not None:
                    chunk = chunk.index_select(d, idx)
            if keep is None:
                local[r0:r1].copy_(chunk)
            else:
                local.index_copy_(0, keep, chunk.to(local.dtype))

        chunks = range(-(-shape[0] // rows))
        if local.device.type == "cpu" and len(chunks) > 1 and torch.get_num_threads() > 1:
            # Chunks have their own generators: CPU cores draw them side by side
            # (the ops release the GIL). A device queues them in order anyway.
            with ThreadPoolExecutor(torch.get_num_threads()) as pool:
                list(pool.map(fill, chunks))
        else:
            for c in chunks:
                fill(c)


def init_weights(model: nn.Module, cfg: ModelConfig, seed: int,
                 device: str | torch.device = "cpu") -> nn.Module:
    """Materialise a meta-device (possibly sharded) model on ``device`` and
    initialise every parameter and buffer, deterministically per name."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        for module in model.modules():
            if hasattr(module, "tie_weights"):
                module.tie_weights()
    seen: set[int] = set()
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied weights: initialised once, under the first name
            continue
        seen.add(id(p))
        init_parameter(p, canonical_name(fqn), cfg, seed)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(device=device)
    return model


def count_params(model: nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
