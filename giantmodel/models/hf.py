"""Hugging Face interop: LlamaForCausalLM and GPT2LMHeadModel directories.

A HF directory is ``config.json`` plus weights in one of these forms:
``model.safetensors``, sharded safetensors with ``model.safetensors.index.json``,
or ``pytorch_model.bin`` (optionally sharded, read with
``torch.load(weights_only=True)`` only). Conversion is a pure renaming, except
for GPT-2, whose ``Conv1D`` weights are stored transposed and whose ``c_attn``
packs q, k and v in one matrix. LLaMA q/k weights need no permutation because
giantmodel's RoPE uses the same half-split pairing as HF.

transformers is not needed here: configs are JSON and weights are safetensors.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig, RopeScaling
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

# HF name -> giantmodel name. Groups: (layer index, leaf).
_LLAMA_LAYER = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}
_LLAMA_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight",
              "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
_GPT_LAYER = {"ln_1": "attention_norm", "ln_2": "ffn_norm", "attn.c_proj": "attention.wo",
              "mlp.c_fc": "feed_forward.w1", "mlp.c_proj": "feed_forward.w2"}
_GPT_TOP = {"wte.weight": "tok_embeddings.weight", "wpe.weight": "pos_embeddings.weight",
            "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias",
            "lm_head.weight": "output.weight"}
# Buffers that old checkpoints stored next to the weights; recomputed here.
_IGNORED = re.compile(r"(?:^|\.)(?:rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")
_LAYER_RE = re.compile(r"^(?:model\.layers|h)\.(\d+)\.(.+)\.(weight|bias)$")


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


def _arch_of(hf: dict) -> str:
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type == "llama" or "LlamaForCausalLM" in archs:
        return "llama"
    if model_type == "gpt2" or "GPT2LMHeadModel" in archs:
        return "gpt"
    raise UserInputError(
        f"unsupported Hugging Face model_type {model_type!r} (architectures {archs}); "
        "giantmodel reads LlamaForCausalLM ('llama') and GPT2LMHeadModel ('gpt2')")


def _rope_params(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from either config style: transformers 5
    nests both in ``rope_parameters``; older configs use ``rope_theta`` and
    ``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params else None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise UserInputError(
                f"RoPE scaling type {kind!r} is not supported; giantmodel implements the "
                "default and 'llama3' schemes")
    return float(theta), scaling


def _llama_config(hf: dict, name: str) -> ModelConfig:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UserInputError(f"LLaMA hidden_act {act!r} is not supported; expected 'silu'")
    if hf.get("mlp_bias"):
        raise UserInputError("LLaMA with mlp_bias=true is not supported (giantmodel's "
                             "SwiGLU has no biases)")
    theta, scaling = _rope_params(hf)
    rope_scaling = None
    if scaling is not None:
        rope_scaling = RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_seq_len=int(scaling["original_max_position_embeddings"]))
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    kv = hf.get("num_key_value_heads")
    return ModelConfig(
        arch="llama", name=name, hidden_size=hidden, num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(kv) if kv is not None else None,
        head_dim=int(head_dim) if head_dim and head_dim * heads != hidden else None,
        ffn_hidden_size=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)), rope_theta=theta,
        rope_scaling=rope_scaling, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", 0.02)), dropout=0.0,
        attn_bias=bool(hf.get("attention_bias", False)))


def _gpt2_config(hf: dict, name: str) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserInputError(f"GPT-2 activation_function {act!r} is not supported; giantmodel's "
                             "GPT uses the tanh GELU ('gelu_new')")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        raise UserInputError("GPT-2 with non-standard attention scaling (scale_attn_weights=false "
                             "or scale_attn_by_inverse_layer_idx=true) is not supported")
    hidden = int(hf["n_embd"])
    return ModelConfig(
        arch="gpt", name=name, hidden_size=hidden, num_layers=int(hf["n_layer"]),
        num_heads=int(hf["n_head"]), num_kv_heads=None,
        ffn_hidden_size=int(hf.get("n_inner") or 4 * hidden), vocab_size=int(hf["vocab_size"]),
        max_seq_len=int(hf["n_positions"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        init_std=float(hf.get("initializer_range", 0.02)), dropout=0.0, attn_bias=True)


def hf_config_to_model_config(hf: dict, name: str | None = None) -> ModelConfig:
    """Map a HF ``config.json`` mapping to a :class:`ModelConfig`.

    Dropout is set to 0: HF configs carry the original pretraining's dropout,
    while giantmodel takes dropout from the job config (``model.dropout``).
    """
    arch = _arch_of(hf)
    name = name or hf.get("_name_or_path") or f"hf-{hf.get('model_type', arch)}"
    try:
        cfg = _llama_config(hf, name) if arch == "llama" else _gpt2_config(hf, name)
    except KeyError as e:
        raise UserInputError(f"config.json lacks required key {e.args[0]!r} for "
                             f"{hf.get('model_type')}") from None
    cfg.validate()
    return cfg


def model_config_to_hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` mapping transformers needs to rebuild ``cfg``.

    RoPE is written in both the transformers-5 form (``rope_parameters``) and
    the older ``rope_theta``/``rope_scaling`` keys, so either generation reads it.
    """
    dtype_name = _DTYPE_NAMES.get(dtype, "float32")
    if cfg.arch == "gpt":
        if cfg.kv_heads != cfg.num_heads or cfg.dim_per_head * cfg.num_heads != cfg.hidden_size:
            raise UserInputError(
                "GPT-2 format needs multi-head attention with head_dim = hidden_size / num_heads; "
                f"this model has num_kv_heads={cfg.kv_heads}, head_dim={cfg.dim_per_head} "
                "(set model.num_kv_heads: null and model.head_dim: null to train exportable GPTs)")
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len, "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.ffn_hidden_size,
            "activation_function": "gelu_new", "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.init_std,
            "scale_attn_weights": True, "tie_word_embeddings": cfg.tie_embeddings,
            "dtype": dtype_name, "torch_dtype": dtype_name,
        }
    scaling = None
    rope_parameters: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        scaling = {"rope_type": "llama3", "factor": s.factor,
                   "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                   "original_max_position_embeddings": s.original_max_seq_len}
        rope_parameters = {**scaling, "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_per_head, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": rope_parameters,
        "attention_bias": cfg.attn_bias, "attention_dropout": 0.0, "mlp_bias": False,
        "dtype": dtype_name, "torch_dtype": dtype_name,
    }


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
    """Rename (and for GPT-2 reshape) one HF tensor into giantmodel tensors.

    Returns [] for buffers that giantmodel recomputes; raises on unknown names.
    """
    if _IGNORED.search(name):
        return []
    if cfg.arch == "gpt":
        name = name.removeprefix("transformer.")
        top, layer_map = _GPT_TOP, _GPT_LAYER
    else:
        top, layer_map = _LLAMA_TOP, _LLAMA_LAYER
    if name in top:
        return [(top[name], tensor)]
    m = _LAYER_RE.match(name)
    if m is None:
        raise UserInputError(f"unexpected tensor {name!r} in a {cfg.arch} checkpoint")
    idx, module, leaf = m.groups()
    prefix = f"layers.{idx}."
    if cfg.arch == "gpt" and module == "attn.c_attn":
        # Conv1D stores [in, out]; c_attn's out dim is q|k|v.
        t = tensor.t() if leaf == "weight" else tensor
        q, k, v = t.split(cfg.hidden_size, dim=0)
        return [(f"{prefix}attention.{w}.{leaf}", x.contiguous())
                for w, x in (("wq", q), ("wk", k), ("wv", v))]
    if module not in layer_map:
        raise UserInputError(f"unexpected tensor {name!r} in a {cfg.arch} checkpoint")
    if cfg.arch == "gpt" and leaf == "weight" and module not in ("ln_1", "ln_2"):
        tensor = tensor.t().contiguous()
    return [(f"{prefix}{layer_map[module]}.{leaf}", tensor)]


def native_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """giantmodel full state dict -> HF state dict (tied heads omitted, as HF does)."""
    out: dict[str, torch.Tensor] = {}
    if cfg.arch == "gpt":
        inv_top = {v: "transformer." + k for k, v in _GPT_TOP.items()}
        inv_top["output.weight"] = "lm_head.weight"
        inv_layer = {v: k for k, v in _GPT_LAYER.items()}
        layer_prefix = "transformer.h"
    else:
        inv_top = {v: k for k, v in _LLAMA_TOP.items()}
        inv_layer = {v: k for k, v in _LLAMA_LAYER.items()}
        layer_prefix = "model.layers"
    native_re = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
    for name, t in state.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        if name in inv_top:
            out[inv_top[name]] = t
            continue
        m = native_re.match(name)
        if m is None:
            raise ValueError(f"unexpected parameter {name!r} for a {cfg.arch} model")
        idx, module, leaf = m.groups()
        if cfg.arch == "gpt" and module in ("attention.wq", "attention.wk", "attention.wv"):
            if module == "attention.wq":
                parts = [state[f"layers.{idx}.attention.{w}.{leaf}"] for w in ("wq", "wk", "wv")]
                packed = torch.cat(parts, dim=0)
                out[f"{layer_prefix}.{idx}.attn.c_attn.{leaf}"] = (
                    packed.t() if leaf == "weight" else packed)
            continue
        if module not in inv_layer:
            raise ValueError(f"unexpected parameter {name!r} for a {cfg.arch} model")
        if cfg.arch == "gpt" and leaf == "weight" and module not in ("attention_norm", "ffn_norm"):
            t = t.t()
        out[f"{layer_prefix}.{idx}.{inv_layer[module]}.{leaf}"] = t
    return out


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
    filled: set[int] = set()
    for hf_name, tensor in iter_hf_tensors(path):
        if hf_name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # the tied head is the embedding, filled below from it
        for name, full in hf_to_native(hf_name, tensor, cfg):
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


def _global_shape(p: torch.Tensor) -> torch.Size:
    from torch.distributed.tensor import DTensor
    return p.size() if isinstance(p, DTensor) else p.shape


def from_hf(path: str | os.PathLike, device: str | torch.device = "cpu",
            dtype: torch.dtype | None = None) -> nn.Module:
    """Load a HF LlamaForCausalLM or GPT2LMHeadModel directory as a giantmodel
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
