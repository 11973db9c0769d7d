"""Step time and per-rank memory of each parallel layout on CPU (gloo).

Every layout trains the same small LLaMA on the same global batch; the
single-process run is measured in the same invocation, and each layout's
step time is reported next to it as a ratio. Per-rank memory is the bytes
of parameters, gradients and AdamW states each rank holds after a step
(rank 0 and the maximum over ranks), plus the peak RSS of the process.

    PYTHONPATH=. python benchmarks/parallel_cpu.py [--steps 6] [--out benchmarks/results/parallel.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

MODEL = ["model.arch=llama", "model.hidden_size=128", "model.num_layers=4", "model.num_heads=8",
         "model.num_kv_heads=4", "model.ffn_hidden_size=384", "model.vocab_size=2048",
         "model.max_seq_len=256"]
TRAIN = ["train.seq_len=128", "train.global_batch_size=8", "train.micro_batch_size=2",
         "optim.warmup_steps=0", "optim.schedule=constant", "precision=fp32"]

# Not a config key: the same layout with gradient buckets reduced after
# backward instead of from inside it, the baseline of the overlap.
NO_OVERLAP = "no-overlap"

LAYOUTS = {
    2: [["parallel.dp=2", "parallel.zero=0"], ["parallel.dp=2", "parallel.zero=0", NO_OVERLAP],
        ["parallel.dp=2", "parallel.zero=1"],
        ["parallel.dp=2", "parallel.zero=2"], ["parallel.dp=2", "parallel.zero=3"],
        ["parallel.tp=2"], ["parallel.tp=2", "parallel.sp=true"], ["parallel.cp=2"]],
    4: [["parallel.dp=4", "parallel.zero=3", "parallel.shard_group_size=2"],
        ["parallel.dp=2", "parallel.tp=2"], ["parallel.tp=2", "parallel.cp=2"],
        ["parallel.dp=4", "parallel.zero=1"], ["parallel.dp=4", "parallel.zero=3"]],
}


def _config(overrides):
    from giantmodel.config import load_config

    return load_config(overrides=MODEL + TRAIN + list(overrides))


def _batch(cfg, data_rank, data_world):
    G, T, V = cfg.train.global_batch_size, cfg.train.seq_len, cfg.model.vocab_size
    seq = torch.randint(0, V, (G, T + 1), generator=torch.Generator().manual_seed(0))
    per = G // data_world
    ids, labels = seq[:, :-1][data_rank * per:(data_rank + 1) * per], seq[:, 1:][data_rank * per:(data_rank + 1) * per]
    m = cfg.train.micro_batch_size
    return [{"input_ids": ids[i:i + m], "labels": labels[i:i + m]} for i in range(0, per, m)]


def _state_bytes(engine, opt) -> int:
    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    params = list(engine.parameters())
    total = sum(local(p) for p in params) + sum(local(p.grad) for p in params if p.grad is not None)
    return total + sum(local(v) for s in opt.state.values() for k, v in s.items() if k != "step")


def measure(overrides, steps):
    """Time ``steps`` optimizer steps (after one warm-up) in this process group."""
    import layout_harness as H
    import torch.distributed as dist

    from giantmodel.core.precision import Precision
    from giantmodel.distributed.parallel_dims import ParallelDims

    cfg = _config([o for o in overrides if o != NO_OVERLAP])
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.from_config(cfg, world)
    if world > 1:
        dims.build_mesh("cpu")
    engine = H.build_engine(cfg, dims)
    opt = engine.build_optimizer(cfg.optim)
    if NO_OVERLAP in overrides:
        engine.strategy.overlap = False  # reduce every bucket after backward
    precision = Precision("fp32", "cpu")
    mbs = _batch(cfg, engine.data_rank, engine.data_world)
    times, states = [], 0
    for step in range(steps + 1):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        engine.forward_backward(mbs, precision)
        engine.clip_grad_norm_(1.0)
        engine.optimizer_step(opt)
        if step == steps:
            states = _state_bytes(engine, opt)
        engine.zero_grad(opt)
        if step:
            times.append(time.perf_counter() - t0)
    if world > 1:
        dims.destroy_mesh()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_s": statistics.median(times), "state_bytes": states, "rss": rss}


def _rank_main(rank, world, layouts, steps):
    return [measure(o, steps) for o in layouts]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="benchmarks/results/parallel.md")
    args = ap.parse_args(argv)
    from giantmodel.testing import run_ranks

    torch.set_num_threads(1)
    base = measure([], args.steps)
    rows = [("single process", 1, base, base["state_bytes"])]
    for world, layouts in LAYOUTS.items():
        per_rank = run_ranks(_rank_main, world, layouts, args.steps, timeout=1200)
        for i, o in enumerate(layouts):
            r0 = per_rank[0][i]
            step = max(r[i]["step_s"] for r in per_rank)
            rows.append((" ".join(x.replace("parallel.", "") for x in o), world,
                         {**r0, "step_s": step}, max(r[i]["state_bytes"] for r in per_rank)))
    lines = [
        "# Parallel layouts on CPU (gloo)",
        "",
        (f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
         f"{torch.get_num_threads()} thread/rank, torch {torch.__version__}, "
         f"python {platform.python_version()}; model {' '.join(MODEL)}; {' '.join(TRAIN)}; "
         f"median of {args.steps} steps after one warm-up. Model states = params + grads + "
         "AdamW states held by one rank after a step. Step time is the slowest rank's."),
        "",
        "| layout | ranks | step (s) | vs 1 process | model states rank 0 (MiB) | max over ranks (MiB) | peak RSS rank 0 (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, world, r, mx in rows:
        lines.append(f"| {name} | {world} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f}x | "
                     f"{r['state_bytes'] / 2**20:.2f} | {mx / 2**20:.2f} | {r['rss'] / 2**20:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(
        [{"layout": n, "ranks": w, **r, "max_state_bytes": mx} for n, w, r, mx in rows], indent=1))


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "tests")]  # the layout harness lives with the tests
    main()
