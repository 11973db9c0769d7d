"""Fused q|k|v and gate|up projections against per-linear calls, side by side.

The same 4-layer LLaMA (hidden 512, 8 heads, 4 KV heads, SwiGLU ffn 1408,
vocab 4096, seq 512, two micro-batches of 1 per step, AdamW) trains in two
variants:

* ``fused`` (what the code does since ddd5fe8): one GEMM for wq/wk/wv and
  one for w1/w3 (``giantmodel.models.common.fused``), the weights cast once
  per step, and under tensor parallelism the sequence-parallel projector
  (``giantmodel.parallel.sp_linear``) that saves the sharded input;
* ``unfused`` (the path before it), by patching:
  ``layers.project`` and ``layers.local_project`` call each linear on its
  own (``[m(x) for m in linears]``, each ``nn.Linear`` under autocast), and
  ``tensor._projected`` returns nothing, so tensor parallelism applies the
  DTensor plan (``PrepareModuleInput`` + colwise linears) as before. The
  rest of ddd5fe8 (the norms saving x and rstd, the gated activation, the
  residual stream in the compute dtype) is in both.

Cells: tp1 (one process), tp2 and tp2 + sp (two gloo ranks, through
``giantmodel.testing.run_ranks``), each in bf16 (CPU autocast) and fp32.
Each rep runs every cell in two modes:

* ``interleaved``: both variants built in one process group from the same
  weights, stepping in turn (the order swapped every step), the patches
  applied around the unfused model's build and steps only; each pair of
  steps sees the same host load, so this is the figure to read on a shared
  host;
* ``process``: each variant in processes of its own, back to back, the
  order swapped every rep (AB, BA, ...), the patches holding for the
  unfused variant's whole process.

A cell's ratio is the median over reps of fused / unfused step time (each
rep's ratio of its median steps; below 1 is faster), with the per-rep range
and the ratio of the fastest steps. A step is one optimizer step (both
micro-batches, clipping, AdamW); under tp, the slowest rank's.

Memory (``process`` mode, rank 0): the rank's peak RSS (forked from a
server that imported torch, so the import is in both), and what one more,
untimed, micro-batch's forward and loss save for backward
(``saved_tensors_hooks``, counted once per storage, parameters' own
excluded), split into activations and weight copies (casts of a
parameter made in that forward, seen by a dispatch mode: autocast's
per-linear casts), next to the casts the
fused path keeps on its modules through the step instead (held as long,
though not saved tensors). The losses of the two variants are compared
step by step (same weights and tokens).

    PYTHONPATH=. python benchmarks/fused_projections.py [--reps 5] [--steps 4] \\
        [--layouts tp1,tp2,tp2-sp] [--precisions bf16,fp32] [--modes interleaved,process] \\
        [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import time
from datetime import datetime, timezone

MODEL = ["model.arch=llama", "model.hidden_size=512", "model.num_layers=4", "model.num_heads=8",
         "model.num_kv_heads=4", "model.ffn_hidden_size=1408", "model.vocab_size=4096",
         "model.max_seq_len=512", "model.tie_embeddings=false"]
TRAIN = ["train.seq_len=512", "train.global_batch_size=2", "train.micro_batch_size=1",
         "optim.warmup_steps=0", "optim.schedule=constant", "optim.lr=1e-3"]
LAYOUTS = {"tp1": [], "tp2": ["parallel.tp=2"], "tp2-sp": ["parallel.tp=2", "parallel.sp=true"]}
VARIANTS = ("unfused", "fused")


@contextlib.contextmanager
def unfused():
    """The path before the fused projections while the block runs (for
    ``tensor._projected``: while the model is built)."""
    from giantmodel.models.common import layers
    from giantmodel.parallel import tensor

    per_linear = {"project": lambda module, x, linears: [m(x) for m in linears],
                  "local_project": lambda x, owner, linears: [m(x) for m in linears]}
    # layers imports local_project only while wo and w2 call it (ddd5fe8)
    kept = {n: getattr(layers, n) for n in per_linear if hasattr(layers, n)}
    kept_projected = tensor._projected
    for n in kept:
        setattr(layers, n, per_linear[n])
    tensor._projected = lambda block: ()
    try:
        yield
    finally:
        for n, f in kept.items():
            setattr(layers, n, f)
        tensor._projected = kept_projected


def _variant(name: str):
    return unfused() if name == "unfused" else contextlib.nullcontext()


def _config(layout: str, precision: str):
    from giantmodel.config import load_config

    return load_config(overrides=MODEL + TRAIN + LAYOUTS[layout] + [f"precision={precision}"])


def _microbatches(cfg, step: int) -> list[dict]:
    import torch

    G, T, V = cfg.train.global_batch_size, cfg.train.seq_len, cfg.model.vocab_size
    seq = torch.randint(0, V, (G, T + 1), generator=torch.Generator().manual_seed(step))
    m = cfg.train.micro_batch_size
    return [{"input_ids": seq[i:i + m, :-1], "labels": seq[i:i + m, 1:]} for i in range(0, G, m)]


def _plain(t) -> list:
    """The plain tensors under a wrapper subclass (a DTensor's local shard,
    a functional collective's pending result)."""
    import torch

    if not isinstance(t, torch.Tensor):
        return []
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _plain(getattr(t, n))]
    return [t]


def _saved_bytes(engine, mbs, precision) -> dict:
    """Bytes saved for backward by one micro-batch's forward (and its loss),
    once per storage, parameters' own storages excluded: ``activations``,
    and ``weight_copies`` (casts of a parameter made in this forward:
    autocast's, per linear); and ``kept_casts``, the casts the fused path
    keeps on its modules through the step (fused.cast_weight), which are
    not saved tensors but are held as long."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    params = {x.untyped_storage().data_ptr() for p in engine.parameters() for x in _plain(p)}
    copies: set[int] = set()
    seen: dict[int, tuple[int, bool]] = {}

    def ptrs(tree) -> set[int]:
        return {x.untyped_storage().data_ptr() for t in tree_leaves(tree) for x in _plain(t)}

    class Casts(TorchDispatchMode):
        """Notes the storages that ``_to_copy`` makes of a parameter's, and
        forgets one whose address a later op's new output takes (a
        temporary cast freed, its memory reused)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made = ptrs(out) - ptrs((args, kwargs))   # views share their input's
            if func is torch.ops.aten._to_copy.default and ptrs(args[0]) & params:
                copies.update(made)
            else:
                copies.difference_update(made)
            return out

    def pack(t):
        for x in _plain(t):
            s = x.untyped_storage()
            if s.data_ptr() not in params and s.nbytes():
                # classified now: backward frees the casts and reuses their memory
                seen[s.data_ptr()] = (s.nbytes(), s.data_ptr() in copies)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Casts():
        engine.forward_backward(mbs[:1], precision)
    kept = {id(c[1]): c[1] for part in engine.parts for m in part.modules()
            if (c := m.__dict__.get("_compute_weight")) is not None}
    return {"activations": sum(n for n, copy in seen.values() if not copy),
            "weight_copies": sum(n for n, copy in seen.values() if copy),
            "kept_casts": sum(t.untyped_storage().nbytes() for t in kept.values())}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _setup(layout: str, precision: str, world: int):
    import torch

    from giantmodel.core.precision import Precision
    from giantmodel.distributed.parallel_dims import ParallelDims

    cfg = _config(layout, precision)
    dims = ParallelDims.from_config(cfg, world)
    if world > 1:
        dims.build_mesh("cpu")
    return cfg, dims, Precision(cfg.precision, "cpu"), torch.device("cpu")


def _build(cfg, dims, device):
    """Engine and optimizer, the same initial weights every time."""
    import torch

    from giantmodel.objectives import LanguageModel
    from giantmodel.train.trainer import build_engine

    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, LanguageModel(cfg.model, data=cfg.data, train=cfg.train), dims,
                          device)
    return engine, engine.build_optimizer(cfg.optim)


def _timed_step(engine, opt, prec, mbs, world: int) -> tuple[float, float]:
    """One optimizer step: (seconds, loss)."""
    import torch.distributed as dist

    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    loss = float(engine.forward_backward(mbs, prec))
    engine.clip_grad_norm_(1.0)
    engine.optimizer_step(opt)
    engine.zero_grad(opt)
    return time.perf_counter() - t0, loss


def _rank_process(rank: int, world: int, variant: str, layout: str, precision: str,
                  steps: int) -> dict:
    """One variant in this process: step times, losses, memory."""
    with _variant(variant):
        start_rss = _rss_mib()
        cfg, dims, prec, device = _setup(layout, precision, world)
        engine, opt = _build(cfg, dims, device)
        times, losses = [], []
        for step in range(steps + 1):
            dt, loss = _timed_step(engine, opt, prec, _microbatches(cfg, step), world)
            losses.append(loss)
            if step:
                times.append(dt)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # of the steps
        saved = _saved_bytes(engine, _microbatches(cfg, steps + 1), prec)
        engine.zero_grad(opt)
        if world > 1:
            dims.destroy_mesh()
    return {"times": times, "losses": losses, "saved": saved, "start_rss_mib": start_rss,
            "peak_rss_mib": peak}


def _rank_interleaved(rank: int, world: int, layout: str, precision: str, steps: int) -> dict:
    """Both variants in this process, from the same weights, stepping in
    turn (the order swapped every step), so each pair of steps sees the
    same host load."""
    cfg, dims, prec, device = _setup(layout, precision, world)
    built = {}
    for v in VARIANTS:
        with _variant(v):
            built[v] = _build(cfg, dims, device)
    times: dict = {v: [] for v in VARIANTS}
    losses: dict = {v: [] for v in VARIANTS}
    for step in range(steps + 1):
        for v in VARIANTS if step % 2 == 0 else VARIANTS[::-1]:
            with _variant(v):
                dt, loss = _timed_step(*built[v], prec, _microbatches(cfg, step), world)
            losses[v].append(loss)
            if step:
                times[v].append(dt)
    if world > 1:
        dims.destroy_mesh()
    return {"times": times, "losses": losses}


def _ranks(fn, layout: str, *args) -> list:
    from giantmodel.testing import run_ranks

    world = 2 if layout.startswith("tp2") else 1
    return run_ranks(fn, world, *args, backend="gloo" if world > 1 else None, timeout=900,
                     start="forkserver")


def _slowest(per_rank: list[list[float]]) -> list[float]:
    """Step by step, the slowest rank's time."""
    return [max(ts) for ts in zip(*per_rank)]


def run_process(variant: str, layout: str, precision: str, steps: int) -> dict:
    """One variant in processes of its own (``layout``'s ranks), started for
    this run only; rank 0's figures, the slowest rank's step times."""
    per_rank = _ranks(_rank_process, layout, variant, layout, precision, steps)
    times = _slowest([r["times"] for r in per_rank])
    return {**per_rank[0], "times": times, "step_s": statistics.median(times)}


def run_interleaved(layout: str, precision: str, steps: int) -> dict:
    per_rank = _ranks(_rank_interleaved, layout, layout, precision, steps)
    out = {v: {"times": _slowest([r["times"][v] for r in per_rank]),
               "losses": per_rank[0]["losses"][v]} for v in VARIANTS}
    for v in VARIANTS:
        out[v]["step_s"] = statistics.median(out[v]["times"])
    return out


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.3f}-{max(xs):.3f}"


def summarise(runs: dict, memory: bool) -> list[dict]:
    """Per cell: the median over reps of fused / unfused step time (each
    rep's ratio of its median steps), the per-rep range, the ratio of the
    fastest steps; with ``memory``, rank 0's saved bytes and peak RSS."""
    rows = []
    for cell, reps in runs.items():
        layout, precision = cell.split("/")
        ratios = [r["fused"]["step_s"] / r["unfused"]["step_s"] for r in reps]
        fastest = {v: min(t for r in reps for t in r[v]["times"]) for v in VARIANTS}
        first = reps[0]
        row = {"layout": layout, "precision": precision, "ratio": statistics.median(ratios),
               "ratios": ratios, "fastest_ratio": fastest["fused"] / fastest["unfused"],
               "step_s": {v: statistics.median(r[v]["step_s"] for r in reps) for v in VARIANTS},
               "loss_gap": max(abs(a - b) for a, b in zip(first["fused"]["losses"],
                                                          first["unfused"]["losses"])),
               "loss_end": first["fused"]["losses"][-1]}
        if memory:
            row["saved_mib"] = {v: {k: b / 2 ** 20 for k, b in first[v]["saved"].items()}
                                for v in VARIANTS}
            row["peak_rss_mib"] = {v: statistics.median(r[v]["peak_rss_mib"] for r in reps)
                                   for v in VARIANTS}
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    memory = "saved_mib" in rows[0]
    head = ("| cell | step s unfused / fused | fused / unfused, median (per-rep range) "
            "| fastest step fused / unfused | max loss gap |")
    if memory:
        head += (" activations saved MiB, unfused / fused (ratio) | weight copies saved "
                 "+ kept MiB, unfused / fused | peak RSS MiB, unfused / fused |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        t = r["step_s"]
        line = (f"| {r['layout']} {r['precision']} | {t['unfused']:.3f} / {t['fused']:.3f} "
                f"| **{r['ratio']:.3f}x** ({_spread(r['ratios'])}) | {r['fastest_ratio']:.3f}x "
                f"| {r['loss_gap']:.1e} |")
        if memory:
            s, p = r["saved_mib"], r["peak_rss_mib"]
            a = {v: s[v]["activations"] for v in VARIANTS}
            w = {v: f"{s[v]['weight_copies']:.1f} + {s[v]['kept_casts']:.1f}" for v in VARIANTS}
            line += (f" {a['unfused']:.1f} / {a['fused']:.1f} ({a['fused'] / a['unfused']:.2f}x) "
                     f"| {w['unfused']} / {w['fused']} | {p['unfused']:.0f} / {p['fused']:.0f} |")
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per process (after one)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--precisions", default="bf16,fp32")
    ap.add_argument("--modes", default="interleaved,process",
                    help="interleaved: both variants in one process, step by step; "
                         "process: each variant in processes of its own (and memory)")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args(argv)
    cells = [(lay, p) for lay in args.layouts.split(",") for p in args.precisions.split(",")]
    modes = args.modes.split(",")
    runs = {m: {f"{lay}/{p}": [] for lay, p in cells} for m in modes}
    load_start, t_start = os.getloadavg(), time.time()
    for rep in range(args.reps):
        for lay, p in cells:
            for mode in modes:
                if mode == "interleaved":
                    out = run_interleaved(lay, p, args.steps)
                else:
                    order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
                    out = {v: run_process(v, lay, p, args.steps) for v in order}
                runs[mode][f"{lay}/{p}"].append(out)
                print(f"rep {rep} {lay} {p} {mode}: " + ", ".join(
                    f"{v} {out[v]['step_s']:.3f} s" for v in VARIANTS), flush=True)
    import torch

    print(f"\n{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}; {' '.join(MODEL)}; {' '.join(TRAIN)}; one thread per rank; "
          f"{args.reps} reps x {args.steps} steps; load average {load_start[0]:.2f} -> "
          f"{os.getloadavg()[0]:.2f}; {time.time() - t_start:.0f} s")
    rows = {m: summarise(runs[m], memory=m == "process") for m in modes}
    for m in modes:
        print(f"\n{m}:\n" + format_table(rows[m]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "runs": runs, "load": [load_start, os.getloadavg()],
                       "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
