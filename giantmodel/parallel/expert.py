"""Expert parallelism: a plan, applied from outside, that splits every MoE
layer's routed experts over the ``ep`` ranks and moves tokens to them.

The MoE layer (:mod:`giantmodel.models.common.moe`) stays plain: it sorts
its (token, expert) assignments by expert and calls its experts module on
those rows with the per-expert counts. The plan changes only that call:

1. the stacked expert weights ``[E, in, out]`` become DTensors sharded on
   dim 0 over the ep mesh dimension (``Shard(0)``): rank r of the ep group
   holds experts ``[r * E/ep, (r+1) * E/ep)``, and DCP reshards them across
   ep degrees like any other DTensor;
2. dispatch: the rows, already sorted by global expert id, are contiguous per
   owner rank. Each rank first exchanges its per-expert counts (one small
   equal all-to-all), then the rows themselves with an all-to-all of uneven
   splits (:func:`~giantmodel.parallel.collectives.all_to_all_rows`);
3. the received rows (grouped by source rank, then by local expert) are
   regrouped by local expert and run by the local experts, on the same
   grouped-GEMM or per-expert path as one process;
4. combine: the outputs go back by the reverse regrouping and the reverse
   all-to-all, so the layer sees its rows in the order it sent them.

Autograd runs through both all-to-alls (each one's backward is the reverse
exchange), so the gradient of an expert's weights on its rank sums the rows
of every rank of its ep group. The ranks holding the same experts (``edp``)
then sum those over their tokens: the data-parallel strategy reduces expert
gradients over ``edp`` and every other gradient over dp x cp as before.

Experts are not split by tp (expert tensor parallelism of 1): each tp rank
holds its ep shard whole and dispatches its own, identical, tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from giantmodel.config.train import OptimConfig
from giantmodel.core.optim import build_adamw
from giantmodel.core.tensors import unique_params
from giantmodel.models.common.moe import GroupedExperts, gather_rows, moe_layers
from giantmodel.parallel.collectives import all_to_all_counts, all_to_all_rows
from giantmodel.parallel.zero import OwnZero

_EP_CLASSES: dict[type, type] = {}


def expert_modules(module: nn.Module) -> list[GroupedExperts]:
    """The routed-experts modules of a model chunk, in module order."""
    return [m.experts for m in moe_layers(module)]


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert weight split over ep (a DTensor on the
    expert mesh; FSDP2 adds its ``edp`` dimension in front)."""
    names = getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ()
    return "ep" in names


def apply_expert_parallel(module: nn.Module, ep_mesh) -> None:
    """Shard the experts of every MoE layer of ``module`` (on the meta
    device, before FSDP) over the 1-D ``ep_mesh`` and route tokens to them."""
    for experts in expert_modules(module):
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = _shard_rows(param, ep_mesh)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.ep_group = ep_mesh.get_group()
        experts.__class__ = _ep_class(type(experts))


def _shard_rows(param: torch.Tensor, ep_mesh) -> DTensor:
    """``param`` [E, ...] as a DTensor holding this rank's E/ep rows."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    rows = param.shape[0] // ep
    local = param.detach()[rank * rows:(rank + 1) * rows]
    return DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False,
                              shape=param.shape, stride=param.stride())


def _ep_class(cls: type) -> type:
    """``cls`` with the dispatch/combine forward (one subclass per class, as
    FSDP2 does, so parameter names and isinstance checks are unchanged)."""
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (_ExpertParallel, cls), {})
    return _EP_CLASSES[cls]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _ExpertParallel:
    """The forward of an expert-parallel experts module (module docstring)."""

    ep_group: object

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` [M, hidden] sorted by global expert, ``counts`` [E] (or
        [E + 1]: trailing dropped rows, whose output is undefined)."""
        weights = tuple(_local(w) for w in (self.w1, self.w3, self.w2))
        num_experts, local_experts = self.w1.shape[0], weights[0].shape[0]  # global, this rank's
        routed = counts[:num_experts]
        ep = num_experts // local_experts
        # [ep, E/ep]: sent[r, j] rows for expert j of rank r, and received[s, j]
        # rows from rank s for this rank's expert j
        sent = routed.view(ep, local_experts)
        received = all_to_all_counts(sent, self.ep_group)
        # The all-to-all needs its split sizes on the host: one copy (one
        # stream sync on a GPU) for every size this layer needs.
        host = torch.cat([sent.sum(dim=1), received.sum(dim=1)]).tolist()
        send_splits, recv_splits = host[:ep], host[ep:]
        n_routed = sum(send_splits)
        rows = all_to_all_rows(x[:n_routed], recv_splits, send_splits, self.ep_group)
        order = _by_local_expert(received, sum(recv_splits))
        back = torch.empty_like(order).scatter_(0, order, torch.arange(
            order.numel(), device=order.device))
        y = super().forward(gather_rows(rows, order, back), received.sum(dim=0),
                            weights=weights)
        if y.shape[0] == 0:
            # No rows here: keep the weights in the graph so every rank of edp
            # gets a (zero) gradient and their reductions match.
            y = y + sum(w.sum() for w in weights) * 0.0
        out = all_to_all_rows(gather_rows(y, back, order), send_splits, recv_splits,
                              self.ep_group)
        if out.shape[0] < x.shape[0]:  # dropped rows: undefined, never read
            out = torch.cat([out, out.new_zeros(x.shape[0] - out.shape[0], *out.shape[1:])])
        return out


def _by_local_expert(received: torch.Tensor, total: int) -> torch.Tensor:
    """Row indices that regroup rows received as blocks (source s, local
    expert j), s-major, into j-major blocks (all of expert 0's rows, sources
    in rank order, then expert 1's, ...). ``received`` [ep, E/ep] counts,
    ``total`` their sum (known on the host)."""
    ep, local = received.shape
    sizes = received.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    blocks = torch.arange(ep * local, device=sizes.device).view(ep, local).t().reshape(-1)
    sizes_t, starts_t = sizes[blocks], starts[blocks]
    offset = torch.repeat_interleave(starts_t - (torch.cumsum(sizes_t, 0) - sizes_t), sizes_t,
                                     output_size=total)
    return torch.arange(total, device=sizes.device) + offset


class ExpertDataParallel:
    """ZeRO 0/1/2 on flat buffers for a model with expert-parallel layers:
    one :class:`~giantmodel.parallel.zero.OwnZero` over dp x cp for every
    weight but the experts, one over edp for the experts. Each rank's loss
    is already scaled by 1/(global tokens), so plain sums over each group
    give the gradient of the global mean: an expert's tokens from every rank
    reached it either through the all-to-all (its ep group) or through the
    edp sum (the other ep groups). One optimizer steps both sets."""

    def __init__(self, dims, *, zero: int, bucket_bytes: int, overlap: bool):
        kw = {"zero": zero, "bucket_bytes": bucket_bytes, "overlap": overlap}
        self.dense = OwnZero(dims, group=dims.group("dp_cp"),
                             select=lambda p: not is_expert_parameter(p), **kw)
        self.experts = OwnZero(dims, group=dims.group("edp"), select=is_expert_parameter, **kw)
        self.parts: list[nn.Module] = []

    @property
    def _both(self) -> tuple[OwnZero, OwnZero]:
        return self.dense, self.experts

    def wrap(self, module, blocks, edge_units) -> None:
        return None

    def attach(self, parts: list[nn.Module]) -> None:
        self.parts = parts
        for s in self._both:
            s.attach(parts)

    def before_backward(self, last_microbatch: bool) -> None:
        for s in self._both:
            s.before_backward(last_microbatch)

    def finish(self) -> None:
        for s in self._both:
            s.finish()

    def build_optimizer(self, optim_cfg: OptimConfig, device_type: str) -> torch.optim.Optimizer:
        # registration order, as without ep, so optimizer state lines up across layouts
        owned = {id(p) for s in self._both for p in s.owned_params()}
        return build_adamw([p for p in unique_params(self.parts) if id(p) in owned],
                           optim_cfg, device_type)

    def after_step(self) -> None:
        for s in self._both:
            s.after_step()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        for s in self._both:
            s.zero_grad(optimizer)

    def norm_terms(self) -> list[tuple[torch.Tensor, int]]:
        return self.dense.norm_terms() + self.experts.norm_terms()
