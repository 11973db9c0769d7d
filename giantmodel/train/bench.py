"""``giantmodel bench train``: training throughput of a config.

Runs the real trainer step (same engine, precision and data path as
``giantmodel train``) for N warm-up and M timed steps, with checkpoints and
evaluation off, and reports tokens/s, TFLOP/s per device, MFU and peak memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time

import torch

from giantmodel.config import JobConfig, load_config
from giantmodel.metrics.flops import job_peak_flops
from giantmodel.train.trainer import Trainer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="YAML job config (default: embedded tiny LLaMA)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # ru_maxrss is KiB on Linux: whole-process peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(cfg: JobConfig, warmup: int, steps: int) -> dict:
    """Throughput of ``steps`` training steps after ``warmup`` ones, in the
    objective's units (tokens for a language model)."""
    trainer = Trainer(cfg)
    try:
        for _ in range(warmup):
            trainer.train_step()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(trainer.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = trainer.train_step()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
        t = cfg.train
        unit, per_step = trainer.objective.step_units()
        rate = per_step / dt
        world = trainer.info.world_size
        flops = trainer.objective.flops_per_unit() * rate / world
        # per device: the job's model FLOP/s over the job's peak, shared evenly
        peak = job_peak_flops(trainer.device, cfg.precision) / world
        return {"model": cfg.model.name, "world_size": world, "device": trainer.device.type,
                "precision": cfg.precision, "seq_len": t.seq_len,
                "global_batch_size": t.global_batch_size, "step_time_s": dt, "unit": unit,
                f"{unit}_per_sec": rate, "tflops_per_device": flops / 1e12,
                "mfu": flops / peak if peak else 0.0,
                "peak_memory_bytes": peak_memory_bytes(trainer.device), "final_loss": out["loss"]}
    finally:
        trainer.close()


def main(args) -> int:
    run_dir = tempfile.mkdtemp(prefix="giantmodel-bench-")
    overrides = [f"run.dir={run_dir}", "checkpoint.every=0", "checkpoint.save_final=false",
                 "checkpoint.resume=false", "train.eval_every=0", "run.tensorboard=false",
                 f"train.steps={args.warmup + args.steps}", "optim.warmup_steps=0",
                 *args.overrides]
    result = measure(load_config(args.config, overrides), args.warmup, args.steps)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        unit = result["unit"]
        rows = [(f"{unit}/s", f"{result[unit + '_per_sec']:,.0f}"),
                ("TFLOP/s per device", f"{result['tflops_per_device']:.3f}"),
                ("MFU", f"{result['mfu']:.1%}"),
                ("step time", f"{result['step_time_s'] * 1e3:.1f} ms"),
                ("peak memory", f"{result['peak_memory_bytes'] / 2**20:,.0f} MiB")]
        print(f"{result['model']} on {result['world_size']} x {result['device']} "
              f"({result['precision']}, seq {result['seq_len']}, batch {result['global_batch_size']})")
        for name, value in rows:
            print(f"  {name:<20} {value}")
    sys.stdout.flush()
    return 0
