"""Async checkpoint save and exact resume, for scripts/gpu_check.sh.

A tiny LLaMA in fp32 (TF32 off) trains 8 steps straight, saving
asynchronously every 4; a second run of the same config trains 4 steps,
saves asynchronously, stops, and ``run_training`` resumes it to step 8. The losses of steps 5-8 must match
the straight run's: bitwise where the kernels are deterministic (asked for
with ``torch.use_deterministic_algorithms``), and within 1e-5 relative in
any case (atomics in some CUDA backward kernels may differ in the last bits;
a resume that loses the data position, the RNG, the optimizer state or the
schedule is off by 1e-3 or more from the first resumed step). Prints one JSON line; exits 1 on a mismatch.

    python scripts/gpu_resume_check.py [--device cuda] [--dir /tmp/gm-resume]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# cuBLAS is deterministic only with a fixed workspace (set before CUDA starts)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

TINY = ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=8",
        "model.num_kv_heads=4", "model.ffn_hidden_size=768", "model.vocab_size=4096",
        "model.max_seq_len=256", "train.seq_len=256", "train.global_batch_size=8",
        "train.micro_batch_size=4", "data.source=synthetic", "precision=fp32",
        "train.tf32=false", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0",
        "run.tensorboard=false", "optim.warmup_steps=2"]


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    from giantmodel.config import load_config
    from giantmodel.train.trainer import Trainer, run_training

    root = Path(args.dir or tempfile.mkdtemp(prefix="gm-resume-"))
    base = TINY + [f"train.device={args.device}"]

    def cfg(name: str):
        return load_config(None, base + [f"run.dir={root / name}", "train.steps=8",
                                         "checkpoint.every=4", "checkpoint.async_save=true"])

    run_training(cfg("straight"))
    # Interrupted: 4 steps, an async save, then the process "dies"; the
    # same command again resumes from run.dir (the LR schedule is that of
    # the whole run, so both runs share train.steps).
    t = Trainer(cfg("resumed"))
    for _ in range(4):
        t.train_step()
    t._save()
    t.close()
    saved = sorted(p.name for p in (root / "resumed" / "checkpoints").glob("step-*"))
    summary = run_training(cfg("resumed"))
    a, b = losses(root / "straight"), losses(root / "resumed")
    steps = [5, 6, 7, 8]
    rel = max(abs(a[s] - b[s]) / abs(a[s]) for s in steps)
    bitwise = all(a[s] == b[s] for s in steps)
    ok = summary["step"] == 8 and bool(saved) and rel <= 1e-5
    print(json.dumps({"ok": ok, "bitwise": bitwise, "max_rel_diff": rel, "checkpoints": saved,
                      "straight": [a[s] for s in steps], "resumed": [b[s] for s in steps]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
