"""Gemma 3's sliding-window layers against full attention on the CPU.

The same small Gemma 3 model (five local layers then one global, the tiny
recipe's block: qk-norm, four norms, GeGLU) at 1,024 tokens, with its local
layers attending through a 128-token window, against the identical model
with every layer global. Each variant runs forward + backward steps in its
own fresh subprocess (so its peak resident set is its own); the two
alternate, rep by rep, so that both see the same host load, and the table
reports the median and the fastest step time, the peak RSS, and the peak
live heap of one more (untimed) step: glibc's bytes in use read after every
op, which, unlike RSS, does not move with the allocator's free-block reuse.

    PYTHONPATH=. python benchmarks/sliding_window.py [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

SEQ, WINDOW, LAYERS = 1024, 128, 6
SHAPE = dict(hidden_size=256, num_heads=4, num_kv_heads=1, head_dim=64, ffn_hidden_size=512,
             vocab_size=2048, max_seq_len=SEQ)


def _config(variant: str):
    from giantmodel.config.model import ModelConfig

    local = "sliding_attention" if variant == "sliding" else "full_attention"
    types = [local] * (LAYERS - 1) + ["full_attention"]
    return ModelConfig(**SHAPE, num_layers=LAYERS, family="gemma3_text", qk_norm=True,
                       sliding_window=WINDOW, layer_types=types, rope_theta=1e6,
                       rope_local_theta=1e4, attn_scale=64 ** -0.5, post_norms=True,
                       mlp_activation="gelu_tanh", embed_scale=True, tie_embeddings=True,
                       norm_eps=1e-6)


def child(variant: str, steps: int, batch: int) -> dict:
    """Run in a fresh process: ``steps`` timed forward+backward steps (after
    one warm-up); the step times and this process's peak RSS."""
    import torch

    from giantmodel.models import build_model, init_weights

    cfg = _config(variant)
    model = init_weights(build_model(cfg), cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        _step(model, tokens)
        if i:
            times.append(time.perf_counter() - t0)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    heap = _peak_live_heap(lambda: _step(model, tokens))
    return {"variant": variant, "step_s": times, "peak_rss_mib": peak_kib / 1024,
            "peak_heap_mib": heap / 2 ** 20 if heap else None}


def _step(model, tokens) -> None:
    import torch

    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                      tokens[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)


def _peak_live_heap(step) -> int | None:
    """Peak of glibc's in-use bytes (heap + mmapped chunks) over ``step``,
    read after every op it dispatches; None without glibc's mallinfo2."""
    import ctypes
    import ctypes.util

    from torch.utils._python_dispatch import TorchDispatchMode

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        return None

    class Info(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = Info

    class Peak(TorchDispatchMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            info = libc.mallinfo2()
            Peak.peak = max(Peak.peak, info.uordblks + info.hblkhd)
            return out

    with Peak():
        step()
    return Peak.peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="subprocesses per variant, alternating")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per subprocess")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.batch)))
        return
    runs: dict[str, list[dict]] = {"sliding": [], "full": []}
    for rep in range(args.reps):
        order = ("sliding", "full") if rep % 2 == 0 else ("full", "sliding")
        for variant in order:
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--steps",
                                  str(args.steps), "--batch", str(args.batch)],
                                 check=True, capture_output=True, text=True).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
    print(f"Gemma 3 ({LAYERS} layers, 5 local + 1 global), {SEQ} tokens x batch {args.batch}, "
          f"window {WINDOW}; forward+backward, median of {args.reps} x {args.steps} steps")
    print("| variant | step s (median) | step s (fastest) | peak RSS MiB (median) "
          "| peak live heap MiB (median) |")
    print("|---|---|---|---|---|")
    summary = {}
    for variant, rs in runs.items():
        steps = [t for r in rs for t in r["step_s"]]
        heaps = [r["peak_heap_mib"] for r in rs if r["peak_heap_mib"] is not None]
        summary[variant] = {"step_s": statistics.median(steps), "fastest_s": min(steps),
                            "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
                            "peak_heap_mib": statistics.median(heaps) if heaps else float("nan")}
        v = summary[variant]
        print(f"| {variant} | {v['step_s']:.3f} | {v['fastest_s']:.3f} | {v['peak_rss_mib']:.0f} "
              f"| {v['peak_heap_mib']:.1f} |")
    s, f = summary["sliding"], summary["full"]
    print(f"sliding / full: time {s['step_s'] / f['step_s']:.2f}x (fastest "
          f"{s['fastest_s'] / f['fastest_s']:.2f}x), peak RSS "
          f"{s['peak_rss_mib'] / f['peak_rss_mib']:.3f}x, peak live heap "
          f"{s['peak_heap_mib'] / f['peak_heap_mib']:.4f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
