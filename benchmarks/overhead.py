"""Framework overhead: giantmodel's train step vs a minimal hand-written loop.

Both run in this one process, on the same model class, the same batches, the
same AdamW settings and gradient clipping. The hand-written loop is what a
careful user would write with plain PyTorch. Rounds alternate between the two
so drift in machine load hits both alike; the reported figure is the ratio of
median step times (giantmodel / bare). Target: <= 1.10.

    python benchmarks/overhead.py [--rounds 5 --steps 6] [--json out.json] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from giantmodel.config import load_config  # noqa: E402
from giantmodel.models import build_model, init_weights  # noqa: E402
from giantmodel.train.trainer import Trainer  # noqa: E402


def bare_loop(cfg, batches_per_step):
    """The baseline: model, AdamW, forward/backward with accumulation, clip, step."""
    model = init_weights(build_model(cfg.model), cfg.model, seed=cfg.train.seed)
    o = cfg.optim
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)

    def step(microbatches):
        n = sum(mb["labels"].numel() for mb in microbatches)
        for mb in microbatches:
            logits = model(mb["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), mb["labels"].flatten(),
                                   reduction="sum") / n
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def time_steps(fn, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per round and side")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    run_dir = tempfile.mkdtemp(prefix="giantmodel-overhead-")
    cfg = load_config(None, [f"run.dir={run_dir}", "data.source=synthetic", "train.eval_every=0",
                             "checkpoint.every=0", "checkpoint.save_final=false",
                             "checkpoint.resume=false", "run.tensorboard=false",
                             "optim.warmup_steps=0", "train.steps=100000", *args.overrides])
    torch.manual_seed(0)
    trainer = Trainer(cfg)
    # The bare loop gets exactly the batches the trainer's loader produces.
    n_micro = trainer.microbatches
    batches = [[next(trainer.train_loader) for _ in range(n_micro)] for _ in range(4)]
    bare = bare_loop(cfg, n_micro)
    it = iter(range(10**9))

    def bare_step():
        bare(batches[next(it) % len(batches)])

    for _ in range(2):  # warm-up both paths (allocator, thread pools)
        trainer.train_step()
        bare_step()
    ours, base = [], []
    for _ in range(args.rounds):
        ours.append(time_steps(trainer.train_step, args.steps))
        base.append(time_steps(bare_step, args.steps))
    trainer.close()
    result = {
        "model": cfg.model.name, "params": cfg.model.num_params(),
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size, "seq_len": cfg.train.seq_len,
        "threads": torch.get_num_threads(),
        "giantmodel_step_s": statistics.median(ours), "bare_step_s": statistics.median(base),
        "ratio": statistics.median(ours) / statistics.median(base),
        "rounds_giantmodel": ours, "rounds_bare": base,
    }
    print(f"{'path':<12} {'median step':>12}")
    print(f"{'giantmodel':<12} {result['giantmodel_step_s'] * 1e3:>10.1f}ms")
    print(f"{'bare loop':<12} {result['bare_step_s'] * 1e3:>10.1f}ms")
    print(f"ratio giantmodel/bare = {result['ratio']:.3f} (target <= 1.10)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
