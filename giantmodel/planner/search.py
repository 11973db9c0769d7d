"""Layout search: enumerate, drop what does not fit, rank by throughput.

For each (tp, cp, pp, virtual stages, dp, zero, hybrid group, micro-batch,
sequence parallelism) the search tries recompute none, then a per-block mix
(the least recompute time that fits, block by block, written as
``recompute_layers``), then selective and full everywhere, and keeps the
fastest that fits. Only if none fits does it try activation offload (on
accelerators; on a CPU host offload moves nothing). There is no optimizer
offload in the engine, so none is searched. Every field of a reported layout
is written to the YAML it produces, and candidates are checked with the
trainer's own layout validation before they are reported.
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass, replace

from giantmodel.config.errors import ConfigError
from giantmodel.core.pipeline_split import balanced_split, embedding_cost, head_cost, layer_cost
from giantmodel.planner.layer_recompute import layer_recompute_plan
from giantmodel.planner.layout import Cluster, Layout, job_fields, resolve_layout
from giantmodel.planner.memory import MemoryReport, memory_report, offloads_to_host
from giantmodel.planner.perf import PerfOptions, PerfReport, estimate_time

RECOMPUTE_ORDER = ("none", "selective", "full")


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryReport
    perf: PerfReport


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_options(m, cluster: Cluster) -> list[int]:
    if m.mla is not None:   # latent attention is refused under tp (parallel.tp)
        return [1]
    out = []
    for t in _divisors(cluster.gpus_per_node):
        if all(v % t == 0 for v in (m.num_heads, m.kv_heads, m.ffn_hidden_size, m.vocab_size)):
            out.append(t)
    return out


def ep_options(m, dp_cp: int) -> list[int]:
    """Expert-parallel degrees: divisors of the routed experts that divide the
    dp x cp ranks ep borrows (parallel.ep's rule); 1 for a dense model."""
    if m.moe is None:
        return [1]
    return [e for e in _divisors(m.moe.num_experts) if dp_cp % e == 0]


_SPLITS: dict[tuple, tuple[int, ...]] = {}


def _split(m, seq_len: int, stages: int) -> tuple[int, ...]:
    key = (m.num_layers, m.hidden_size, m.vocab_size, seq_len, stages)
    if key not in _SPLITS:
        if stages == 1:
            _SPLITS[key] = (m.num_layers,)
        else:
            _SPLITS[key] = tuple(balanced_split(m.num_layers, stages, layer_cost(m, seq_len),
                                                embedding_cost(m), head_cost(m)))
    return _SPLITS[key]


def enumerate_layouts(cfg, cluster: Cluster, recompute: str = "none",
                      offload_activations: bool = False):
    """Every structurally valid layout of ``cfg``'s model and batch on ``cluster``."""
    m, t = cfg.model, cfg.train
    world, gbs, seq = cluster.world, t.global_batch_size, t.seq_len
    job = job_fields(cfg)
    cps = [c for c in (1, 2, 4, 8) if seq % (2 * c) == 0 and (c == 1 or seq >= 4096)]
    for tp in _tp_options(m, cluster):
        for cp in cps:
            if world % (tp * cp):
                continue
            for pp in _divisors(world // (tp * cp)):
                if pp > m.num_layers:
                    continue
                dp = world // (tp * cp * pp)
                scheds = [("1f1b", 1)] if pp == 1 else [("1f1b", 1)] + [
                    ("interleaved_1f1b", v) for v in (2, 4) if m.num_layers >= pp * v]
                for mb in (1, 2, 4, 8, 16):
                    if gbs % (mb * dp):
                        continue
                    n_micro = gbs // (mb * dp)
                    if pp > 1 and n_micro < pp:
                        continue
                    for sched, v in scheds:
                        if v > 1 and n_micro % pp:
                            continue
                        split = _split(m, seq, pp * v)
                        for zero in (0, 1, 2, 3):
                            if zero and dp * cp == 1:
                                continue
                            groups = [dp]
                            hs = cluster.gpus_per_node // (tp * cp)
                            if zero >= 2 and hs > 1 and dp > hs and dp % hs == 0:
                                groups.append(hs)
                            for shard, sp, ep in itertools.product(
                                    groups if zero else [1],
                                    (False, True) if tp > 1 else (False,),
                                    ep_options(m, dp * cp)):
                                if ep > 1 and shard < dp:   # experts under HSDP: not modelled
                                    continue
                                yield Layout(
                                    tp=tp, pp=pp, dp=dp, dp_shard=shard, cp=cp, sp=sp,
                                    zero=zero, virtual=v, schedule=sched, micro_batch=mb,
                                    n_micro=n_micro, seq_len=seq, precision=cfg.precision,
                                    recompute=recompute,
                                    offload_activations=offload_activations,
                                    stage_layers=split, ep=ep,
                                    bucket_mb=cfg.parallel.bucket_mb, **job)


def least_recompute_that_fits(m, layout: Layout, hw, cluster: Cluster | None = None,
                              opts: PerfOptions | None = None
                              ) -> tuple[Layout, MemoryReport] | None:
    """The layout with the least recompute that fits: none; else the per-block
    mix with the least recompute time (when it is not simply one mode
    everywhere); else selective, then full everywhere; as a last resort full
    recompute with activation offload (only where offload frees device memory)."""
    mem = memory_report(m, replace(layout, recompute="none", recompute_layers=None), hw)
    if mem.fits:
        return replace(layout, recompute="none", recompute_layers=None), mem
    full = replace(layout, recompute="full", recompute_layers=None)
    full_mem = memory_report(m, full, hw)
    if not full_mem.fits:   # no mix fits either: only offload is left
        if offloads_to_host(hw):
            cand = replace(full, offload_activations=True)
            mem = memory_report(m, cand, hw)
            if mem.fits:
                return cand, mem
        return None
    if cluster is not None:
        mixed = mixed_recompute_layout(m, layout, hw, cluster, opts)
        if mixed is not None:
            mem = memory_report(m, mixed, hw)
            if mem.fits:
                return mixed, mem
    sel = replace(layout, recompute="selective", recompute_layers=None)
    mem = memory_report(m, sel, hw)
    if mem.fits:
        return sel, mem
    return full, full_mem


def mixed_recompute_layout(m, layout: Layout, hw, cluster: Cluster,
                           opts: PerfOptions | None = None) -> Layout | None:
    """``layout`` with the per-block recompute mix of
    :func:`giantmodel.planner.layer_recompute.layer_recompute_plan`: on each
    pipeline rank, its first blocks run full, the next ones selective, the
    rest as they are. None when some rank does not fit even fully recomputed,
    or when the mix is one mode everywhere (the global modes cover that)."""
    plans = layer_recompute_plan(m, replace(layout, recompute_layers=None), hw, cluster, opts)
    if any(p["plan"] is None for p in plans):
        return None
    modes = [""] * m.num_layers
    starts = [sum(layout.stage_layers[:s]) for s in range(layout.num_stages)]
    for p in plans:
        blocks = [starts[s] + i for s in layout.rank_stages(p["pp_rank"])
                  for i in range(layout.stage_layers[s])]
        order = (["full"] * p["plan"]["full"] + ["selective"] * p["plan"]["selective"]
                 + ["none"] * p["plan"]["none"])
        for b, mode in zip(blocks, order):
            modes[b] = mode
    if len(set(modes)) == 1:
        return None
    return replace(layout, recompute=max(set(modes), key=RECOMPUTE_ORDER.index),
                   recompute_layers=tuple(modes))


def search(cfg, hw, cluster: Cluster, opts: PerfOptions | None = None,
           time_budget_s: float = 30.0, clock=time.monotonic) -> list[Candidate]:
    """All fitting layouts, best predicted throughput first. Ties go to the
    simpler layout (no sequence parallelism, lower ZeRO stage, fewer stages).
    ``clock`` measures the budget: wall time for a user waiting on ``plan``;
    ``time.process_time`` makes the result independent of other load on the host."""
    m = cfg.model
    found: list[Candidate] = []
    start = clock()
    for layout in enumerate_layouts(cfg, cluster):
        if clock() - start > time_budget_s:
            break
        res = least_recompute_that_fits(m, layout, hw, cluster, opts)
        if res is None:
            continue
        cand, mem = res
        perf = estimate_time(m, cand, hw, cluster, cfg.train.global_batch_size, opts)
        found.append(Candidate(cand, mem, perf))
    found.sort(key=lambda c: (-round(c.perf.tokens_per_sec, 6), c.layout.sp, c.layout.zero,
                              c.layout.pp, c.layout.virtual))
    return found


def apply_layout(cfg, layout: Layout):
    """A copy of ``cfg`` that runs ``layout`` (what ``giantmodel train`` reads)."""
    out = copy.deepcopy(cfg)
    p = out.parallel
    p.tp, p.pp, p.cp, p.sp, p.zero = layout.tp, layout.pp, layout.cp, layout.sp, layout.zero
    p.dp = layout.dp
    p.ep = layout.ep
    p.pp_virtual = layout.virtual
    p.pp_schedule = layout.schedule
    # the split the planner costed, written out so the trainer runs that one
    p.pp_layers = list(layout.stage_layers) if layout.num_stages > 1 else None
    p.pp_microbatches = None
    p.shard_group_size = layout.dp_shard if (layout.zero and layout.dp_shard < layout.dp) else None
    p.bucket_mb = layout.bucket_mb
    p.keep_gathered_numel = layout.keep_gathered_numel
    out.train.micro_batch_size = layout.micro_batch
    out.train.seq_len = layout.seq_len
    out.precision = layout.precision
    out.recompute = layout.recompute
    out.recompute_layers = list(layout.recompute_layers) if layout.recompute_layers else None
    out.offload.activations = layout.offload_activations
    return out


def verified(cfg, cands: list[Candidate], cluster: Cluster, k: int) -> list[Candidate]:
    """The first ``k`` candidates the trainer's validation accepts."""
    out = []
    for c in cands:
        try:
            resolve_layout(apply_layout(cfg, c.layout), cluster)
        except ConfigError:
            continue
        out.append(c)
        if len(out) == k:
            break
    return out


def smallest_fitting_cluster(cfg, hw, gpus_per_node: int, max_nodes: int = 4096) -> Cluster | None:
    """The fewest nodes (every count up to 128, then powers of two) on which
    some layout fits, ignoring whether the global batch divides: the
    memory-frugal corner of the space (zero 3, full recompute, activation
    offload, micro-batch 1)."""
    m = cfg.model
    counts = list(range(1, 129)) + [2 ** k for k in range(8, 13)]
    for nodes in (n for n in counts if n <= max_nodes):
        cluster = Cluster(nodes, gpus_per_node)
        world = cluster.world
        for tp in reversed(_tp_options(m, cluster)):
            for pp in _divisors(world // tp):
                if pp > m.num_layers:
                    continue
                dp = world // (tp * pp)
                layout = Layout(tp=tp, pp=pp, dp=dp, dp_shard=dp, cp=1, sp=tp > 1,
                                zero=3 if dp > 1 else 0, virtual=1, schedule="1f1b",
                                micro_batch=1, n_micro=pp, seq_len=cfg.train.seq_len,
                                precision=cfg.precision, recompute="full",
                                offload_activations=offloads_to_host(hw),
                                stage_layers=_split(m, cfg.train.seq_len, pp),
                                ep=max(ep_options(m, dp)),
                                bucket_mb=cfg.parallel.bucket_mb, **job_fields(cfg))
                if memory_report(m, layout, hw).fits:
                    return cluster
    return None
