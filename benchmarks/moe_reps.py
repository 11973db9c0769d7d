"""Side-by-side timing shared by the MoE benchmarks (moe_layer.py,
moe_ep_deepspeed.py): every rep runs each system once, in an order that
reverses every other rep, so that all of them see the same host load."""

from __future__ import annotations

from collections.abc import Callable


def alternating_reps(names: list[str], reps: int, warmup: int,
                     run: Callable[[str], float]) -> dict[str, list[float]]:
    """``run(name)`` times one rep of ``name`` (seconds); returns each name's
    ``reps`` times after ``warmup`` untimed reps, in rep order."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            t = run(name)
            if rep >= warmup:
                times[name].append(t)
    return times
