"""The model's parameters as the planner counts them: each parameter's
shape and how tensor and expert parallelism split it (``Param``), one
block's (and an MoE model's dense block's) parameters from the model built
on the meta device (``ParamTable``, cached by the model's shape fields), and
the parameters of a pipeline stage in the order it registers them. The
memory model (:mod:`giantmodel.planner.memory`) counts model states and
buffers from these; the time model the gradients to reduce."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass

from giantmodel.models import build_model
from giantmodel.planner.moe import (
    dense_layer_config,
    expert_numel,
    inactive_params,
    is_expert,
    layer_counts,
    sparse_layer_config,
)


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    """Dimension split by tensor parallelism (None: replicated)."""
    expert: bool = False
    """A routed expert's stacked weight: dim 0 (the experts) split by ep, never by tp."""

    def local_shape(self, tp: int, ep: int = 1) -> tuple[int, ...]:
        if self.expert:
            return (self.shape[0] // ep,) + self.shape[1:]
        if self.tp_dim is None or tp == 1:
            return self.shape
        s = list(self.shape)
        s[self.tp_dim] //= tp
        return tuple(s)


def _tp_dim(name: str) -> int | None:
    """How the project's TP plan splits each parameter: column-parallel q/k/v,
    w1/w3 (weights and biases on dim 0), row-parallel wo/w2 (weights on dim 1,
    biases replicated), vocab-parallel embedding and head; norms, learned
    positions and an MoE layer's shared experts replicated."""
    leaf = name.rsplit(".", 2)
    if ".shared_experts" in name:   # an MoE layer runs whole on every tp rank (parallel.tensor)
        return None
    if name.startswith(("tok_embeddings", "output")):
        return 0
    if len(leaf) >= 2 and leaf[-2] in ("wq", "wk", "wv", "w1", "w3"):
        return 0
    if len(leaf) >= 2 and leaf[-2] in ("wo", "w2"):
        return 1 if leaf[-1] == "weight" else None
    return None


@dataclass(frozen=True)
class ParamTable:
    embed: tuple[Param, ...]
    layer: tuple[Param, ...]
    final: tuple[Param, ...]
    head: tuple[Param, ...]
    tied: bool
    dense_layer: tuple[Param, ...] = ()
    """An MoE model's dense block (``layer`` is its MoE block); empty otherwise."""
    sparse: tuple[bool, ...] = ()
    """An MoE model's blocks in order, whether each is an MoE block; empty otherwise."""

    def block(self, index: int) -> tuple[Param, ...]:
        """The parameters of global block ``index``, as its kind."""
        return self.dense_layer if self.sparse and not self.sparse[index] else self.layer

    def layer_numel(self, tp: int = 1, ep: int = 1) -> int:
        return _numel_cached(self, tp, False, ep)

    def layer_linear_numel(self, tp: int = 1, ep: int = 1) -> int:
        return _numel_cached(self, tp, True, ep)

    def dense_layer_numel(self, tp: int = 1) -> int:
        """Local parameters of the dense block (an MoE model's; 0 otherwise)."""
        return _numel_cached(self, tp, False, 1, dense=True)

    def head_linear_numel(self, tp: int = 1) -> int:
        head = self.head or tuple(p for p in self.embed if p.name.startswith("tok_"))
        return sum(math.prod(p.local_shape(tp)) for p in head)


@functools.lru_cache(maxsize=4096)
def _numel_cached(table: ParamTable, tp: int, linear_only: bool, ep: int = 1,
                  dense: bool = False) -> int:
    return sum(math.prod(p.local_shape(tp, ep)) for p in (table.dense_layer if dense
                                                          else table.layer)
               if not linear_only or _is_linear(p.name))


# Linears autocast casts (MLA's projections among them); routed experts'
# stacked weights are cast by their GEMMs alike. The router computes in fp32.
_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "wq_a", "wq_b", "wkv_a", "wkv_b")


def _is_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and (parts[-2] in _LINEARS or is_expert(name))


def linear_numel(params) -> int:
    """Matmul weights (no biases) among ``params``: what 6 N counts."""
    return sum(math.prod(p.shape) for p in params
               if _is_linear(p.name) and not p.name.endswith("bias"))


_NOT_SHAPE = ("name", "family", "init_std", "norm_eps", "rope_theta", "rope_scaling")


@functools.cache
def _shape_fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in _NOT_SHAPE)


_PLAIN = (int, float, str, bool, type(None))


def _model_key(m) -> tuple:
    # every field that may change a parameter's shape or a saved tensor (new
    # family fields included without listing them); nested configs by repr.
    # A search asks for it hundreds of thousands of times: the field names
    # are listed once per class.
    return tuple(v if isinstance(v, _PLAIN) else repr(v)
                 for v in (getattr(m, name) for name in _shape_fields(type(m))))


_TABLES: dict[tuple, ParamTable] = {}


def _param_table(key: tuple, model_cfg_obj) -> ParamTable:

    if key in _TABLES:
        return _TABLES[key]

    moe = model_cfg_obj.moe is not None
    # an MoE model's table holds its MoE block; its dense blocks apart
    one = sparse_layer_config(model_cfg_obj) if moe else copy.copy(model_cfg_obj)
    one.num_layers = 1
    groups = _named_params(one)
    dense = ()
    if moe and layer_counts(model_cfg_obj)[0]:
        plain = dense_layer_config(one)
        dense = tuple(_named_params(plain)["layer"])
    sparse = tuple(model_cfg_obj.moe.is_sparse(i) for i in range(model_cfg_obj.num_layers)) \
        if moe else ()
    table = ParamTable(*(tuple(groups[k]) for k in ("embed", "layer", "final", "head")),
                       tied=model_cfg_obj.tie_embeddings, dense_layer=dense, sparse=sparse)
    _TABLES[key] = table
    return table


def _named_params(one) -> dict[str, list[Param]]:
    """A one-block model's parameters on the meta device, by part."""
    model = build_model(one, device="meta")
    groups: dict[str, list[Param]] = {"embed": [], "layer": [], "final": [], "head": []}
    for name, p in model.named_parameters():  # tied head weight appears once
        prm = Param(name, tuple(p.shape), _tp_dim(name), is_expert(name))
        if name.startswith(("tok_embeddings", "pos_embeddings")):
            groups["embed"].append(prm)
        elif name.startswith("layers."):
            groups["layer"].append(Param(name.split(".", 2)[2], prm.shape, prm.tp_dim,
                                         prm.expert))
        elif name.startswith("norm"):
            groups["final"].append(prm)
        else:
            groups["head"].append(prm)
    return groups


def param_table(model_cfg) -> ParamTable:
    """Per-layer and per-component parameter shapes of the model (exact)."""
    return _param_table(_model_key(model_cfg), model_cfg)


def model_param_count(m) -> int:
    """Parameters of the whole model, from the table (a tied head once)."""
    t = param_table(m)
    dense, sparse = layer_counts(m)
    if not sparse:
        return sum(math.prod(p.shape) for p in t.embed + t.final + t.head) \
            + m.num_layers * t.layer_numel(1)
    return sum(math.prod(p.shape) for p in t.embed + t.final + t.head) \
        + sparse * t.layer_numel(1) + dense * sum(math.prod(p.shape) for p in t.dense_layer)


def active_matmul_params(m) -> float:
    """Matmul weights (no biases) a token runs through in all blocks: each
    MoE block's router, shared experts, attention and top_k routed experts,
    and the dense blocks whole. For a dense model, L x one block's."""
    table = param_table(m)
    dense, sparse = layer_counts(m)
    if not sparse:
        return m.num_layers * linear_numel(table.layer)
    routed = m.moe.top_k * expert_numel(m)
    moe_layer = linear_numel([p for p in table.layer if not p.expert]) + routed
    router = sum(math.prod(p.shape) for p in table.layer if p.name.endswith("router.gate.weight"))
    return sparse * (moe_layer + router) + dense * linear_numel(table.dense_layer)


def model_active_param_count(m) -> int:
    """Parameters one token runs through: the total less the routed experts
    it is not sent to (E - top_k per MoE block); the total for a dense model."""
    return model_param_count(m) - inactive_params(m)


def stage_param_list(table: ParamTable, stage: int, num_stages: int, n_layers: int,
                     m=None, stage_layers: tuple[int, ...] | None = None
                     ) -> list[tuple[Param, bool]]:
    """Every parameter on one pipeline stage, in the order the stage
    registers them, with whether it is a block's. With ``stage_layers``
    (every stage's block count) the stage's blocks are its own, each as its
    kind, dense or MoE (``ParamTable.block``; ``m`` is not needed);
    without them, ``n_layers`` blocks of ``table.layer`` (exact for a dense model)."""
    out = [(p, False) for p in table.embed] if stage == 0 else []
    if stage_layers is not None:
        start = sum(stage_layers[:stage])
        out += [(p, True) for i in range(start, start + stage_layers[stage])
                for p in table.block(i)]
    else:
        out += [(p, True) for _ in range(n_layers) for p in table.layer]
    if stage == num_stages - 1:
        out += [(p, False) for p in table.final + table.head]
        if table.tied and num_stages > 1:
            # the last stage holds its own copy of the tied embedding
            out += [(p, False) for p in table.embed if p.name.startswith("tok_")]
    return out


def stage_params(table: ParamTable, stage: int, num_stages: int, n_layers: int,
                 tp: int, ep: int = 1, experts: bool | None = None, m=None,
                 stage_layers: tuple[int, ...] | None = None) -> list[tuple[int, ...]]:
    """Local (post-TP, post-EP) shapes of every parameter on one pipeline
    stage; ``experts``: only the routed experts' (True) or only the others'
    (False); ``m``, ``stage_layers``: as in :func:`stage_param_list`."""
    return [p.local_shape(tp, ep) for p, _ in stage_param_list(table, stage, num_stages, n_layers,
                                                                m, stage_layers)
            if experts is None or p.expert == experts]
