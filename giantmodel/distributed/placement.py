"""Bandwidth-aware rank placement: which global rank takes which mesh position.

Cost model. For a placement (the global rank at each position of the
``[pp, dp_replicate, dp_shard, cp, tp]`` mesh), every call of the traffic
model (:func:`giantmodel.core.traffic.mesh_traffic`: bytes each mesh dimension
moves per step) is priced on the worst link its groups span:

* a ring collective over a group of n ranks costs ``steps * α + volume * S / β``
  (all-reduce: 2(n-1) steps, volume 2(n-1)/n; all-gather and reduce-scatter:
  n-1 and (n-1)/n), with α the largest latency and β the smallest bandwidth
  between any two members; a pipeline send costs ``α + S / β`` over the
  slowest link between consecutive stages;
* a link between hosts is shared: when g groups of the same call leave a host
  at once, each gets ``β / ceil(g / nics)`` of it;
* the call costs what its slowest group costs (the others wait for it), times
  its calls per step; the placement costs the sum over calls.

The result is the predicted communication time per step. tp and cp move the
most bytes, so they land on the fastest links; pp moves the least and
tolerates the slowest; dp sits in between, all without being told.

Search. Worlds of up to ``EXHAUSTIVE_MAX`` ranks try every permutation. Larger
ones start from every nesting order of the mesh dimensions laid over the
ranks sorted by the topology's levels (hosts, then link classes), keep the
best, and improve it by swapping pairs of ranks in seeded batches until
``STALE_BATCHES`` batches in a row find no better swap, or after
``MAX_SWAP_BATCHES`` (1,024 ranks: a few seconds). The stop depends on the
inputs only, never on how fast the machine is, so ``giantmodel plan
--topology FILE`` and a run reading the same file choose the same placement; a
wall-clock cap (``time_budget_s``) stops only a search that would run far past
that, and the method in the log line then says so. Placements that put a
pipeline group out of increasing rank order are never chosen (the pipeline
schedules need it; see :func:`giantmodel.core.pipeline_split.check_pipeline_placement`).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist

from giantmodel.core.layout import validate_placement
from giantmodel.core.pipeline_split import check_pipeline_placement
from giantmodel.core.traffic import Traffic, mesh_traffic
from giantmodel.distributed.linkprobe import measure_or_load
from giantmodel.distributed.links import LinkTopology, derive_classes
from giantmodel.distributed.parallel_dims import MESH_DIMS

EXHAUSTIVE_MAX = 8
SWAP_BATCH, STALE_BATCHES, MAX_SWAP_BATCHES = 64, 8, 256
_STEPS = {"all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
          "all_gather": lambda n: (n - 1, (n - 1) / n),
          "reduce_scatter": lambda n: (n - 1, (n - 1) / n)}


@dataclass
class PlacementResult:
    """The chosen placement and what the model predicts for it and the fixed orders."""

    placement: list[int]
    """Global rank at each mesh position."""
    cost_s: float
    """Predicted communication seconds per step."""
    identity_s: float
    megatron_s: float
    per_call: dict[str, float] = field(default_factory=dict)
    """Predicted seconds per step of each call of the chosen placement."""
    method: str = ""
    evaluated: int = 0
    seconds: float = 0.0

    def log_line(self) -> str:
        return (f"placement: auto -> {self.placement} predicted comm {_ms(self.cost_s)}/step "
                f"(identity {_ms(self.identity_s)}, megatron tp-cp-dp-pp "
                f"{_ms(self.megatron_s)}; {self.method}, {self.evaluated} candidates, "
                f"{self.seconds:.2f}s)")


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def megatron_placement(degrees: dict[str, int]) -> list[int]:
    """Megatron-LM's fixed order (tp fastest, then cp, dp, pp) on this mesh:
    rank = tp + TP * (cp + CP * (dp + DP * pp))."""
    pp, rep, shard, cp, tp = (degrees[d] for d in MESH_DIMS)
    out = []
    for p, r, s, c, t in itertools.product(range(pp), range(rep), range(shard), range(cp),
                                           range(tp)):
        dp = s + shard * r
        out.append(t + tp * (c + cp * (dp + rep * shard * p)))
    return out


class CostModel:
    """Prices placements (many at once) for one layout, traffic and topology."""

    def __init__(self, degrees: dict[str, int], traffic: list[Traffic], topo: LinkTopology):
        self.shape = tuple(degrees[d] for d in MESH_DIMS)
        self.world = math.prod(self.shape)
        if topo.world_size != self.world:
            raise ValueError(f"topology has {topo.world_size} ranks, the mesh {self.world}")
        self.alpha, self.beta = topo.alpha, topo.beta
        self.host_of = topo.host_of
        self.nics = np.asarray(topo.nics, dtype=np.float64)
        self.num_hosts = topo.num_hosts
        # (traffic, [G, n] mesh positions of its groups)
        self.calls = []
        positions = np.arange(self.world).reshape(self.shape)
        for t in traffic:
            axes = [MESH_DIMS.index(d) for d in t.dims]
            rest = [a for a in range(5) if a not in axes]
            n = math.prod(self.shape[a] for a in axes)
            if n > 1 and t.count > 0:
                groups = positions.transpose(rest + axes).reshape(-1, n)
                self.calls.append((t, groups))
        self.pp_groups = positions.reshape(self.shape[0], -1).T  # [G, pp]

    def valid(self, perms: np.ndarray) -> np.ndarray:
        """[P] True where every pipeline group's ranks increase along pp."""
        if self.shape[0] == 1:
            return np.ones(len(perms), dtype=bool)
        ranks = perms[:, self.pp_groups]
        return (np.diff(ranks, axis=-1) > 0).all(axis=(1, 2))

    def cost(self, perms: np.ndarray, detail: bool = False):
        """Predicted seconds per step for each row of ``perms`` [P, world]."""
        perms = np.atleast_2d(perms)
        total = np.zeros(len(perms))
        parts = {}
        for t, groups in self.calls:
            ranks = perms[:, groups]                      # [P, G, n]
            secs = t.count * self._call_time(t, ranks)
            total += secs
            if detail:
                parts[f"{'+'.join(t.dims)} {t.kind} {t.what}"] = secs
        return (total, parts) if detail else total

    def _call_time(self, t: Traffic, ranks: np.ndarray) -> np.ndarray:
        if t.kind == "p2p":
            a, b = ranks[..., :-1], ranks[..., 1:]        # consecutive stages
            alpha, beta = self.alpha[a, b], self._shared_beta(ranks, a, b)
            per_group = (alpha + t.nbytes / beta).max(axis=-1)
            return per_group.max(axis=-1)
        n = ranks.shape[-1]
        steps, volume = _STEPS[t.kind](n)
        a, b = ranks[..., :, None], ranks[..., None, :]
        alpha = self.alpha[a, b].max(axis=(-1, -2))      # [P, G]
        beta = self._shared_beta(ranks, a, b).min(axis=(-1, -2))
        return (steps * alpha + volume * t.nbytes / beta).max(axis=-1)

    def _shared_beta(self, ranks: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """β between a and b, divided among the groups that leave the same host."""
        hosts = self.host_of[ranks]                        # [P, G, n]
        P, G, _ = hosts.shape
        touch = np.zeros((P, G, self.num_hosts), dtype=bool)
        np.put_along_axis(touch, hosts, True, axis=-1)
        spans = touch.sum(-1) > 1                          # [P, G]
        flows = (touch & spans[..., None]).sum(axis=1)     # [P, H]
        share = np.ceil(flows / self.nics).clip(min=1)     # [P, H]
        ha, hb = self.host_of[a], self.host_of[b]
        pidx = np.arange(P).reshape((P,) + (1,) * (ha.ndim - 1))
        div = np.maximum(share[pidx, ha], share[pidx, hb])
        return np.where(ha == hb, self.beta[a, b], self.beta[a, b] / div)


def rank_order(topo: LinkTopology) -> list[int]:
    """Ranks sorted so that close ranks are adjacent: by their group at each
    level, coarsest first (link classes from the measured matrices when the
    topology has none)."""
    if not topo.classes:
        topo.classes = derive_classes(topo.alpha, topo.beta, topo.host_ranks)
    levels = [groups for _, groups in topo.levels()]
    hosts = sorted(sorted(r) for r in topo.host_ranks)
    if hosts not in levels:
        levels.insert(0, hosts)
    levels.sort(key=len, reverse=True)  # finest (most groups) first

    def key(r: int):
        return tuple(next(i for i, g in enumerate(gs) if r in g) for gs in reversed(levels)) + (r,)

    return sorted(range(topo.world_size), key=key)


def _nesting_candidates(shape: tuple[int, ...], order: list[int]) -> np.ndarray:
    """For each nesting of the mesh dimensions (the last varies fastest), the
    placement that lays ``order`` over the mesh in that nesting."""
    live = [a for a in range(5) if shape[a] > 1]
    out = []
    for nest in itertools.permutations(live):
        axes = [a for a in range(5) if a not in nest] + list(nest)
        filled = np.asarray(order).reshape([shape[a] for a in axes])
        out.append(filled.transpose(np.argsort(axes)).reshape(-1))
    return np.unique(np.asarray(out), axis=0)


def search_placement(degrees: dict[str, int], traffic: list[Traffic], topo: LinkTopology,
                     time_budget_s: float = 60.0, seed: int = 0) -> PlacementResult:
    """The placement with the least predicted communication time (see module doc)."""
    t0 = time.perf_counter()
    model = CostModel(degrees, traffic, topo)
    world = model.world
    identity = np.arange(world)
    megatron = np.asarray(megatron_placement(degrees))
    if world <= EXHAUSTIVE_MAX:
        perms = np.asarray(list(itertools.permutations(range(world))))
        perms = perms[model.valid(perms)]
        costs = np.concatenate([model.cost(c) for c in np.array_split(perms, max(1, len(perms)
                                                                                // 4096))])
        # ties go to the placement nearest the identity, for readable logs
        best = min(range(len(perms)),
                   key=lambda i: (round(costs[i], 12), int((perms[i] != identity).sum()),
                                  tuple(perms[i])))
        chosen, method, evaluated = perms[best], "exhaustive", len(perms)
    else:
        chosen, evaluated, capped = _local_search(model, topo, identity, megatron,
                                                  time_budget_s, seed)
        method = "nesting orders + swaps" + (f", stopped at the {time_budget_s:g} s cap"
                                             if capped else "")
    cost, parts = model.cost(chosen[None], detail=True)
    return PlacementResult(
        placement=[int(x) for x in chosen], cost_s=float(cost[0]),
        identity_s=float(model.cost(identity[None])[0]),
        megatron_s=float(model.cost(megatron[None])[0]),
        per_call={k: float(v[0]) for k, v in parts.items()}, method=method,
        evaluated=evaluated, seconds=time.perf_counter() - t0)


def _local_search(model: CostModel, topo: LinkTopology, identity, megatron, budget: float,
                  seed: int) -> tuple[np.ndarray, int, bool]:
    t0 = time.perf_counter()
    starts = np.vstack([_nesting_candidates(model.shape, rank_order(topo)), identity, megatron])
    starts = np.asarray([_repair_pp(model, p) for p in starts])
    costs = model.cost(starts)
    best = starts[int(np.argmin(costs))].copy()
    best_cost = float(costs.min())
    evaluated = len(starts)
    rng = np.random.default_rng(seed)
    world = model.world
    stale = batches = 0
    capped = False
    while stale < STALE_BATCHES and batches < MAX_SWAP_BATCHES:
        if time.perf_counter() - t0 > budget:
            capped = True
            break
        batches += 1
        i = rng.integers(0, world, SWAP_BATCH)
        j = rng.integers(0, world, SWAP_BATCH)
        keep = topo.host_of[best[i]] != topo.host_of[best[j]]
        i, j = i[keep], j[keep]
        if len(i) == 0:
            stale += 1
            continue
        cand = np.repeat(best[None], len(i), axis=0)
        rows = np.arange(len(i))
        cand[rows, i], cand[rows, j] = best[j], best[i]
        c = np.where(model.valid(cand), model.cost(cand), np.inf)
        evaluated += len(i)
        k = int(np.argmin(c))
        if c[k] < best_cost * (1 - 1e-9):
            best, best_cost, stale = cand[k], float(c[k]), 0
        else:
            stale += 1
    return best, evaluated, capped


def _repair_pp(model: CostModel, perm: np.ndarray) -> np.ndarray:
    """Sort each pipeline group's ranks along pp (keeps who pipelines with whom)."""
    if model.shape[0] == 1:
        return perm
    out = perm.copy()
    for g in model.pp_groups:
        out[g] = np.sort(perm[g])
    return out


def explain(degrees: dict[str, int], traffic: list[Traffic], topo: LinkTopology,
            placements: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Predicted seconds per call for named placements (for reports and tests)."""
    model = CostModel(degrees, traffic, topo)
    out = {}
    for name, p in placements.items():
        total, parts = model.cost(np.asarray(p)[None], detail=True)
        out[name] = {"total": float(total[0]), **{k: float(v[0]) for k, v in parts.items()}}
    return out


# ------------------------------------------------------------ at start-up
def plan_placement(cfg, dims, topo: LinkTopology, time_budget_s: float = 60.0
                   ) -> PlacementResult:
    """The placement for a job config on ``topo`` (no process group needed):
    what ``parallel.placement: auto`` resolves to, and what the planner shows."""
    micro = dims.pipeline.n_micro if dims.pipeline is not None else None
    traffic = mesh_traffic(cfg.model, cfg.train, cfg.parallel, dims.degree_map,
                           precision=cfg.precision, recompute=cfg.recompute,
                           microbatches=micro)
    return search_placement(dims.degree_map, traffic, topo, time_budget_s=time_budget_s)


def resolve_placement(cfg, dims, backend: str, log=print) -> PlacementResult | None:
    """Resolve ``parallel.placement: auto`` on every rank, before the mesh is
    built: the topology is read or measured (:func:`measure_or_load`), rank 0
    searches and broadcasts, every rank sets ``dims.placement`` and
    ``cfg.parallel.placement`` (so the resolved permutation is what
    run.dir/config.yaml records). Returns None when placement is not auto."""
    if cfg.parallel.placement != "auto":
        return None
    topo = measure_or_load(cfg.comm.topology, backend, refresh=cfg.comm.topology_refresh,
                           log=log)
    box = [None]
    if dist.get_rank() == 0:
        box[0] = plan_placement(cfg, dims, topo)
    dist.broadcast_object_list(box, src=0)
    result: PlacementResult = box[0]
    dims.placement = validate_placement(result.placement, dims.world_size)
    dims.placement_pending = False
    check_pipeline_placement(dims.mesh_layout(), dims.pp)
    cfg.parallel.placement = list(result.placement)
    if dist.get_rank() == 0:
        log(result.log_line())
    return result
