"""``train``'s memory preflight, planner side: the planner's peak per rank for
the job, against the memory the rank has, before the model is built.

The trainer cannot import the planner (it sits above train in the layers), so
this module registers :func:`memory_shortfall` with
:mod:`giantmodel.core.memory_hook` when the planner package is imported (the
CLI imports it for every subcommand); the trainer asks the hook.

Margin: the planner's peak-RSS error on a CPU host is -0.1% to +6.4%
(benchmarks/RESULTS.md, planner row: predicted over measured, 8 layouts, 4
runs), so a run is refused only when even the prediction less
:data:`PLANNER_ERROR` exceeds what is available: a refusal is certain to
within the planner's measured error, and a run at the edge is let through.
"""

from __future__ import annotations

import copy
import logging

from giantmodel.config.errors import ConfigError
from giantmodel.core.memory_hook import set_memory_estimator
from giantmodel.planner.hardware import get_profile
from giantmodel.planner.layout import Cluster, resolve_layout
from giantmodel.planner.memory import memory_report

log = logging.getLogger(__name__)

GB = 1e9
PLANNER_ERROR = 0.065
"""The planner's largest measured over-prediction of peak RSS (+6.4%, rounded up)."""


def rank_peak_bytes(cfg, world_size: int, device_type: str) -> float:
    """The planner's peak for the worst rank of ``cfg`` on ``world_size``
    ranks: on a CPU its peak (what RSS shows), on a GPU the peak plus the
    allocator's fragmentation (the CUDA context is already outside the free
    memory the device reports)."""
    hw = get_profile("cpu") if device_type == "cpu" else None
    layout = resolve_layout(cfg, Cluster(1, world_size))
    rank = memory_report(cfg.model, layout, hw).worst
    return rank.peak + (rank.components["fragmentation"] if device_type != "cpu" else 0.0)


def _variants(cfg, world_size: int):
    """(change, config, ranks): the cheap fixes to try, in order of what they
    cost a run: recompute, then ZeRO stages, then more ranks (ZeRO 3 and
    full recompute, the data-parallel degree grown)."""
    def changed(ranks: int = world_size, **kw):
        out = copy.deepcopy(cfg)
        if "recompute" in kw:
            out.recompute, out.recompute_layers = kw["recompute"], None
        if "zero" in kw:
            out.parallel.zero = kw["zero"]
        if ranks != world_size:
            out.parallel.dp = -1
        return out
    for mode in ("selective", "full"):
        if cfg.recompute != mode:
            yield f"recompute={mode}", changed(recompute=mode), world_size
    for zero in (1, 2, 3):
        if cfg.parallel.zero < zero:
            yield f"parallel.zero={zero}", changed(zero=zero), world_size
    ranks = world_size
    for _ in range(10):
        ranks *= 2
        yield (f"{ranks} ranks with parallel.zero=3 recompute=full",
               changed(ranks, recompute="full", zero=3), ranks)


def cheapest_fixes(cfg, world_size: int, device_type: str, available: float,
                   limit: int = 3) -> list[str]:
    """Up to ``limit`` changes under which the planner's peak per rank fits
    ``available`` bytes (the same per rank, as more hosts would bring)."""
    out: list[str] = []
    more_ranks = False
    for change, variant, ranks in _variants(cfg, world_size):
        if more_ranks and ranks > world_size:
            continue   # one suggestion of more ranks: the fewest
        try:
            peak = rank_peak_bytes(variant, ranks, device_type)
        except ConfigError:
            continue   # the layout does not divide (batch, heads) on that many ranks
        if peak * (1 - PLANNER_ERROR) <= available:
            out.append(f"{change} ({peak / GB:.1f} GB per rank)")
            more_ranks = more_ranks or ranks > world_size
        if len(out) == limit:
            break
    return out


def memory_shortfall(cfg, world_size: int, device_type: str, available: float,
                     where: str) -> str | None:
    """One line when ``cfg`` cannot fit ``available`` bytes per rank
    (``where`` says whose memory that is), else None. Configs the planner
    does not model (Stable Diffusion, MoE) and any failure of the planner
    itself give None: the check must never stop a run it cannot judge."""
    if cfg.objective == "diffusion" or getattr(cfg.model, "moe", None) is not None:
        return None
    try:
        peak = rank_peak_bytes(cfg, world_size, device_type)
        if peak * (1 - PLANNER_ERROR) <= available:
            return None
        fixes = cheapest_fixes(cfg, world_size, device_type, available)
    except Exception as e:   # noqa: BLE001 - a preflight never crashes a run
        log.debug("memory preflight skipped: %s", e)
        return None
    fix = ("; fits with " + ", or ".join(fixes)) if fixes else "; no cheap change fits"
    return (f"{cfg.model.name} needs about {peak / GB:.1f} GB per rank (the planner's peak, "
            f"measured within -0.1%/+6.4% of peak RSS) but {available / GB:.1f} GB are "
            f"available ({where}){fix}; train.memory_check=false skips this check")


def register() -> None:
    """Hand :func:`memory_shortfall` to the trainer's preflight."""
    set_memory_estimator(memory_shortfall)
