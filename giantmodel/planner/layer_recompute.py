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


class _Room:
    """Bytes one pipeline rank needs with ``n_sel`` selective and ``n_full``
    full blocks (the rest as they are)."""

    def __init__(self, required, held, save_sel, save_full, acts):
        self.required, self.held = required, held
        self.save_sel, self.save_full, self.acts = save_sel, save_full, acts

    def need(self, n_sel: int, n_full: int) -> float:
        a = self.acts
        # one block's re-created tensors live during its backward
        rerun = a["none"] if n_full else a["none"] - a["selective"] if n_sel else 0.0
        return (self.required
                - (n_sel * self.save_sel + n_full * self.save_full) * (1 + FRAGMENTATION)
                + (1 + FRAGMENTATION) * max(0.0, rerun - self.held))


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
        required, held = base.required, base.components["backward_transient"]
        save_sel = inflight * (acts["none"] - acts["selective"]) + weights
        save_full = inflight * (acts["none"] - acts["full"]) + weights
        best = None
        room = _Room(required, held, save_sel, save_full, acts)
        for n_full in range(n + 1):
            # the fewest selective blocks that fit next to n_full full ones
            lo, hi = 0, n - n_full
            if room.need(hi, n_full) > hw.memory_bytes:
                continue
            while lo < hi:   # need() falls as n_sel grows (each block frees save_sel)
                mid = (lo + hi) // 2
                if room.need(mid, n_full) <= hw.memory_bytes:
                    hi = mid
                else:
                    lo = mid + 1
            t = lo * cost["selective"] + n_full * cost["full"]
            if best is None or t < best[0]:
                best = (t, lo, n_full, room.need(lo, n_full))
        if best is None:
            plans.append({"pp_rank": r, "layers": n, "plan": None})
        else:
            t, n_sel, n_full, req = best
            plans.append({"pp_rank": r, "layers": n,
                          "plan": {"none": n - n_sel - n_full, "selective": n_sel, "full": n_full},
                          "recompute_s_per_microbatch": t, "required_bytes": req})
    return plans
