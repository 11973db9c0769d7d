"""ZeRO-1 on more ranks than whole parameters can balance: the flat buffers
against FSDP2's dim-0 shards, which the engine now picks there.

Four gloo ranks train a LLaMA whose 32k-token embedding and head (8.2 M
elements each) outweigh its two blocks (0.8 M each), at dp 4 with ZeRO-1:
whole-parameter ownership gives the embedding to one rank, the head to
another and a block to each of the rest, and pads every owner's chunk to the
embedding's size. One launch runs the flat buffers (the strategy the engine
used before, forced), another the engine's own choice; each reports per rank
the bytes its data-parallel strategy holds, the peak RSS, the median step
time and the losses, which must agree.

    PYTHONPATH=. python benchmarks/zero_padding.py [--steps 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from giantmodel.config import load_config  # noqa: E402
from giantmodel.testing import run_ranks  # noqa: E402

OVERRIDES = ["data.source=synthetic", "model.arch=llama", "model.hidden_size=256",
             "model.num_layers=2", "model.num_heads=4", "model.ffn_hidden_size=688",
             "model.vocab_size=32000", "train.seq_len=128", "train.global_batch_size=16",
             "train.micro_batch_size=2", "parallel.dp=4", "parallel.zero=1"]


def _strategy_bytes(strategy) -> int:
    """Parameters and gradients the strategy holds after a step (FSDP2: its
    shards; the gathered copies live only inside the step, in the peak RSS)."""
    from giantmodel.core.tensors import local_tensor, unique_params

    if hasattr(strategy, "buffer_bytes"):
        return sum(strategy.buffer_bytes().values())
    return sum(local_tensor(p).numel() * p.element_size() * (2 if p.grad is not None else 1)
               for p in unique_params(strategy.parts))


def _run(rank, world, force_flat: bool, steps: int):
    from giantmodel.core.precision import Precision
    from giantmodel.core.tensors import local_tensor
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.objectives import LanguageModel
    from giantmodel.parallel.engine import TrainEngine
    from giantmodel.parallel.zero import OwnZero

    torch.set_num_threads(1)
    cfg = load_config(None, OVERRIDES)
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    objective = LanguageModel(cfg.model, data=cfg.data, train=cfg.train)
    forced = (OwnZero(dims, zero=1, group=dims.group("dp_cp"),
                      bucket_bytes=int(cfg.parallel.bucket_mb * 2**20)) if force_flat else None)
    engine = TrainEngine(objective, dims, torch.device("cpu"), parallel=cfg.parallel,
                         recompute=cfg.recompute, offload=cfg.offload, compile=False,
                         precision=cfg.precision, bucket_mb=cfg.parallel.bucket_mb,
                         strategy=forced)
    loader, _ = objective.build_loaders(dp_rank=engine.data_rank, dp_size=engine.data_world)
    n_micro = dims.microbatches(cfg.train)
    precision = Precision(cfg.precision, "cpu")
    opt = engine.build_optimizer(cfg.optim)
    losses, times = [], []
    for _ in range(steps):
        batches = [next(loader) for _ in range(n_micro)]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        losses.append(engine.forward_backward(batches, precision))
        engine.clip_grad_norm_(cfg.optim.grad_clip)
        engine.optimizer_step(opt)
        times.append(time.perf_counter() - t0)
        held = _strategy_bytes(engine.strategy)
        engine.zero_grad(opt)
    optim_bytes = sum(local_tensor(t).numel() * t.element_size() for st in opt.state.values()
                      for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    dims.destroy_mesh()
    return {"strategy": type(engine.strategy).__name__, "held_mb": held / 2**20,
            "optimizer_mb": optim_bytes / 2**20,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "step_s": statistics.median(times[1:]), "losses": losses}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = {}
    for label, force in (("flat buffers (forced)", True), ("engine's choice", False)):
        ranks = run_ranks(_run, 4, force, args.steps, timeout=600)
        out[label] = ranks
        print(f"{label}: {ranks[0]['strategy']}")
        for r, x in enumerate(ranks):
            print(f"  rank {r}: params+grads {x['held_mb']:7.1f} MiB, optimizer "
                  f"{x['optimizer_mb']:6.1f} MiB, peak RSS {x['peak_rss_mb']:7.1f} MiB, "
                  f"step {x['step_s'] * 1000:6.1f} ms")
    a, b = (out[k][0]["losses"] for k in out)
    diff = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    print(f"losses: {a[-1]:.6f} / {b[-1]:.6f} after {args.steps} steps, max rel. diff {diff:.1e}")
    peak = [max(x["peak_rss_mb"] for x in out[k]) for k in out]
    print(f"largest rank's peak RSS: {peak[0]:.0f} -> {peak[1]:.0f} MiB ({peak[1] / peak[0]:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
