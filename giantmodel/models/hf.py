"""Hugging Face interop: causal LM directories of every supported family.

A HF directory is ``config.json`` plus weights in one of these forms:
``model.safetensors``, sharded safetensors with ``model.safetensors.index.json``,
or ``pytorch_model.bin`` (optionally sharded, read with
``torch.load(weights_only=True)`` only). ``config.json``'s ``model_type``
names the family (:mod:`giantmodel.models.families`: llama, gpt2, qwen2,
qwen3, mistral), which maps the config and the tensor names both ways.

transformers is not needed here: configs are JSON and weights are safetensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig
from giantmodel.models.families import FAMILIES, family_for_hf, family_of
from giantmodel.models.families import llama as llama_family
from giantmodel.models.registry import build_model, canonical_name, copy_full_into

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16",
                torch.bfloat16: "bfloat16", torch.float64: "float64"}

# Kept for importers of the LLaMA layer names (LoRA's PEFT export).
_LLAMA_LAYER = llama_family.LAYER


# --------------------------------------------------------------------------- config

def read_hf_config(path: str | os.PathLike) -> dict:
    """The parsed ``config.json`` of a HF model directory."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise UserInputError(f"{path}: no config.json; expected a Hugging Face model directory "
                             "(config.json plus model.safetensors or a sharded index)")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UserInputError(f"{cfg_path}: not valid JSON ({e})") from None


def hf_config_to_model_config(hf: dict, name: str | None = None) -> ModelConfig:
    """Map a HF ``config.json`` mapping to a :class:`ModelConfig`, through the
    family its ``model_type`` names (:mod:`giantmodel.models.families`).

    Dropout is set to 0: HF configs carry the original pretraining's dropout,
    while giantmodel takes dropout from the job config (``model.dropout``).
    """
    family = family_for_hf(hf)
    name = name or hf.get("_name_or_path") or f"hf-{hf.get('model_type', family.name)}"
    try:
        fields = family.config_from_hf(hf)
    except KeyError as e:
        raise UserInputError(f"config.json lacks required key {e.args[0]!r} for "
                             f"{hf.get('model_type')}") from None
    cfg = ModelConfig(**fields, name=name, family=family.name)
    cfg.validate()
    return cfg


def model_config_to_hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` mapping transformers needs to rebuild ``cfg``, in
    the format of its family (``model.family``, else its arch's own); raises
    when the family cannot express something ``cfg`` has."""
    family = family_of(cfg)
    family.check_export(cfg, FAMILIES)
    dtype_name = _DTYPE_NAMES.get(dtype, "float32")
    return {**family.config_to_hf(cfg), "dtype": dtype_name, "torch_dtype": dtype_name}


# --------------------------------------------------------------------------- weights on disk

def _weight_files(path: Path) -> tuple[list[Path], str]:
    """The weight files of a HF directory, and their kind ('safetensors' | 'bin')."""
    for index_name, kind in ((SAFE_INDEX, "safetensors"), (BIN_INDEX, "bin")):
        index = path / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise UserInputError(f"{index}: not a valid shard index ({e!r})") from None
            files = [path / f for f in dict.fromkeys(weight_map.values())]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise UserInputError(f"{index} lists shards that do not exist: {missing}")
            return files, kind
    if (path / SAFE_SINGLE).is_file():
        return [path / SAFE_SINGLE], "safetensors"
    if (path / BIN_SINGLE).is_file():
        return [path / BIN_SINGLE], "bin"
    raise UserInputError(f"{path}: no weights found; expected {SAFE_SINGLE}, {SAFE_INDEX}, "
                         f"{BIN_SINGLE} or {BIN_INDEX}")


def iter_hf_tensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) one shard at a time, so peak memory stays
    near one shard rather than the whole model."""
    files, kind = _weight_files(Path(path))
    for f in files:
        if kind == "safetensors":
            from safetensors import safe_open
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                    yield key, handle.get_tensor(key)
        else:
            try:
                shard = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
                raise UserInputError(f"{f}: cannot be read as a weights-only torch file ({e})") \
                    from None
            yield from shard.items()
            del shard


def stored_dtype(path: str | os.PathLike) -> torch.dtype:
    """The floating dtype the weights are stored in (read from the first
    tensor's header, without loading the tensors)."""
    files, kind = _weight_files(Path(path))
    if kind == "safetensors":
        with open(files[0], "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for key, meta in header.items():
            if key != "__metadata__" and meta["dtype"] in _DTYPES:
                return _DTYPES[meta["dtype"]]
        return torch.float32
    for _, t in iter_hf_tensors(path):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


# --------------------------------------------------------------------------- name mapping

def hf_to_native(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """Rename (and where the family's layout says, transpose or split) one HF
    tensor into giantmodel tensors. Returns [] for buffers that giantmodel
    recomputes; raises on unknown names."""
    return family_of(cfg).to_native(name, tensor, cfg)


def native_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """giantmodel full state dict -> HF state dict (tied heads omitted, as HF does)."""
    return family_of(cfg).to_hf(state, cfg)


# --------------------------------------------------------------------------- load

def _targets(parts: Iterable[nn.Module], keep=None) -> dict[str, list[torch.Tensor]]:
    """Canonical parameter name -> the parameters (over all parts) it names."""
    out: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        for fqn, p in part.named_parameters(remove_duplicate=False):
            name = canonical_name(fqn)
            if keep is None or keep(name):
                out.setdefault(name, []).append(p)
    return out


def load_hf_into(parts: list[nn.Module], path: str | os.PathLike,
                 cfg: ModelConfig | None = None, keep=None) -> None:
    """Copy a HF checkpoint's weights into ``parts``, which may be plain,
    pipeline stages (each holding some layers) or DTensor-sharded: each
    parameter takes its own shard of the full tensor. Every parameter of
    ``parts`` (that ``keep``, name -> bool, selects) must be covered by the
    checkpoint."""

    cfg = cfg or hf_config_to_model_config(read_hf_config(path))
    targets = _targets(parts, keep)
    buffers = _buffer_targets(parts)
    filled: set[int] = set()
    for hf_name, tensor in iter_hf_tensors(path):
        if hf_name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # the tied head is the embedding, filled below from it
        for name, full in hf_to_native(hf_name, tensor, cfg):
            for part, key in buffers.get(name, []):
                # Persistent buffers (an MoE router's bias) go through
                # load_state_dict so their modules' load hooks see them.
                part.load_state_dict({key: full}, strict=False)
            names = [name]
            if name == "tok_embeddings.weight" and cfg.tie_embeddings:
                names.append("output.weight")
            for n in names:
                for p in targets.get(n, []):
                    if tuple(_global_shape(p)) != tuple(full.shape):
                        raise UserInputError(
                            f"{path}: {hf_name} has shape {tuple(full.shape)} but the model's "
                            f"{n} is {tuple(_global_shape(p))}; the config and weights disagree")
                    if id(p) not in filled:
                        copy_full_into(p, full)
                        filled.add(id(p))
    missing = sorted({n for n, ps in targets.items() for p in ps if id(p) not in filled})
    if missing:
        raise UserInputError(f"{path}: the checkpoint has no weights for {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")


def _buffer_targets(parts: Iterable[nn.Module]) -> dict[str, list[tuple[nn.Module, str]]]:
    """Canonical name -> (part, state-dict key) of each persistent buffer:
    loaded when the checkpoint has it, never required."""
    out: dict[str, list[tuple[nn.Module, str]]] = {}
    for part in parts:
        params = {canonical_name(n) for n, _ in part.named_parameters(remove_duplicate=False)}
        for key in part.state_dict(keep_vars=True):
            if canonical_name(key) not in params:
                out.setdefault(canonical_name(key), []).append((part, key))
    return out


def _global_shape(p: torch.Tensor) -> torch.Size:
    from torch.distributed.tensor import DTensor
    return p.size() if isinstance(p, DTensor) else p.shape


def from_hf(path: str | os.PathLike, device: str | torch.device = "cpu",
            dtype: torch.dtype | None = None) -> nn.Module:
    """Load a HF causal LM directory (any supported family) as a giantmodel
    model (in eval mode, like ``from_pretrained``). ``dtype=None`` keeps the
    stored dtype. The model carries its :class:`ModelConfig` as ``model.cfg``."""

    path = Path(path)
    cfg = hf_config_to_model_config(read_hf_config(path), name=path.resolve().name)
    dtype = dtype or stored_dtype(path)
    model = build_model(cfg, device="meta").to(dtype)
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "tie_weights"):
            module.tie_weights()
    load_hf_into([model], path, cfg)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(device=device)
    return model.eval()


# --------------------------------------------------------------------------- save

def plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for fqn, t in model.state_dict().items():
        if isinstance(t, DTensor):
            t = t.full_tensor()  # a collective: every rank of the mesh must call to_hf
        out[canonical_name(fqn)] = t
    return out


def save_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | os.PathLike,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            dtype: torch.dtype | None = None) -> list[Path]:
    """Write a giantmodel full state dict as a HF directory: config.json plus
    ``model.safetensors``, or numbered shards and an index when the weights
    exceed ``max_shard_bytes``. Returns the weight files written."""
    from safetensors.torch import save_file

    family_of(cfg).check_export(cfg, FAMILIES)  # before anything is written
    out = Path(out_dir)
    if out.exists() and (any(out.glob("model*.safetensors*")) or (out / BIN_SINGLE).exists()):
        raise UserInputError(f"{out} already holds model weights; export into an empty "
                             "directory so stale shards cannot mix with new ones")
    out.mkdir(parents=True, exist_ok=True)
    hf_state = native_to_hf(state, cfg)
    dtype = dtype or next((t.dtype for t in hf_state.values() if t.is_floating_point()),
                          torch.float32)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in hf_state.items():
        t = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.clone() if t.untyped_storage().nbytes() != nbytes else t
        size += nbytes
    files = ([out / SAFE_SINGLE] if len(shards) == 1 else
             [out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
              for i in range(len(shards))])
    for f, shard in zip(files, shards):
        save_file(shard, str(f), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for s in shards for t in s.values())},
                 "weight_map": {n: f.name for f, s in zip(files, shards) for n in s}}
        (out / SAFE_INDEX).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(model_config_to_hf_config(cfg, dtype), indent=2))
    return files


def to_hf(model: nn.Module, model_cfg: ModelConfig, out_dir: str | os.PathLike,
          max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
          dtype: torch.dtype | None = None) -> list[Path]:
    """Export a whole (unsplit) giantmodel model as a HF directory that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads."""
    return save_hf(plain_state(model), model_cfg, out_dir, max_shard_bytes, dtype)
