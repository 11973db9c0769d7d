"""``giantmodel plot``: training curves of one or more runs from their
``metrics.jsonl``, as a PNG, plus a short summary table on stdout.

matplotlib is an optional extra (``pip install giantmodel[plot]``): it is
imported only when a picture is drawn, and its absence is one error line.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from giantmodel.config.errors import UserInputError

MISSING = "{what} needs matplotlib: pip install matplotlib (or pip install 'giantmodel[plot]')"


def pyplot(what: str = "drawing a picture"):
    """matplotlib.pyplot on the file-only Agg backend (no display needed on a
    cluster's login node); a one-line UserInputError when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise UserInputError(MISSING.format(what=what)) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


# ------------------------------------------------------------------ reading
def read_metrics(run: str | Path) -> tuple[list[dict], list[dict]]:
    """(train rows, validation rows) of a run directory (or a metrics.jsonl
    path), each sorted by step. A resumed run re-logs the steps after its
    last checkpoint: the later record of a step wins, separately for train
    and validation rows (a val_loss row shares its step with a train row)."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise UserInputError(f"{run}: no metrics.jsonl (is it a run directory?)")
    train: dict[int, dict] = {}
    val: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                # a run killed mid-write leaves a torn last line; skip it
                continue
            if not isinstance(row, dict) or "step" not in row:
                continue
            if "val_loss" in row:
                val[int(row["step"])] = row
            elif "loss" in row:
                train[int(row["step"])] = row
    if not train and not val:
        raise UserInputError(f"{path}: no loss records")
    return [train[k] for k in sorted(train)], [val[k] for k in sorted(val)]


def throughput_key(rows: list[dict]) -> str | None:
    """The run's throughput field: tokens_per_sec for LMs, images_per_sec for
    diffusion (the trainer names it after the objective's unit)."""
    for row in rows:
        for k in row:
            if k.endswith("_per_sec"):
                return k
    return None


def ema(values: list[float], factor: float) -> list[float]:
    """Exponential moving average, TensorBoard's convention: ``factor`` is the
    weight of the past (0: no smoothing, 0.9: heavy), debiased so the first
    points are not pulled towards zero."""
    if not 0 <= factor < 1:
        raise UserInputError(f"--smooth must be in [0, 1), got {factor}")
    out, acc = [], 0.0
    for i, v in enumerate(values, 1):
        acc = factor * acc + (1 - factor) * v
        out.append(acc / (1 - factor ** i) if factor else acc)
    return out


def summary(name: str, train: list[dict], val: list[dict]) -> dict:
    key = throughput_key(train)
    losses = [r["loss"] for r in train]
    speeds = [r[key] for r in train if key and key in r]
    # the first record's window includes start-up (compile, warm-up): leave it
    # out of the median when there are others
    speeds = speeds[1:] if len(speeds) > 1 else speeds
    return {"run": name, "steps": max([r["step"] for r in train + val], default=0),
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "best_val_loss": min((r["val_loss"] for r in val), default=None),
            "median_per_sec": statistics.median(speeds) if speeds else None,
            "unit": key[: -len("_per_sec")] if key else "tokens"}


def format_summary(rows: list[dict]) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)
    width = max([len(r["run"]) for r in rows] + [3])
    unit = rows[0]["unit"] if len({r["unit"] for r in rows}) == 1 else "units"
    lines = [f"{'run':<{width}} {'steps':>7} {'first loss':>10} {'last loss':>10} "
             f"{'best val':>10} {'median ' + unit + '/s':>16}"]
    for r in rows:
        lines.append(f"{r['run']:<{width}} {r['steps']:>7} {num(r['first_loss'], '.4f'):>10} "
                     f"{num(r['last_loss'], '.4f'):>10} {num(r['best_val_loss'], '.4f'):>10} "
                     f"{num(r['median_per_sec'], ',.0f'):>16}")
    return "\n".join(lines)


def run_names(runs: list[str]) -> list[str]:
    """Legend labels: each run directory's name, or its full path where two
    runs share a name (run-a/out and run-b/out)."""
    names = [Path(r).resolve().name if Path(r).is_dir() else Path(r).resolve().parent.name
             for r in runs]
    return [n if names.count(n) == 1 else str(r) for n, r in zip(names, runs)]


# ------------------------------------------------------------------ drawing
def _x(rows: list[dict], train: list[dict], axis: str) -> list[float]:
    """Each row's x: its step, or the tokens (images) seen by then. Validation
    rows carry no count: it is read off the train rows' step -> count line."""
    if axis == "step":
        return [float(r["step"]) for r in rows]
    unit = (throughput_key(train) or "tokens_per_sec")[: -len("_per_sec")]
    known = [(r["step"], r[unit]) for r in train if unit in r]
    if not known:
        raise UserInputError(f"--x tokens: the run's records carry no '{unit}' field; use --x step")
    import numpy as np
    steps, counts = zip(*known)
    return [float(v) for v in np.interp([r["step"] for r in rows], steps, counts)]


def _curve(ax, x, y, smooth: float, color, label: str, **kw) -> None:
    if smooth:
        ax.plot(x, y, color=color, alpha=0.25, linewidth=1, **kw)
        ax.plot(x, ema(y, smooth), color=color, label=label, linewidth=1.6, **kw)
    else:
        ax.plot(x, y, color=color, label=label, linewidth=1.4, **kw)


def plot_runs(runs: list[str], out: str, x_axis: str = "step", smooth: float = 0.0) -> list[dict]:
    """Draw loss / validation loss, throughput, learning rate and grad-norm of
    ``runs`` (overlaid, one colour each) into the PNG ``out``; return each
    run's summary row."""
    plt = pyplot("giantmodel plot")
    ema([], smooth)   # validate the factor before reading anything
    data = [(name, *read_metrics(run)) for name, run in zip(run_names(runs), runs)]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), constrained_layout=True)
    ax_loss, ax_tps, ax_lr, ax_gn = axes.flat
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    unit = "tokens"
    for i, (name, train, val) in enumerate(data):
        c = colors[i % len(colors)]
        key = throughput_key(train)
        unit = key[: -len("_per_sec")] if key else unit
        if train:
            x = _x(train, train, x_axis)
            _curve(ax_loss, x, [r["loss"] for r in train], smooth, c, f"{name} train")
            for ax, field in ((ax_tps, key), (ax_lr, "lr"), (ax_gn, "grad_norm")):
                pts = [(xx, r[field]) for xx, r in zip(x, train) if field and field in r]
                if pts:
                    ax.plot(*zip(*pts), color=c, label=name, linewidth=1.4)
        if val:
            ax_loss.plot(_x(val, train, x_axis), [r["val_loss"] for r in val], color=c,
                         linestyle="--", marker="o", markersize=3.5, label=f"{name} val")
    xlabel = "step" if x_axis == "step" else f"{unit} seen"
    titles = ((ax_loss, "loss", "loss" + (f" (EMA {smooth:g})" if smooth else "")),
              (ax_tps, f"{unit}/s", f"throughput ({unit}/s)"),
              (ax_lr, "learning rate", "learning rate"),
              (ax_gn, "grad norm", "gradient norm (before clipping)"))
    for ax, ylabel, title in titles:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("giantmodel runs: " + ", ".join(name for name, _, _ in data))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [summary(name, train, val) for name, train, val in data]


# ------------------------------------------------------------------ command
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run directories (each holding metrics.jsonl), overlaid in one picture")
    p.add_argument("--out", "-o", default="runs.png", help="PNG to write (default runs.png)")
    p.add_argument("--x", dest="x_axis", choices=("step", "tokens"), default="step",
                   help="x axis: optimizer step or tokens (images) seen (default step)")
    p.add_argument("--smooth", type=float, default=0.0,
                   help="EMA factor for the train loss in [0, 1), e.g. 0.9 (default 0: raw)")


def main(args) -> int:
    rows = plot_runs(args.runs, args.out, args.x_axis, args.smooth)
    print(format_summary(rows))
    print(f"wrote {args.out}")
    return 0
