"""Estimates as JSON-ready dicts and human tables, and the pipeline
imbalance report (per-stage time and memory, and a better layer split)."""

from __future__ import annotations

from dataclasses import asdict, replace

from giantmodel.core.pipeline_split import balanced_split
from giantmodel.planner.layout import Cluster, Layout
from giantmodel.planner.memory import MemoryReport, memory_report
from giantmodel.planner.moe import block_config, is_moe_block
from giantmodel.planner.perf import PerfOptions, PerfReport, edge_times, layer_time

GB = 1e9


def pipeline_report(m, layout: Layout, hw, cluster: Cluster,
                    opts: PerfOptions | None = None) -> dict:
    """Per global stage: layers, forward+backward time per micro-batch (the
    embedding on the first stage and the head + loss on the last counted),
    and the peak memory of the rank that runs it; plus the split that
    minimises the slowest stage and what it would change."""
    opts = opts or PerfOptions()
    modes = list(layout.recompute_layers or [layout.recompute] * m.num_layers)
    # each block under its own recompute mode and as its kind: a dense block
    # of an MoE model (DeepSeek-V3's first three) runs its dense FFN, no
    # experts and no all-to-all (giantmodel.planner.moe)
    kinds = [(is_moe_block(m, i), mode) for i, mode in enumerate(modes)]
    per_kind = {kind: layer_time(block_config(m, kind[0]), layout, hw, cluster, opts,
                                 kind[1]).total for kind in set(kinds)}
    block = [per_kind[kind] for kind in kinds]
    emb, head = edge_times(m, layout, hw, cluster)
    ns = layout.num_stages

    def times(split):
        starts = [sum(split[:s]) for s in range(len(split))]
        return [sum(block[starts[s]:starts[s] + n]) + (emb if s == 0 else 0)
                + (head if s == ns - 1 else 0) for s, n in enumerate(split)]

    def owner(stage):
        return next(r for r in range(layout.pp) if stage in layout.rank_stages(r))

    mem = memory_report(m, layout, hw)
    cur = times(layout.stage_layers)
    stages = [{"stage": s, "pp_rank": owner(s), "layers": n, "time_s": cur[s],
               "rank_memory_bytes": mem.ranks[owner(s)].required}
              for s, n in enumerate(layout.stage_layers)]
    out = {"stages": stages, "imbalance": max(cur) / (sum(cur) / ns) if ns else 1.0}
    if ns > 1 and m.num_layers < ns:
        # a hand-made split with blockless stages (Llama 3's embedding-only
        # first and head-only last chunks): no split giving every stage a
        # block exists, so there is nothing to suggest
        out.update({"suggested_pp_layers": None, "suggested_imbalance": out["imbalance"],
                    "suggested_stage_time_s": cur, "suggested_fits": mem.fits, "speedup": 1.0,
                    "suggestion": f"{m.num_layers} layers cannot give each of {ns} stages a "
                                  "block; the given parallel.pp_layers is kept"})
    elif ns > 1:
        suggested = split_by_block_cost(block, ns, emb, head)
        sug_layout = replace(layout, stage_layers=tuple(suggested))
        sug_mem = memory_report(m, sug_layout, hw)
        new = times(suggested)
        out.update({"suggested_pp_layers": suggested,
                    "suggested_imbalance": max(new) / (sum(new) / ns),
                    "suggested_stage_time_s": new,
                    "suggested_fits": sug_mem.fits,
                    "speedup": max(cur) / max(new)})
    return out


def split_by_block_cost(block: list[float], stages: int, first_extra: float = 0.0,
                        last_extra: float = 0.0) -> list[int]:
    """Contiguous blocks per stage (at least one each) minimising the
    slowest stage, each block at its own cost (``block``), the embedding's
    ``first_extra`` and the head's ``last_extra`` on the end stages. Blocks
    of one cost: :func:`balanced_split`'s split (its tie rules); otherwise
    an exact dynamic programme over prefix sums, ties to the split whose
    stage layer counts are closest to equal."""
    n = len(block)
    if len(set(block)) <= 1:
        return balanced_split(n, stages, block[0] if block else 0.0, first_extra, last_extra)
    pre = [0.0]
    for c in block:
        pre.append(pre[-1] + c)
    even = n / stages
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, stages + 1):
        for k in range(s, n - (stages - s) + 1):
            for j in range(s - 1, k):   # stage s - 1 holds blocks j .. k - 1
                if best[s - 1][j] == inf:
                    continue
                cost = pre[k] - pre[j] + (first_extra if s == 1 else 0.0) \
                    + (last_extra if s == stages else 0.0)
                cand = (max(best[s - 1][j][0], cost), best[s - 1][j][1] + abs(k - j - even))
                if cand < best[s][k]:
                    best[s][k], choice[s][k] = cand, k - j
    out, k = [], n
    for s in range(stages, 0, -1):
        out.append(choice[s][k])
        k -= choice[s][k]
    return out[::-1]


def layout_dict(layout: Layout) -> dict:
    d = asdict(layout)
    d["stage_layers"] = list(layout.stage_layers)
    d["dp_replicate"] = layout.dp_replicate
    d["world"] = layout.world
    return d


def estimate_dict(m, layout: Layout, hw, cluster: Cluster, mem: MemoryReport,
                  perf: PerfReport, pipeline: dict | None = None) -> dict:
    worst = mem.worst
    return {
        "gpu": hw.name,
        "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                    "world": cluster.world},
        "model": {"name": m.name, "params": m.num_params()},
        "layout": layout_dict(layout),
        "memory": {
            "peak_bytes_per_rank": mem.peak_bytes_per_rank,
            "required_bytes_per_rank": mem.required_bytes_per_rank,
            "capacity_bytes": mem.capacity,
            "fits": mem.fits,
            "worst_pp_rank": worst.pp_rank,
            "breakdown": dict(worst.components),
            "per_layer": dict(worst.per_layer),
            "layers_on_rank": worst.layers,
            "microbatches_in_flight": worst.inflight,
            "per_rank": [{"pp_rank": r.pp_rank, "peak_bytes": r.peak,
                          "required_bytes": r.required} for r in mem.ranks],
        },
        "time": {"step_s": perf.step_s, "breakdown": dict(perf.breakdown),
                 "stage_s": list(perf.stage_s)},
        "throughput": {"tokens_per_sec": perf.tokens_per_sec,
                       "tokens_per_sec_per_gpu": perf.tokens_per_sec / cluster.world,
                       "tflops_per_gpu": perf.tflops_per_gpu, "mfu": perf.mfu,
                       "comm_share": perf.comm_share, "bubble_share": perf.bubble_share,
                       "scaling_efficiency": perf.scaling_efficiency},
        "pipeline": pipeline or {},
    }


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def format_estimate(d: dict) -> str:
    mem, t, th = d["memory"], d["time"], d["throughput"]
    lines = [(f"{d['model']['name']} ({d['model']['params'] / 1e9:.2f}B params) on "
             f"{d['cluster']['nodes']} x {d['cluster']['gpus_per_node']} {d['gpu']}"),
             (f"memory per rank (worst: pp rank {mem['worst_pp_rank']}): "
             f"{_gb(mem['required_bytes_per_rank'])} GB of {_gb(mem['capacity_bytes'])} GB"
             f" -> {'fits' if mem['fits'] else 'DOES NOT FIT'}")]
    for k, v in mem["breakdown"].items():
        lines.append(f"  {k:<28} {_gb(v):>8} GB")
    lines.append(f"  per layer, per micro-batch: {_gb(sum(mem['per_layer'].values()))} GB "
                 f"x {mem['layers_on_rank']} layers x {mem['microbatches_in_flight']:.2f} in flight")
    if not mem["fits"] and mem["per_layer"]:
        # what a run that does not fit would have to shed first
        top = sorted(mem["per_layer"].items(), key=lambda kv: -kv[1])[:4]
        lines.append("    largest saved tensors per layer: "
                     + ", ".join(f"{name} {v / 2**20:,.0f} MiB" for name, v in top))
    lines.append(f"step {t['step_s']:.3f} s | {th['tokens_per_sec']:,.0f} tokens/s "
                 f"({th['tokens_per_sec_per_gpu']:,.0f}/GPU) | {th['tflops_per_gpu']:.1f} TFLOP/s/GPU"
                 f" | MFU {th['mfu'] * 100:.1f}% | comm {th['comm_share'] * 100:.1f}% | "
                 f"bubble {th['bubble_share'] * 100:.1f}% | scaling {th['scaling_efficiency'] * 100:.0f}%")
    for r in mem.get("layer_recompute") or []:
        plan = r["plan"]
        lines.append(f"  least recompute that fits, pp rank {r['pp_rank']}: " + (
            "none fits" if plan is None else
            f"{plan['none']} blocks as is, {plan['selective']} selective, {plan['full']} full"))
    pl = d.get("pipeline") or {}
    if pl.get("stages") and len(pl["stages"]) > 1:
        lines.append("pipeline stages (time per micro-batch, memory of the owning rank):")
        for s in pl["stages"]:
            lines.append(f"  stage {s['stage']:>2} (rank {s['pp_rank']}): {s['layers']:>3} layers "
                         f"{s['time_s'] * 1e3:8.1f} ms {_gb(s['rank_memory_bytes']):>7} GB")
        lines.append(f"  imbalance (slowest / mean) {pl['imbalance']:.3f}; " + (
            f"{pl['suggestion']}" if pl.get("suggested_pp_layers") is None else
            f"suggested parallel.pp_layers={pl['suggested_pp_layers']} -> "
            f"{pl['suggested_imbalance']:.3f}" + ("" if pl["suggested_fits"] else " (does not fit)")))
    return "\n".join(lines)


def format_plan(rows: list, cluster: Cluster, gpu: str) -> str:
    head = (f"{'#':>2}  {'layout':<58} {'mem GB':>7} {'step s':>8} {'tok/s/GPU':>10} "
            f"{'TFLOP/s':>8} {'MFU':>6} {'bubble':>7} {'comm':>6}")
    lines = [f"top layouts on {cluster} {gpu}:", head]
    for i, c in enumerate(rows, 1):
        p = c.perf
        lines.append(f"{i:>2}  {c.layout.describe():<58} {_gb(c.memory.required_bytes_per_rank):>7} "
                     f"{p.step_s:>8.3f} {p.tokens_per_sec / cluster.world:>10,.0f} "
                     f"{p.tflops_per_gpu:>8.1f} {p.mfu * 100:>5.1f}% {p.bubble_share * 100:>6.1f}% "
                     f"{p.comm_share * 100:>5.1f}%")
    return "\n".join(lines)
