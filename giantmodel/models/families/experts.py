"""Routed experts between Hugging Face layouts and giantmodel's stacked ones.

giantmodel keeps a layer's experts stacked, ``feed_forward.experts.w1`` /
``w3`` [E, hidden, ffn] and ``w2`` [E, ffn, hidden] ([E, in, out]). HF
checkpoints come in two layouts, both read here:

* per expert (transformers 4.x, and what 5.x's ``save_pretrained`` writes by
  default): ``{moe}.experts.{e}.{gate}.weight`` [ffn, hidden], ``{up}`` the
  same, ``{down}`` [hidden, ffn]; the names are Mixtral's ``w1/w3/w2`` under
  ``block_sparse_moe`` or Qwen/DeepSeek's ``gate_proj/up_proj/down_proj``
  under ``mlp``;
* stacked (transformers 5.x's in-memory layout, written with
  ``save_original_format=False``): ``mlp.experts.gate_up_proj``
  [E, 2*ffn, hidden] (gate rows first) and ``mlp.experts.down_proj``
  [E, hidden, ffn].

Writing uses the per-expert layout, which both transformers generations load.
A per-expert tensor is one slice of a stacked parameter, while the loader
fills whole parameters from one conversion call at a time; the slices are
held here until a layer's E are all read (checkpoints keep a layer's experts
together, so this holds about one layer's experts at a time).
"""

from __future__ import annotations

import re

import torch

from giantmodel.config.errors import UserInputError

NATIVE = "feed_forward.experts"
ROUTER = "feed_forward.router"


class ExpertLayout:
    """The HF names of one family's routed experts and router bias."""

    def __init__(self, moe: str, gate: str, up: str, down: str,
                 bias: str | None = None):
        self.moe = moe
        """HF module of the MoE block inside a layer: 'block_sparse_moe' or 'mlp'."""
        self.hf_of = {"w1": gate, "w3": up, "w2": down}
        self.native_of = {gate: "w1", up: "w3", down: "w2"}
        self.bias = bias
        """HF leaf of the router's correction bias under ``{moe}.gate`` (DeepSeek's
        'e_score_correction_bias'), or None."""
        names = "|".join(re.escape(n) for n in (gate, up, down))
        moes = "|".join(re.escape(n) for n in dict.fromkeys((moe, "mlp")))
        self._per_expert = re.compile(rf"^(\d+)\.(?:{moes})\.experts\.(\d+)\.({names})\.weight$")
        self._stacked = re.compile(rf"^(\d+)\.(?:{moes})\.experts\.(gate_up_proj|down_proj)$")
        self._bias = re.compile(rf"^(\d+)\.(?:{moes})\.gate\.{re.escape(bias)}$") if bias else None
        self._pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}

    def to_native(self, rest: str, tensor: torch.Tensor,
                  num_experts: int) -> list[tuple[str, torch.Tensor]] | None:
        """``rest`` is a HF name after ``{layers}.``; the giantmodel tensors
        it completes (maybe none yet), or None when it is not an expert
        tensor."""
        m = self._per_expert.match(rest)
        if m is not None:
            idx, e, proj = m.groups()
            key = (idx, self.native_of[proj])
            got = self._pending.setdefault(key, {})
            got[int(e)] = tensor
            if any(i not in got for i in range(num_experts)):
                return []
            del self._pending[key]
            # HF per-expert weights are [out, in]; stacked is [E, in, out].
            stacked = torch.stack([got[i].t() for i in range(num_experts)])
            return [(f"layers.{idx}.{NATIVE}.{key[1]}", stacked.contiguous())]
        m = self._stacked.match(rest)
        if m is not None:
            idx, proj = m.groups()
            if proj == "down_proj":  # [E, hidden, ffn] -> [E, ffn, hidden]
                return [(f"layers.{idx}.{NATIVE}.w2", tensor.transpose(1, 2).contiguous())]
            gate, up = tensor.chunk(2, dim=1)  # [E, 2*ffn, hidden], gate rows first
            return [(f"layers.{idx}.{NATIVE}.w1", gate.transpose(1, 2).contiguous()),
                    (f"layers.{idx}.{NATIVE}.w3", up.transpose(1, 2).contiguous())]
        if self._bias is not None:
            m = self._bias.match(rest)
            if m is not None:
                return [(f"layers.{m.group(1)}.{ROUTER}.expert_bias", tensor)]
        return None

    def split_state(self, state: dict[str, torch.Tensor]
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(what the NameMap writes, the experts and router biases), by native name."""
        plain, moe = {}, {}
        for name, t in state.items():
            is_moe = f".{NATIVE}." in name or name.endswith(f".{ROUTER}.expert_bias")
            (moe if is_moe else plain)[name] = t
        return plain, moe

    def to_hf(self, moe_state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        """Native expert tensors and router biases -> per-expert HF tensors;
        ``prefix`` is the HF name of the layer list with its dot ('model.layers.')."""
        out = {}
        for name, t in moe_state.items():
            idx = name.split(".")[1]
            if name.endswith("expert_bias"):
                if self.bias is None:
                    raise ValueError(f"{name}: this format has no router bias")
                out[f"{prefix}{idx}.{self.moe}.gate.{self.bias}"] = t
                continue
            which = name.rsplit(".", 1)[1]
            for e in range(t.shape[0]):
                out[f"{prefix}{idx}.{self.moe}.experts.{e}.{self.hf_of[which]}.weight"] = \
                    t[e].t().contiguous()
        return out


class StackedExperts:
    """Mixin for a :class:`~giantmodel.models.families.base.Family` with MoE
    layers: expert tensors go through ``self.experts`` (an
    :class:`ExpertLayout`), everything else (router, shared experts, dense
    layers) through the family's NameMap. Listed before the Family base."""

    experts: ExpertLayout

    def to_native(self, name: str, tensor: torch.Tensor, cfg) -> list[tuple[str, torch.Tensor]]:
        nm = self.names
        short = name.removeprefix(nm.base)
        if cfg.moe is not None and short.startswith(nm.layers + "."):
            got = self.experts.to_native(short[len(nm.layers) + 1:], tensor, cfg.moe.num_experts)
            if got is not None:
                return got
        return super().to_native(name, tensor, cfg)

    def to_hf(self, state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
        plain, moe = self.experts.split_state(state)
        out = super().to_hf(plain, cfg)
        out.update(self.experts.to_hf(moe, f"{self.names.base}{self.names.layers}."))
        return out

    def refuse_moe(self, cfg, **expected) -> None:
        """Like ``Family.refuse``, for ``model.moe.<key>`` (which must be set)."""
        if cfg.moe is None:
            raise UserInputError(f"the {self.name} format needs MoE layers (model.moe); "
                                 "use a dense family for a dense model")
        for key, want in expected.items():
            have = getattr(cfg.moe, key)
            if have != want:
                raise UserInputError(
                    f"model.moe.{key}={have!r} cannot be written in the {self.name} format "
                    f"(it needs {want!r}); set model.family to a family that has it "
                    f"(giantmodel.models.families.supported())")

    def refuse_rope(self, cfg, *types: str) -> None:
        """RoPE scaling must be none or one of ``types`` (what config_to_hf writes)."""
        s = cfg.rope_scaling
        if s is not None and s.type not in types:
            raise UserInputError(f"model.rope_scaling.type={s.type!r} cannot be written in the "
                                 f"{self.name} format (it needs none or {', '.join(types)})")
