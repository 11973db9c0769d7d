"""Framework overhead: giantmodel's train step vs a minimal hand-written loop.

Both run in this one process, on the same model class, the same batches, the
same AdamW settings and gradient clipping. The hand-written loop is what a
careful user would write with plain PyTorch. Rounds alternate between the two
so drift in machine load hits both alike; the reported figure is the ratio of
median step times (giantmodel / bare). Target: <= 1.05.

``--flat-vs-cat`` adds a second row at dp=2 (two gloo ranks): the engine's
flat gradient buffer (buckets are slices, reduced in place) against the
earlier design, written out below as :class:`CatCopyReducer`, which
concatenates each bucket's gradients, all-reduces the copy and copies the
result back, every step. Same model, batches and buckets, rounds alternating.

    python benchmarks/overhead.py [--rounds 5 --steps 6] [--flat-vs-cat] [--json out.json] [KEY=VALUE ...]
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
from giantmodel.core.tensors import local_tensor, unique_params  # noqa: E402
from giantmodel.models import build_model, init_weights  # noqa: E402
from giantmodel.parallel.strategy import NoDataParallel  # noqa: E402
from giantmodel.testing import run_ranks  # noqa: E402
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
    ap.add_argument("--flat-vs-cat", action="store_true",
                    help="also time the flat gradient buffer against cat/copy buckets at dp=2")
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
    print(f"ratio giantmodel/bare = {result['ratio']:.3f} (target <= 1.05)")
    if args.flat_vs_cat:
        flat, cat = run_ranks(_flat_vs_cat, 2, args.rounds, args.steps, args.overrides,
                              timeout=1800)[0]
        result["dp2_flat_step_s"], result["dp2_cat_copy_step_s"] = flat, cat
        result["dp2_flat_over_cat_copy"] = flat / cat
        print(f"dp=2 zero 0: flat buffer {flat * 1e3:.1f}ms, cat/copy {cat * 1e3:.1f}ms, "
              f"ratio {flat / cat:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


class CatCopyReducer(NoDataParallel):
    """The bucketed all-reduce the flat buffer replaced: gradients live in
    their own tensors; each full bucket is concatenated into a new tensor
    from inside backward, all-reduced asynchronously, and copied back after."""

    def __init__(self, dims, group, bucket_bytes: int):
        super().__init__(dims)
        self.group, self.bucket_bytes = group, bucket_bytes

    def attach(self, parts) -> None:
        super().attach(parts)
        self.buckets, size = [], 0
        for p in reversed(unique_params(parts)):
            nbytes = local_tensor(p).numel() * p.element_size()
            if self.buckets and size + nbytes <= self.bucket_bytes:
                self.buckets[-1].append(p)
                size += nbytes
            else:
                self.buckets.append([p])
                size = nbytes
        self.bucket_of = {id(p): b for b, ps in enumerate(self.buckets) for p in ps}
        for ps in self.buckets:
            for p in ps:
                p.register_post_accumulate_grad_hook(self._on_grad)
        self.armed = False

    def before_backward(self, last_microbatch: bool) -> None:
        self.armed = last_microbatch
        self.pending = [len(ps) for ps in self.buckets]
        self.next, self.inflight = 0, []

    def _on_grad(self, p) -> None:
        if not self.armed:
            return
        self.pending[self.bucket_of[id(p)]] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            grads = [p.grad for p in self.buckets[self.next]]
            flat = torch.cat([g.reshape(-1) for g in grads])
            work = torch.distributed.all_reduce(flat, group=self.group, async_op=True)
            self.inflight.append((work, flat, grads))
            self.next += 1

    @torch.no_grad()
    def finish(self) -> None:
        for work, flat, grads in self.inflight:
            work.wait()
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self.armed = False


def _flat_vs_cat(rank, world, rounds, steps, overrides):
    """Median step time of the flat-buffer engine and the cat/copy one (dp=2, zero 0)."""
    from giantmodel.core.precision import Precision
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.objectives import LanguageModel
    from giantmodel.parallel.engine import TrainEngine

    torch.set_num_threads(1)
    cfg = load_config(None, ["data.source=synthetic", "parallel.dp=2", "parallel.zero=0",
                             *overrides])
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    kw = dict(parallel=cfg.parallel, recompute=cfg.recompute, offload=cfg.offload,
              compile=False, precision=cfg.precision, bucket_mb=cfg.parallel.bucket_mb)
    objective = LanguageModel(cfg.model, data=cfg.data, train=cfg.train)
    flat = TrainEngine(objective, dims, torch.device("cpu"), **kw)
    cat = TrainEngine(objective, dims, torch.device("cpu"), **kw,
                      strategy=CatCopyReducer(dims, dims.group("dp_cp"),
                                              int(cfg.parallel.bucket_mb * 2**20)))
    loader, _ = objective.build_loaders(dp_rank=flat.data_rank, dp_size=flat.data_world)
    n_micro = dims.microbatches(cfg.train)
    batches = [next(loader) for _ in range(n_micro)]
    precision = Precision(cfg.precision, "cpu")
    engines = {"flat": flat, "cat": cat}
    opts = {k: e.build_optimizer(cfg.optim) for k, e in engines.items()}

    def step(name):
        e = engines[name]
        e.forward_backward(batches, precision)
        e.clip_grad_norm_(cfg.optim.grad_clip)
        e.optimizer_step(opts[name])
        e.zero_grad(opts[name])

    times = {"flat": [], "cat": []}
    for r in range(rounds + 1):
        for name in ("flat", "cat"):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(name)
            if r:  # the first round warms up
                times[name].append((time.perf_counter() - t0) / steps)
    return statistics.median(times["flat"]), statistics.median(times["cat"])


if __name__ == "__main__":
    sys.exit(main())
