"""Gemma 3's sliding-window layers against full attention on the CPU.

The same small Gemma 3 model (five local layers then one global, the tiny
recipe's block: qk-norm, four norms, GeGLU) at 1,024 tokens, in three
variants: its local layers attending through a 128-token window with the
blocked CPU kernel (``sliding``, what the CPU runs); the same window as
SDPA with the dense [T, T] band (``dense-band``, the path the blocked kernel
replaces); the identical model with every layer global (``full``). Each
variant runs forward + backward steps in its own fresh subprocess (so its
peak resident set is its own); they alternate, rep by rep, so that all see
the same host load, and the table reports the median and the fastest step
time, the peak RSS, and the peak live heap of one more (untimed) step:
glibc's bytes in use read after every op, which, unlike RSS, does not move
with the allocator's free-block reuse; in total and above the heap at the
step's start (the model and its inputs), which is what the step itself adds.

    PYTHONPATH=. python benchmarks/sliding_window.py [--reps 5] [--json out.json]

``--core`` compares the attention core alone instead, where the CPU's choice
(:func:`giantmodel.models.common.masks.banded_cpu`) is made: the blocked
kernel against SDPA with the dense band, forward + backward in fp32 at
rows from 1.25x to 8x the window, alternating, fastest of ``--core-reps``,
and what each keeps for backward.

    PYTHONPATH=. python benchmarks/sliding_window.py --core [--core-reps 15]
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

    local = "full_attention" if variant == "full" else "sliding_attention"
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
    from giantmodel.models.common import masks

    if variant == "dense-band":   # this process only: SDPA with the [T, T] band
        masks.banded_cpu = lambda rows, window: False
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
    mib = 2 ** 20
    return {"variant": variant, "step_s": times, "peak_rss_mib": peak_kib / 1024,
            "peak_heap_mib": heap[0] / mib if heap else None,
            "step_heap_mib": (heap[0] - heap[1]) / mib if heap else None}


def _step(model, tokens) -> None:
    import torch

    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                      tokens[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)


def _peak_live_heap(step) -> tuple[int, int] | None:
    """Peak of glibc's in-use bytes (heap + mmapped chunks) over ``step``,
    read after every op it dispatches, and the bytes in use at its start;
    None without glibc's mallinfo2."""
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

    info = libc.mallinfo2()
    start = Peak.peak = info.uordblks + info.hblkhd
    with Peak():
        step()
    return Peak.peak, start


def _summarise(rs: list[dict]) -> dict:
    steps = [t for r in rs for t in r["step_s"]]
    out = {"step_s": statistics.median(steps), "fastest_s": min(steps),
           "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs)}
    for key in ("peak_heap_mib", "step_heap_mib"):
        vals = [r[key] for r in rs if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else float("nan")
    return out


def _print_table(summary: dict) -> None:
    """One row per variant, then sliding's ratios to the other two side by
    side: time (median, fastest) and memory (RSS, live heap, the step's heap)."""
    print("| variant | step s (median) | step s (fastest) | peak RSS MiB | peak live heap MiB "
          "| step's heap MiB |")
    print("|---|---|---|---|---|---|")
    for variant, v in summary.items():
        print(f"| {variant} | {v['step_s']:.3f} | {v['fastest_s']:.3f} | {v['peak_rss_mib']:.0f} "
              f"| {v['peak_heap_mib']:.1f} | {v['step_heap_mib']:.1f} |")
    print("| sliding / | time (median) | time (fastest) | peak RSS | peak live heap "
          "| step's heap |")
    print("|---|---|---|---|---|---|")
    s = summary["sliding"]
    for other in ("dense-band", "full"):
        o = summary[other]
        print(f"| {other} | {s['step_s'] / o['step_s']:.2f}x | {s['fastest_s'] / o['fastest_s']:.2f}x "
              f"| {s['peak_rss_mib'] / o['peak_rss_mib']:.3f}x "
              f"| {s['peak_heap_mib'] / o['peak_heap_mib']:.4f}x "
              f"| {s['step_heap_mib'] / o['step_heap_mib']:.4f}x |")


def core(reps: int) -> list[dict]:
    """The attention core at B x H (kv) x D = 1 x 8 (2) x 64 with a 512
    window and 2 x 4 (1) x 64 with a 128 window (the model's)."""
    rows = [_core_row(B, H, Hkv, D, w, ratio, reps)
            for B, H, Hkv, D, w in ((1, 8, 2, 64, 512), (2, 4, 1, 64, 128))
            for ratio in (1.25, 1.5, 2, 3, 4, 8)]
    print(f"Attention core, forward + backward fp32, fastest of {reps} alternating")
    print("| window | rows | blocked / dense time | kept MiB dense | kept MiB blocked |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['window']} | {r['rows']} ({r['ratio']}x) | {r['blocked_s'] / r['dense_s']:.2f}x "
              f"| {r['dense_kept'] / 2 ** 20:.2f} | {r['blocked_kept'] / 2 ** 20:.2f} |")
    return rows


def _core_row(B: int, H: int, Hkv: int, D: int, w: int, ratio: float, reps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from giantmodel.models.common import masks

    T = int(w * ratio)
    q = torch.randn(B, T, H, D).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(B, T, Hkv, D).transpose(1, 2).requires_grad_() for _ in range(2))
    band = masks.window_band(T, T, w, "cpu")
    kernels = {
        "dense": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True),
        "blocked": lambda: masks._BandedCPU.apply(q, k, v, w)}
    times = {name: [] for name in kernels}
    for i in range(reps + 1):
        for name, fn in kernels.items():
            t0 = time.perf_counter()
            fn().sum().backward()
            if i:   # the first round warms caches and thread pools
                times[name].append(time.perf_counter() - t0)
    row = {"window": w, "rows": T, "ratio": ratio}
    for name, fn in kernels.items():
        storages = {}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        row[f"{name}_s"], row[f"{name}_kept"] = min(times[name]), sum(storages.values())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="subprocesses per variant, in rotating order")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per subprocess")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--core", action="store_true", help="the attention core alone (see above)")
    ap.add_argument("--core-reps", type=int, default=15)
    args = ap.parse_args()
    if args.core:
        rows = core(args.core_reps)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.batch)))
        return
    variants = ("sliding", "dense-band", "full")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(args.reps):
        for variant in variants[rep % 3:] + variants[:rep % 3]:   # rotate the order
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--steps",
                                  str(args.steps), "--batch", str(args.batch)],
                                 check=True, capture_output=True, text=True).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
    print(f"Gemma 3 ({LAYERS} layers, 5 local + 1 global), {SEQ} tokens x batch {args.batch}, "
          f"window {WINDOW}; forward+backward, {args.reps} x {args.steps} steps per variant")
    summary = {v: _summarise(rs) for v, rs in runs.items()}
    _print_table(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
