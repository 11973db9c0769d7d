"""Low-rank adapters (LoRA, Hu et al. 2021) as plain modules, and their
Hugging Face / PEFT weight formats.

A :class:`LoRALinear` replaces an ``nn.Linear`` of a transformer block and
keeps its ``weight`` and ``bias`` under the same names, so the frozen base
loads from (and exports to) any checkpoint exactly as the plain model's; the
adapter adds ``lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r]:

    y = x W^T + b + ((alpha / r) * dropout(x) A^T) B^T

``A`` starts Kaiming-uniform (PEFT's default) or Gaussian (std 1/r), ``B`` at
zero, so training starts from the base model's function. Adapter names
follow PEFT's (``...q_proj.lora_A.weight``), which is what makes
``--to peft`` a pure renaming. Nothing here knows about torch.distributed:
tensor parallelism shards these modules from outside (the LoRA objective).
"""

from __future__ import annotations

import contextlib
import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig
from giantmodel.models.families.base import NameMap
from giantmodel.models.families.llama import LLAMA_NAMES
from giantmodel.models.hf import _LLAMA_LAYER

# HF LLaMA module names -> giantmodel names inside a block.
HF_TARGETS = {"q_proj": "attention.wq", "k_proj": "attention.wk", "v_proj": "attention.wv",
              "o_proj": "attention.wo", "gate_proj": "feed_forward.w1",
              "up_proj": "feed_forward.w3", "down_proj": "feed_forward.w2"}
NATIVE_TARGETS = {"wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv",
                  "wo": "attention.wo", "w1": "feed_forward.w1", "w2": "feed_forward.w2",
                  "w3": "feed_forward.w3"}
ALL_LINEAR = ("all_linear", "all-linear")


class LoRALinear(nn.Module):
    """``nn.Linear`` plus a rank-``r`` update; ``weight``/``bias`` are the base's."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float,
                 dropout: float = 0.0, bias: bool = False, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.lora_A = nn.Linear(in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, out_features, bias=False, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank

    @classmethod
    def from_linear(cls, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0
                    ) -> LoRALinear:
        """Wrap ``base`` keeping its parameter objects (meta or real)."""
        m = cls(base.in_features, base.out_features, rank, alpha, dropout,
                bias=base.bias is not None, device=base.weight.device, dtype=base.weight.dtype)
        m.weight = base.weight
        m.bias = base.bias
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self.weight, "get_original_weight"):  # QLoRA: a torchao NF4 base
            # Function-local import: torchao is optional and only NF4 bases need it.
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

            out = linear_nf4(x, self.weight)
            out = out + self.bias if self.bias is not None else out
        else:
            out = F.linear(x, self.weight, self.bias)
        # A bf16 frozen base (QLoRA / LoRA under bf16 training) hands fp32
        # adapters bf16 inputs; autocast casts them itself, plain calls
        # (the sample printed after training) need the cast here.
        a_dtype = self.lora_A.weight.dtype
        if x.dtype != a_dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(a_dtype)
        # Scale the rank-r activations, not the output: B (s A x) = s B A x,
        # and the multiply (forward and backward) touches r columns, not out.
        delta = self.lora_B(self.lora_A(self.lora_dropout(x)) * self.scaling)
        # Out of place: selective recompute caches the matmul's output and
        # replays it in backward, so adding into it in place counted the
        # adapter twice there (wrong gradients with no bias; an error with one).
        # The sum is transient: add's backward keeps neither operand.
        return out + delta

    def base_weight(self) -> torch.Tensor:
        """The base weight in floating point (dequantised when NF4)."""
        w = self.weight
        return w.get_original_weight() if hasattr(w, "get_original_weight") else w

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha/r) B A, the weight of the equivalent plain linear."""
        return self.base_weight() + (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, alpha={self.alpha}")


def block_targets(targets: list[str], arch: str) -> list[str]:
    """Module paths inside a block that ``targets`` name (HF names, giantmodel
    names, or all_linear); raises ValueError naming what matches nothing."""
    paths: list[str] = []
    available = dict(NATIVE_TARGETS)
    hf = dict(HF_TARGETS)
    if arch == "gpt":  # GeluMLP has no w3 (no up_proj)
        available.pop("w3")
        hf.pop("up_proj")
    for t in targets:
        if t in ALL_LINEAR:
            found = list(available.values())
        elif t in hf:
            found = [hf[t]]
        elif t in available:
            found = [available[t]]
        else:
            raise ValueError(f"LoRA target {t!r} matches no module of a {arch} block; use "
                             f"{', '.join(hf)}, {', '.join(available)} or all_linear")
        paths += [p for p in found if p not in paths]
    return paths


def apply_lora(model: nn.Module, targets: list[str], rank: int, alpha: float,
               dropout: float = 0.0, arch: str = "llama") -> list[str]:
    """Replace every targeted linear of every block of ``model`` (a whole model
    or a pipeline stage, on any device) by a :class:`LoRALinear`. Returns the
    full dotted names of the replaced modules."""
    done = []
    for idx, block in model.layers.items():
        for path in block_targets(targets, arch):
            parent_path, leaf = path.rsplit(".", 1)
            try:
                parent = block.get_submodule(parent_path)
            except AttributeError:
                parent = None
            base = getattr(parent, leaf, None)
            # An MoE block's routed experts are stacked 3-D weights and an MLA
            # block has no wq/wk/wv: those blocks keep such targets unadapted.
            if not isinstance(base, nn.Linear):
                continue
            setattr(parent, leaf, LoRALinear.from_linear(base, rank, alpha, dropout))
            done.append(f"layers.{idx}.{path}")
    if not done and model.layers:
        raise ValueError(f"LoRA targets {targets} match no linear of this model's blocks "
                         "(routed experts cannot take adapters; name attention projections "
                         "or dense feed-forward linears, or use all_linear)")
    return done


NF4_BLOCK = 64 * 256
"""A weight is stored in NF4 when its size is a multiple of this (64-value
blocks, scales double-quantised in blocks of 256)."""


def nf4_quantizable(m: nn.Module) -> bool:
    """Whether ``m`` is a LoRA linear whose float base weight NF4 can hold."""
    return (isinstance(m, LoRALinear) and not hasattr(m.weight, "get_original_weight")
            and m.weight.numel() % NF4_BLOCK == 0)


def quantize_base_nf4(model: nn.Module, device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None) -> int:
    """QLoRA: store every adapted linear's frozen base weight as a 4-bit
    NormalFloat tensor (torchao; blocks of 64 values, double-quantised
    scales). A weight whose size is not a multiple of 64 x 256 values (the
    scale blocks) stays in floating point. Returns the number quantised.

    One linear at a time, the float weight is copied to ``device`` (default:
    where it is) in ``dtype`` (default: its own; the NF4 tensor dequantises
    to it), quantised there and dropped: a base staged on the CPU reaches the
    GPU as 4-bit weights plus at most one float linear."""
    try:
        # Function-local import: torchao is an optional dependency of QLoRA only.
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        raise UserInputError("lora.quantize_base=nf4 needs torchao (pip install torchao); "
                             "or set lora.quantize_base=none") from None
    n = 0
    for m in model.modules():
        if nf4_quantizable(m):
            w = m.weight.detach().to(device or m.weight.device, dtype or m.weight.dtype)
            m.weight = nn.Parameter(to_nf4(w), requires_grad=False)
            del w
            n += 1
    return n


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Inside, every :class:`LoRALinear` of ``model`` computes its base alone:
    the function of the model before fine-tuning, with no second copy (the
    DPO reference). The adapters' scale is zeroed, so the update adds an
    exact zero (no branch in ``forward`` for compiled blocks to trace)."""
    adapted = [m for m in model.modules() if isinstance(m, LoRALinear)]
    saved = [m.scaling for m in adapted]
    for m in adapted:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in zip(adapted, saved, strict=True):
            m.scaling = scaling


def is_lora_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def freeze_base(model: nn.Module) -> None:
    """Only adapter weights train."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_param(name))


def lora_init_tensor(name: str, shape, init: str, seed: int) -> torch.Tensor:
    """The full initial value of adapter parameter ``name``: B zero; A
    Kaiming-uniform (bound 1/sqrt(in), as nn.Linear and PEFT) or Gaussian
    (std 1/r), drawn from a generator seeded by the name so every layout
    starts from the same adapters."""
    shape = tuple(shape)
    if ".lora_B." in name:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    rank, fan_in = shape
    if init == "gaussian":
        return torch.empty(shape).normal_(0.0, 1.0 / rank, generator=gen)
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


# --------------------------------------------------------------------------- formats

def _module_of(name: str) -> tuple[str, str]:
    """``layers.3.attention.wq.lora_A.weight`` -> (``layers.3.attention.wq``, ``lora_A``)."""
    head, which, _ = name.rsplit(".", 2)
    return head, which


def merge_lora_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A plain model's state: every adapted ``W`` becomes ``W + scaling * B A``
    (in fp32, cast back) and the adapter tensors are dropped."""
    out = {k: v for k, v in state.items() if not is_lora_param(k)}
    for name, a in state.items():
        if ".lora_A." not in name:
            continue
        module, _ = _module_of(name)
        b = state[f"{module}.lora_B.weight"]
        w = out[f"{module}.weight"]
        out[f"{module}.weight"] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return out


def to_peft_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors under the names PEFT saves for a LlamaForCausalLM
    (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``)."""
    return peft_state(state, LLAMA_NAMES, None)[0]


def from_peft_state(peft: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_peft_state` (PEFT's ``.default`` adapter name allowed)."""
    out = {}
    for name, t in peft.items():
        core = name.removeprefix("base_model.model.model.").replace(".default", "")
        _, idx, rest = core.split(".", 2)
        path, which, _ = rest.rsplit(".", 2)
        if path not in _LLAMA_LAYER or which not in ("lora_A", "lora_B"):
            raise ValueError(f"unexpected PEFT tensor {name!r}")
        out[f"layers.{idx}.{_LLAMA_LAYER[path]}.{which}.weight"] = t
    return out


def peft_state(state: dict[str, torch.Tensor], names: NameMap, cfg: ModelConfig | None,
               family: str = "llama") -> tuple[dict[str, torch.Tensor], dict[tuple[int, str], int]]:
    """Adapter tensors under the names PEFT saves for the family's HF model
    (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``),
    through its :class:`NameMap`; and, per (layer, HF module), how many
    adapters it combines.

    A fused HF module (Phi-3's ``qkv_proj``) packs several adapted linears:
    their adapters become one exact LoRA of rank k*r on it, A the k A's
    stacked [k*r, in] and B block-diagonal [out, k*r] (zero rows where a
    part is not adapted), so B A x is each part's own update in its rows.
    Its scaling must stay alpha / r: :func:`peft_adapter_config` gives it
    r and lora_alpha both times k."""
    hf_of = {v: k for k, v in names.layer.items()}
    fused_of = {part: hf for hf, f in names.fused.items() for part in f.parts}
    prefix = f"base_model.model.{names.base}{names.layers}"
    out: dict[str, torch.Tensor] = {}
    combined: dict[tuple[int, str], int] = {}
    pending: dict[tuple[int, str], dict[str, tuple]] = {}
    for name, a in state.items():
        if ".lora_A." not in name:
            continue
        module, _ = _module_of(name)
        _, idx, path = module.split(".", 2)
        b = state[f"{module}.lora_B.weight"]
        if path in hf_of:
            key = f"{prefix}.{idx}.{hf_of[path]}"
            out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = a, b
            combined[(int(idx), hf_of[path])] = 1
        elif path in fused_of and cfg is not None:
            pending.setdefault((int(idx), fused_of[path]), {})[path] = (a, b)
        else:
            raise UserInputError(f"--to peft: {family} has no Hugging Face module for the "
                                 f"adapted {module}; use --to hf --merge-lora")
    for (idx, hf), parts in pending.items():
        fused = names.fused[hf]
        a, b = _fused_adapter(fused.parts, fused.sizes(cfg), parts)
        key = f"{prefix}.{idx}.{hf}"
        out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = a, b
        combined[(idx, hf)] = len(parts)
    return out, combined


def _fused_adapter(order: tuple[str, ...], sizes: tuple[int, ...],
                   parts: dict[str, tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [k*r, in], B [sum(sizes), k*r]) of the adapted ``parts`` of a fused
    module whose rows are ``order`` with ``sizes``: B's block j is part j's
    B in that part's rows, so (B A) restricted to a part is its own B A."""
    present = [p for p in order if p in parts]
    a = torch.cat([parts[p][0] for p in present])
    r = parts[present[0]][0].shape[0]
    ref = parts[present[0]][1]
    b = ref.new_zeros(sum(sizes), r * len(present))
    row, col = 0, 0
    for p, size in zip(order, sizes, strict=True):
        if p in parts:
            pb = parts[p][1]
            if pb.shape != (size, r):
                raise ValueError(f"{p}'s lora_B is {tuple(pb.shape)}, expected {(size, r)}")
            b[row:row + size, col:col + r] = pb
            col += r
        row += size
    return a, b


def peft_adapter_config(modules: list[str], rank: int, alpha: float, dropout: float,
                        base_model: str | None, *,
                        combined: dict[tuple[int, str], int] | None = None,
                        names: NameMap = LLAMA_NAMES) -> dict:
    """``adapter_config.json`` naming the HF ``modules`` (paths inside a
    layer) that hold adapters: by their last name where no other layer
    module shares it, else by the path. A module combining k adapters
    (:func:`peft_state`) gets rank k*r and lora_alpha k*alpha in
    ``rank_pattern`` / ``alpha_pattern``: the same alpha / r scaling."""
    known = [*names.layer, *names.fused]
    short = {m: m.rsplit(".", 1)[-1] for m in modules}
    targets = sorted(short[m] if sum(k.rsplit(".", 1)[-1] == short[m] for k in known) == 1
                     else m for m in modules)
    rank_pattern, alpha_pattern = {}, {}
    by_module: dict[str, set[int]] = {}
    for (_, hf), k in (combined or {}).items():
        by_module.setdefault(hf, set()).add(k)
    for (idx, hf), k in (combined or {}).items():
        if by_module[hf] == {1}:
            continue
        # one key per module where every layer combines the same parts
        key = hf if len(by_module[hf]) == 1 else f"{names.layers}.{idx}.{hf}"
        rank_pattern[key], alpha_pattern[key] = k * rank, k * alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": dropout, "target_modules": targets, "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern, "bias": "none",
        # HF Conv1D (GPT-2) weights are [in, out]; the adapters are not
        "fan_in_fan_out": any(m in names.transposed for m in modules),
        "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": None, "base_model_name_or_path": base_model,
        "revision": None,
    }


def save_peft_adapter(state: dict[str, torch.Tensor], out_dir, *, targets: list[str] | None = None,
                      rank: int, alpha: float, dropout: float = 0.0,
                      base_model: str | None = None, dtype: torch.dtype | None = None,
                      names: NameMap = LLAMA_NAMES, cfg: ModelConfig | None = None,
                      family: str = "llama") -> list:
    """Write a PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) from a state holding a family's adapters
    (``names``: its HF names; ``cfg``: the model's shape, needed where a
    fused HF module combines adapters). ``adapter_config.json`` names the
    modules that hold adapters, which ``targets`` (the run's lora.targets)
    chose."""
    del targets  # the state says which modules were adapted
    out = Path(out_dir)
    if (out / "adapter_model.safetensors").exists():
        raise UserInputError(f"{out} already holds an adapter; export into an empty directory")
    tensors, combined = peft_state(state, names, cfg, family)
    tensors = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in tensors.items()}
    if not tensors:
        raise UserInputError("the checkpoint holds no LoRA adapters (was it trained with "
                             "objective: lora?)")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    modules = sorted({hf for _, hf in combined})
    cfg_json = peft_adapter_config(modules, rank, alpha, dropout, base_model, combined=combined,
                                   names=names)
    (out / "adapter_config.json").write_text(json.dumps(cfg_json, indent=2))
    return [out / "adapter_model.safetensors", out / "adapter_config.json"]
