"""Per-rank memory of LoRA against full fine-tuning on a real model shape,
measured, and predicted by ``giantmodel estimate`` for exactly that config.

The model has a published model's real widths (hidden, FFN, heads, KV heads,
vocabulary; TinyLlama-1.1B by default, LLaMA-2-7B with ``--shape llama2-7b``)
with fewer layers, so that full fine-tuning fits a small host. Each mode
(``full``: every weight trains; ``lora``: adapters on a frozen base) runs
``--steps`` optimizer steps of the real trainer (``giantmodel.train.Trainer``,
synthetic tokens, fp32 or bf16 autocast, one process) in a fresh Python process, and reports:

* model states, counted tensor by tensor at the end of a step's backward:
  parameters, gradients (what ``.grad`` holds), optimizer state (AdamW's
  ``exp_avg``/``exp_avg_sq``);
* activations: every distinct storage autograd saves for backward during one
  step (a ``saved_tensors_hooks`` census), parameters excluded;
* peak RSS during training (``VmHWM``, restarted once the trainer is built)
  above the process's RSS before the trainer was built (the imports); the
  peak while building (a full-shape draw of each weight, copied in) is
  reported apart.

Then it runs ``python -m giantmodel estimate --gpu cpu --json`` with the same
overrides and prints predicted against measured, line by line. The estimate's
peak (its sum without fragmentation and the device's reserved bytes) is
compared with the RSS peak twice: under glibc's default malloc, whose
mmap threshold grows after large frees so that freed activations stay
resident (allocator retention, which the estimate does not model), and with
a fixed threshold (``MALLOC_MMAP_THRESHOLD_``, ``--mmap-threshold``) under
which every tensor above it is returned to the system when freed, so RSS
follows the live tensors.

    python benchmarks/lora_memory.py --layers 4 --seq-len 512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

SHAPES = {
    # hidden, layers (real), heads, kv heads, ffn, vocab
    "tinyllama-1.1b": (2048, 22, 32, 4, 5632, 32000),
    "llama2-7b": (4096, 32, 32, 32, 11008, 32000),
}


def overrides(args, mode: str) -> list[str]:
    h, _, heads, kv, ffn, vocab = SHAPES[args.shape]
    out = [f"model.name={args.shape}-{args.layers}l", "model.arch=llama",
           f"model.hidden_size={h}", f"model.num_layers={args.layers}",
           f"model.num_heads={heads}", f"model.num_kv_heads={kv}",
           f"model.ffn_hidden_size={ffn}", f"model.vocab_size={vocab}",
           f"model.max_seq_len={args.seq_len}", "model.tie_embeddings=false",
           f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.batch}",
           f"train.global_batch_size={args.batch}", f"precision={args.precision}", "recompute=none",
           "optim.weight_decay=0.0"]
    if mode == "lora":
        targets = ",".join(args.targets)
        out += ["objective=lora", f"lora.rank={args.rank}", f"lora.alpha={2 * args.rank}",
                f"lora.targets=[{targets}]"]
    return out


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args, mode: str) -> dict:
    import torch

    from giantmodel.config import load_config
    from giantmodel.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    run_dir = tempfile.mkdtemp(prefix=f"lora-memory-{mode}-")
    cfg = load_config(overrides=overrides(args, mode) + [
        f"run.dir={run_dir}", f"train.steps={args.steps}", "data.source=synthetic",
        "train.eval_every=0", "train.sample_tokens=0", "train.device=cpu",
        f"train.threads={args.threads}", "checkpoint.every=0", "checkpoint.save_final=false",
        "run.tensorboard=false", "run.progress=false", "optim.warmup_steps=0",
        "optim.schedule=constant"])
    base_rss = rss_bytes()
    trainer = Trainer(cfg)
    params = list(trainer.engine.parameters())
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[str, float] = {}

    zero_grad = trainer.engine.zero_grad

    def census_then_zero_grad(optimizer):
        # End of a step: gradients and optimizer state are all allocated.
        seen["grads"] = sum(p.grad.nbytes for p in params if p.grad is not None)
        seen["optimizer"] = sum(t.nbytes for st in optimizer.state.values()
                                for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
        seen["rss_at_step_end"] = rss_bytes() - base_rss
        zero_grad(optimizer)

    trainer.engine.zero_grad = census_then_zero_grad
    # Building the model draws each weight at full shape, then copies it in:
    # a transient of the largest weight that training never needs again.
    # Restart the peak (VmHWM) at the current RSS so the training peak is seen.
    init_peak = rss_bytes("VmHWM") - base_rss
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            saved[s.data_ptr()] = s.nbytes()
        return t

    step_s = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        if step == args.steps - 1:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = trainer.train_step()
        else:
            out = trainer.train_step()
        step_s.append(time.perf_counter() - t0)
    trainer.close()
    return {
        "mode": mode, "loss": out["loss"], "step_s": step_s,
        "params": sum(p.nbytes for p in params),
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "grads": seen["grads"], "optimizer": seen["optimizer"],
        "saved_activations": sum(saved.values()),
        "peak_rss": rss_bytes("VmHWM") - base_rss, "base_rss": base_rss,
        "init_peak_rss": init_peak,
        "rss_at_step_end": seen["rss_at_step_end"],
    }


def estimate(args, mode: str) -> dict:
    cmd = [sys.executable, "-m", "giantmodel", "estimate", "--gpu", "cpu", "--json",
           *overrides(args, mode)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    mem = json.loads(out.stdout)["memory"]
    b = mem["breakdown"]
    # autocast's low-precision weight copies are saved for backward too
    acts = b["activations"] + b["embedding_head_activations"] + b["working_weights"]
    return {"params": b["params"], "grads": b["grads"], "optimizer": b["optimizer"],
            "saved_activations": acts, "peak": mem["peak_bytes_per_rank"], "breakdown": b,
            "command": " ".join(["giantmodel", *cmd[3:]])}


ROWS = [("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
        ("saved_activations", "saved_activations"), ("peak", "peak_rss"),
        ("peak", "peak_rss_fixed_mmap")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    ap.add_argument("--layers", type=int, default=4, help="depth (the widths stay real)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: autocast with fp32 weights, as on GPUs")
    ap.add_argument("--modes", nargs="+", default=["full", "lora"])
    ap.add_argument("--mmap-threshold", type=int, default=131072,
                    help="bytes; the second run of each mode fixes glibc's mmap threshold here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args, args.child)))
        return 0

    results = {}
    fixed = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
    for mode in args.modes:
        cmd = [sys.executable, __file__, "--child", mode, *sys.argv[1:]]
        runs = [subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
                for env in (None, fixed)]
        measured, live = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
        measured["peak_rss_fixed_mmap"] = live["peak_rss"]
        results[mode] = {"measured": measured, "estimate": estimate(args, mode),
                         "measured_fixed_mmap": live}

    gb = 1e9
    print(f"{args.shape} widths, {args.layers} layers, seq {args.seq_len} x batch {args.batch}, "
          f"{args.precision}, 1 process; LoRA rank {args.rank} on {', '.join(args.targets)}")
    print(f"{'GB':<20}" + "".join(f"{m + ' meas':>12}{m + ' est':>12}{'err':>7}"
                                  for m in args.modes))
    for est_key, meas_key in ROWS:
        line = f"{meas_key:<20}"
        for mode in args.modes:
            e = results[mode]["estimate"][est_key]
            m = results[mode]["measured"][meas_key]
            line += f"{m / gb:>12.3f}{e / gb:>12.3f}{(e - m) / m * 100 if m else 0:>6.1f}%"
        print(line)
    res = {"bench": "lora_memory", "machine": platform.node(), "cpu_count": os.cpu_count(),
           "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "args": vars(args), "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
