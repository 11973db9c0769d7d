"""Plot the history of the headline figures that moved run by run.

Reads history.csv (figures transcribed from the dated files in this folder)
and writes history.png beside it: one panel per figure, one line per series,
the claim's target as a dashed line. Runs whose label ends in '*' ran on the
Zen 3 VM of 2026-11-27; the panels mark where that machine starts, since its
figures are not comparable one to one with the earlier VM's.

    python benchmarks/results/plot_history.py [--out PATH]

matplotlib is an optional package, imported only here.
"""

from __future__ import annotations

import argparse
import csv
import pathlib

HERE = pathlib.Path(__file__).resolve().parent

PANELS = {
    "planner_published": ("Planner vs published GPU runs: |error| by model change",
                          "|predicted - published| / published, %"),
    "peers_one_host": ("Tokens/s vs DeepSpeed, one host (2 ranks)", "giantmodel / DeepSpeed"),
    "peers_two_hosts": ("Tokens/s vs DeepSpeed, 2 emulated hosts x 2 ranks, 1 Gbit/s"
                        " (mb4: micro-batch 4; 2MB: 2 MB pieces)",
                        "giantmodel / DeepSpeed"),
}


def read_rows(path: pathlib.Path) -> list[dict[str, str]]:
    with path.open() as f:
        lines = [line for line in f if not line.startswith("#")]
    return list(csv.DictReader(lines))


def draw_panel(ax, rows: list[dict[str, str]], title: str, ylabel: str) -> None:
    runs: list[str] = []
    for row in rows:
        if row["run"] not in runs:
            runs.append(row["run"])
    pos = {run: i for i, run in enumerate(runs)}
    series: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        series.setdefault(row["series"], []).append(row)
    series = dict(sorted(series.items()))  # a series keeps its colour from panel to panel
    for i, (name, points) in enumerate(series.items()):
        line, = ax.plot([pos[p["run"]] for p in points], [float(p["value"]) for p in points],
                        marker="o", markersize=4, label=name)
        target = float(points[0]["target"])
        # One dashed line per distinct target, in the colour of its first series.
        if all(float(s[0]["target"]) != target for s in list(series.values())[:i]):
            ax.axhline(target, linestyle="--", linewidth=1, color=line.get_color(),
                       label=f"target {target:g}")
    zen3 = [pos[r] for r in runs if r.endswith("*")]
    if zen3:
        ax.axvline(min(zen3) - 0.5, color="grey", linewidth=0.8)
        ax.text(min(zen3) - 0.4, ax.get_ylim()[0], " * Zen 3 VM from here", va="bottom",
                fontsize=8, color="grey")
    ax.set_xticks(range(len(runs)), runs, rotation=40, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=pathlib.Path, default=HERE / "history.csv")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "history.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(args.csv)
    names = [name for name in PANELS if any(r["figure"] == name for r in rows)]
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 4.2 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        draw_panel(ax, [r for r in rows if r["figure"] == name], *PANELS[name])
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
