"""Per-layer recompute: the least recompute that fits, layer by layer.

The global ``recompute`` key applies one mode to every block. Memory often
needs less: recomputing only some blocks of a pipeline rank (selective on
some, full on a few) can be enough. For each pipeline rank this finds how
many of its blocks to leave as they are, run selectively, or run in full,
minimising the added recompute time subject to fitting.
"""

from __future__ import annotations

from dataclasses import replace

from giantmodel.planner.layout import Cluster, Layout
from giantmodel.planner.memory import (
    DTYPE_BYTES,
    FRAGMENTATION,
    layer_activation_bytes,
    param_table,
    rank_memory,
)
from giantmodel.planner.perf import PerfOptions, layer_time


def _per_layer(m, layout: Layout, mode: str) -> float:
    return sum(layer_activation_bytes(m, layout.precision, mode, layout.micro_batch,
                                      layout.seq_len, layout.tp, layout.sp, layout.cp).values())


def layer_recompute_plan(m, layout: Layout, hw, cluster: Cluster,
                         opts: PerfOptions | None = None) -> list[dict]:
    """For each pipeline rank: {'none': a, 'selective': b, 'full': c} block
    counts with the least recompute time per micro-batch that fits, or None
    when even full recompute of every block does not fit."""
    opts = opts or PerfOptions()
    acts = {mode: _per_layer(m, layout, mode) for mode in ("none", "selective", "full")}
    cost = {mode: layer_time(m, replace(layout, recompute=mode), hw, cluster, opts).recompute
            for mode in ("none", "selective", "full")}
    c = DTYPE_BYTES[layout.precision]
    # Autocast's weight copies go with the blocks that recompute (zero 0/1).
    weights = (param_table(m).layer_linear_numel(layout.tp) * c
               if layout.zero < 2 and c < 4 else 0.0)
    plans = []
    for r in range(layout.pp):
        base = rank_memory(m, replace(layout, recompute="none"), r, hw)
        n, inflight = base.layers, base.inflight
        best = None
        for n_full in range(n + 1):
            for n_sel in range(n - n_full + 1):
                saved = (inflight * (n_sel * (acts["none"] - acts["selective"])
                                     + n_full * (acts["none"] - acts["full"]))
                         + (n_sel + n_full) * weights) * (1 + FRAGMENTATION)
                # one block's re-created tensors live during its backward
                rerun = (acts["none"] if n_full else
                         acts["none"] - acts["selective"] if n_sel else 0.0)
                need = base.required - saved + (1 + FRAGMENTATION) * max(
                    0.0, rerun - base.components["backward_transient"])
                if need > hw.memory_bytes:
                    continue
                t = n_sel * cost["selective"] + n_full * cost["full"]
                if best is None or t < best[0]:
                    best = (t, n_sel, n_full, need)
                break  # more selective blocks only add time once this fits
        if best is None:
            plans.append({"pp_rank": r, "layers": n, "plan": None})
        else:
            t, n_sel, n_full, need = best
            plans.append({"pp_rank": r, "layers": n,
                          "plan": {"none": n - n_sel - n_full, "selective": n_sel, "full": n_full},
                          "recompute_s_per_microbatch": t, "required_bytes": need})
    return plans
