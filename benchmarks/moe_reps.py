"""Side-by-side timing shared by the MoE benchmarks (moe_layer.py,
moe_ep_deepspeed.py): every rep runs each system once, in an order that
reverses every other rep, so that all of them see the same host load; and
the table both print."""

from __future__ import annotations

from collections.abc import Callable

# --dtype names -> torch dtype names
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def difference(a, b) -> float:
    """How far ``a`` is from ``b``: max |a - b| in fp32, |a - b| / |b|
    (norms) in a 2-byte dtype, where bf16 rounding (and routing on bf16
    logits) makes an element-wise bound meaningless."""
    import torch

    exact = a.dtype == torch.float32
    a, b = a.double(), b.double()
    return (a - b).abs().max().item() if exact else ((a - b).norm() / b.norm()).item()


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


def print_table(res: dict) -> None:
    """Each layer's median seconds, tokens/s and giantmodel's ratio over it
    (``res``: median_s, tokens_per_s, ratio_vs by layer name)."""
    print(f"{'layer':<16}{'median s':>10}{'tokens/s':>12}{'giantmodel x':>14}")
    for name, m in res["median_s"].items():
        ratio = res["ratio_vs"].get(name)
        print(f"{name:<16}{m:>10.3f}{res['tokens_per_s'][name]:>12.0f}"
              f"{'' if ratio is None else f'{ratio:.2f}x':>14}")
