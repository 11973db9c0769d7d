"""Pictures of the planner's predictions: ``estimate --plot`` (memory per
pipeline rank as stacked bars against the device's capacity) and ``plan
--plot`` (the best layout's pipeline schedule as a timeline, and the top
layouts' throughput against memory).

The planner models a pipeline step with a closed formula (per-rank forward
and backward times, fill and drain); the timeline is a list schedule of the
standard per-micro-batch order of each schedule, built from those same
per-rank times (:func:`pipeline_timeline`). matplotlib is imported lazily.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from giantmodel.core.pipeline_split import stage_ids_for_rank
from giantmodel.metrics.plots import pyplot
from giantmodel.planner.perf import PerfOptions, stage_times
from giantmodel.planner.report import pipeline_report

GB = 1e9

# MemoryReport component -> bar segment. Working weights (the low-precision
# or gathered copies) are parameters in memory; a step without gradient
# accumulation nets its not-yet-allocated gradients off the gradients.
# Anything else (bucket buffers, the optimizer step's temporaries,
# fragmentation, the CUDA context) is a buffer.
CATEGORIES = {
    "parameters": ("params", "working_weights"),
    "gradients": ("grads", "grads_not_yet_allocated"),
    "optimizer states": ("optimizer",),
    "activations": ("activations", "embedding_head_activations", "backward_transient"),
}
BUFFERS = "buffers"
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer states": "#55a868",
          "activations": "#c44e52", BUFFERS: "#8c8c8c"}
SPLIT_BACKWARD = ("zero_bubble", "zbv")
"""Schedules that split backward into input-gradient (B) and weight-gradient (W) work."""


def memory_categories(components: dict[str, float]) -> dict[str, float]:
    """A rank's memory components summed into the five bar segments."""
    out = {name: 0.0 for name in (*CATEGORIES, BUFFERS)}
    for key, value in components.items():
        cat = next((c for c, keys in CATEGORIES.items() if key in keys), BUFFERS)
        out[cat] += value
    return out


def plot_memory(mem, layout, hw_name: str, out: str, title: str = "") -> None:
    """Stacked bars of each pipeline rank's predicted memory (one bar per rank,
    labelled with the stages it runs) and the device capacity as a line."""
    plt = pyplot("estimate --plot")
    ranks = sorted(mem.ranks, key=lambda r: r.pp_rank)
    cats = [memory_categories(r.components) for r in ranks]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(ranks) + 4), 5.5), constrained_layout=True)
    x = list(range(len(ranks)))
    bottom = [0.0] * len(ranks)
    for name in (*CATEGORIES, BUFFERS):
        h = [c[name] / GB for c in cats]
        ax.bar(x, h, bottom=bottom, color=COLORS[name], label=name, width=0.6)
        bottom = [b + v for b, v in zip(bottom, h)]
    for xi, total in zip(x, bottom):
        ax.annotate(f"{total:.1f}", (xi, total), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    cap = mem.capacity / GB
    ax.axhline(cap, color="black", linestyle="--", linewidth=1.2,
               label=f"{hw_name} capacity {cap:.0f} GB")
    labels = []
    for r in ranks:
        stages = layout.rank_stages(r.pp_rank) if layout.pp > 1 else [0]
        labels.append(f"pp rank {r.pp_rank}\nstage{'s' if len(stages) > 1 else ''} "
                      + ",".join(map(str, stages)))
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("memory per GPU (GB)")
    ax.set_xlabel("pipeline rank")
    ax.set_ylim(0, max(max(bottom), cap) * 1.12)
    ax.set_title(title or f"predicted memory per rank: {layout.describe()}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------ the timeline
@dataclass(frozen=True)
class Block:
    """One unit of pipeline work: forward (F), backward (B; input gradient only
    when the schedule splits it) or weight gradient (W) of one micro-batch on
    one global stage, run by pipeline rank ``rank`` from ``start`` to ``end``."""
    rank: int
    stage: int
    micro: int
    kind: str
    start: float
    end: float


def _forward_order(chunks: int, n_micro: int, pp: int) -> list[tuple[int, int]]:
    """(chunk, micro-batch) in the order a rank runs forwards: Megatron's
    interleaving, a round of micro-batches through chunk 0, then chunk 1, ...
    (torch's rounds: ``n_micro // pp`` of them when that divides; otherwise
    rounds of pp and a shorter last one)."""
    if chunks == 1:
        return [(0, i) for i in range(n_micro)]
    rounds = max(1, n_micro // pp)
    group = n_micro // rounds if n_micro % rounds == 0 else pp
    return [(c, i) for first in range(0, n_micro, group) for c in range(chunks)
            for i in range(first, min(first + group, n_micro))]


def _in_flight_cap(schedule: str, pp: int, rank: int, chunks: int, n_micro: int) -> int:
    """How many forwards a rank runs ahead of its backwards: 1F1B's pp - rank
    (ZB-H1 keeps the same memory); Megatron's interleaved warm-up + 1;
    ZB-V's 2 * pp; GPipe: all of them."""
    if schedule == "gpipe":
        return chunks * n_micro
    if schedule == "zbv":
        # the V: every rank holds both ends of a micro-batch's path, and ZB-V
        # keeps 2 * pp chunk activations on each (1F1B's first-rank peak)
        return min(chunks * n_micro, 2 * pp)
    if chunks == 1:
        return pp - rank
    rounds = max(1, n_micro // pp)
    group = n_micro // rounds if n_micro % rounds == 0 else pp
    return min(chunks * n_micro, (pp - rank - 1) * 2 + (chunks - 1) * group + 1)


def _per_rank(value, pp: int) -> list[float]:
    return [float(value)] * pp if isinstance(value, (int, float)) else [float(v) for v in value]


def pipeline_timeline(schedule: str, pp: int, virtual: int, n_micro: int, fwd, bwd,
                      stage_weights: list[float] | None = None) -> list[Block]:
    """The blocks of one pipeline step under ``schedule`` (gpipe, 1f1b,
    interleaved_1f1b, zero_bubble, zbv).

    ``fwd`` / ``bwd``: seconds per micro-batch of each rank's forward and
    backward over all its stages (a number: the same on every rank), as
    :func:`giantmodel.planner.perf.stage_times` gives them; a rank's time
    is shared among its stages by ``stage_weights`` (one per global stage;
    default equal). Split-backward schedules run half of backward as B and
    half as W (the input- and weight-gradient matmuls are the same size).

    Each rank runs a fixed order, as torch's schedules do: GPipe all
    forwards then all backwards; the others a warm-up of forwards, then one
    forward and one backward in turn, then the remaining backwards. A
    zero-bubble rank runs a deferred W whenever its next F or B is not ready,
    and the rest at the end. With equal stages 1F1B's bubble is
    (pp - 1) / (n_micro + pp - 1) of the step."""
    chunks = 2 if schedule == "zbv" else (virtual if schedule != "gpipe" else 1)
    fwd, bwd = _per_rank(fwd, pp), _per_rank(bwd, pp)
    ns = pp * chunks
    weights = stage_weights or [1.0] * ns
    stages = [stage_ids_for_rank(r, pp, chunks, schedule) if pp > 1 else list(range(ns))
              for r in range(pp)]
    split = schedule in SPLIT_BACKWARD
    dur = {}
    for r in range(pp):
        total = sum(weights[s] for s in stages[r])
        for s in stages[r]:
            share = weights[s] / total if total > 0 else 1 / len(stages[r])
            dur[("F", s)] = fwd[r] * share
            dur[("B", s)] = bwd[r] * share * (0.5 if split else 1.0)
            dur[("W", s)] = bwd[r] * share * 0.5
    order = _forward_order(chunks, n_micro, pp)
    ranks = []
    for r in range(pp):
        f = [("F", stages[r][c], i) for c, i in order]
        b = [("B", stages[r][chunks - 1 - c], i) for c, i in order]
        warm = _in_flight_cap(schedule, pp, r, chunks, n_micro) - 1 if schedule != "gpipe" \
            else len(f)
        steady = [op for pair in zip(f[warm:], b) for op in pair]
        ranks.append({"ops": deque(f[:warm] + steady + b[len(f) - warm:]), "W": deque(),
                      "free": 0.0})
    return _simulate(ranks, dur, ns, split)


def _ready(op: tuple[str, int, int], finish: dict, ns: int) -> float:
    """When ``op``'s inputs exist (inf: a producer is not scheduled yet)."""
    kind, s, i = op
    if kind == "F":
        deps = [("F", s - 1, i)] if s > 0 else []
    elif kind == "B":
        deps = [("F", s, i)] + ([("B", s + 1, i)] if s < ns - 1 else [])
    else:
        deps = [("B", s, i)]
    return max((finish.get(d, math.inf) for d in deps), default=0.0)


def _choice(q: dict, finish: dict, ns: int):
    """(start, op) a rank would run next: its next F or B in order, or a
    deferred W while that one is not ready (or none is left)."""
    start = max(q["free"], _ready(q["ops"][0], finish, ns)) if q["ops"] else math.inf
    if q["W"] and start > q["free"]:
        return q["free"], q["W"][0]
    return None if start == math.inf else (start, q["ops"][0])


def _simulate(ranks: list[dict], dur: dict, ns: int, split: bool) -> list[Block]:
    """Commit, one at a time, the op that starts earliest over all ranks: no op
    scheduled later can start before it, so each rank's choice is final."""
    finish: dict = {}
    blocks: list[Block] = []
    while any(q["ops"] or q["W"] for q in ranks):
        picks = [(c, r) for r, q in enumerate(ranks) if (c := _choice(q, finish, ns)) is not None]
        if not picks:
            raise RuntimeError("pipeline timeline: no rank can proceed (schedule deadlock)")
        (start, op), r = min(picks, key=lambda p: p[0][0])
        q = ranks[r]
        kind, s, i = op
        (q["W"] if kind == "W" else q["ops"]).popleft()
        q["free"] = finish[op] = end = start + dur[(kind, s)]
        if kind == "B" and split:
            q["W"].append(("W", s, i))
        blocks.append(Block(r, s, i, kind, start, end))
    return blocks


def bubble_fraction(blocks: list[Block]) -> float:
    """Idle share of the ranks' time over the step (first start to last end)."""
    ranks = {b.rank for b in blocks}
    span = max(b.end for b in blocks) - min(b.start for b in blocks)
    busy = sum(b.end - b.start for b in blocks)
    return 1.0 - busy / (span * len(ranks)) if span else 0.0


# ------------------------------------------------------------ plan --plot
BLOCK_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
BLOCK_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}


DRAWN_MICRO = 16
"""Micro-batches drawn at most: fill, steady state and drain stay legible;
the steady state only repeats with more."""


def layout_timeline(m, layout, hw, cluster, n_micro: int | None = None) -> list[Block]:
    """The timeline of ``layout``'s pipeline step from the planner's per-rank
    forward / backward times, shared among a rank's stages by their modelled
    stage times (the embedding on the first, the head on the last);
    ``n_micro`` micro-batches (default the layout's)."""
    n = n_micro or layout.n_micro
    st = stage_times(m, layout, hw, cluster, PerfOptions())
    if layout.pp == 1:   # no pipeline: one rank's micro-batches back to back
        return pipeline_timeline("1f1b", 1, 1, n, st[0].fwd, st[0].bwd)
    weights = [s["time_s"] for s in pipeline_report(m, layout, hw, cluster)["stages"]]
    return pipeline_timeline(layout.schedule, layout.pp, layout.virtual, n,
                             [s.fwd for s in st], [s.bwd for s in st], weights)


def drawn_micro(pp: int, n_micro: int) -> int:
    """How many micro-batches the picture draws: all up to DRAWN_MICRO, else
    whole rounds of pp (at least two)."""
    return n_micro if n_micro <= DRAWN_MICRO else pp * max(2, math.ceil(DRAWN_MICRO / pp))


def _draw_timeline(ax, blocks: list[Block], pp: int) -> None:
    span = max(b.end for b in blocks)
    scale, unit = (1e3, "ms") if span < 10 else (1.0, "s")
    for kind in ("F", "B", "W"):
        for r in range(pp):
            bars = [(b.start * scale, (b.end - b.start) * scale) for b in blocks
                    if b.rank == r and b.kind == kind]
            if bars:
                ax.broken_barh(bars, (r - 0.4, 0.8), facecolors=BLOCK_COLORS[kind],
                               edgecolor="white", linewidth=0.5,
                               label=BLOCK_NAMES[kind] if r == 0 else None)
    if len(blocks) <= 400:   # micro-batch numbers while they are legible
        for b in blocks:
            ax.text((b.start + b.end) / 2 * scale, b.rank, str(b.micro), ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(range(pp), [f"pp rank {r}" for r in range(pp)])
    ax.set_ylim(pp - 0.5, -0.5)   # rank 0 on top, as schedules are drawn
    ax.set_xlim(0, span * scale)
    ax.set_xlabel(f"time ({unit}); white gaps are idle time: the pipeline bubble")
    ax.set_ylabel("pipeline rank")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _draw_candidates(ax_tps, ax_mem, cands: list, world: int) -> None:
    labels = [f"#{i} {c.layout.describe()}" for i, c in enumerate(cands, 1)]
    y = list(range(len(cands)))
    tps = [c.perf.tokens_per_sec / world for c in cands]
    mems = [c.memory.required_bytes_per_rank / GB for c in cands]
    cap = cands[0].memory.capacity / GB
    ax_tps.barh(y, tps, color="#4c72b0")
    ax_mem.barh(y, mems, color="#c44e52")
    ax_mem.axvline(cap, color="black", linestyle="--", linewidth=1.2, label=f"capacity {cap:.0f} GB")
    for ax, vals, fmt in ((ax_tps, tps, "{:,.0f}"), (ax_mem, mems, "{:.1f}")):
        for yi, v in zip(y, vals):
            ax.annotate(fmt.format(v), (v, yi), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=7)
        ax.set_yticks(y, labels if ax is ax_tps else [f"#{i}" for i in range(1, len(y) + 1)],
                      fontsize=7)
        ax.set_ylim(len(y) - 0.5, -0.5)   # the best on top
        ax.grid(True, axis="x", alpha=0.3)
    ax_tps.set_xlim(0, max(tps) * 1.2)
    ax_mem.set_xlim(0, max(max(mems), cap) * 1.15)
    ax_tps.set_xlabel("predicted tokens/s per GPU")
    ax_mem.set_xlabel("predicted memory per GPU (GB)")
    ax_mem.legend(fontsize=7, loc="lower right")


def plot_plan(m, cands: list, hw, cluster, out: str) -> list[Block]:
    """The best candidate's pipeline timeline above the top candidates'
    tokens/s per GPU and memory; returns the drawn timeline's blocks."""
    plt = pyplot("plan --plot")
    best = cands[0].layout
    n = drawn_micro(best.pp, best.n_micro)
    blocks = layout_timeline(m, best, hw, cluster, n)
    fig = plt.figure(figsize=(13, 9), constrained_layout=True)
    grid = fig.add_gridspec(2, 2, height_ratios=[max(2, min(best.pp, 8)), 3],
                            width_ratios=[3, 2])
    ax_t = fig.add_subplot(grid[0, :])
    _draw_timeline(ax_t, blocks, best.pp)
    sched = best.schedule if best.pp > 1 else "no pipeline"
    drawn = (f"{best.n_micro} micro-batches" if n == best.n_micro else
             f"the first {n} of {best.n_micro} micro-batches' schedule")
    ax_t.set_title(f"#1 {best.describe()}: {sched}, {drawn}; idle {bubble_fraction(blocks):.1%} "
                   f"of rank time here (planner's bubble over the full step: "
                   f"{cands[0].perf.bubble_share:.1%})", fontsize=9)
    ax_tps, ax_mem = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    _draw_candidates(ax_tps, ax_mem, cands, cluster.world)
    ax_tps.set_title(f"top {len(cands)} layouts on {cluster} {hw.name}: throughput", fontsize=9)
    ax_mem.set_title("memory of the fullest rank", fontsize=9)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return blocks
