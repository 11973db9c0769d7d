"""Peak host memory of the LM loss: plain (full logits) against chunked.

One forward and backward of the output head and the cross-entropy
(``hidden [tokens, H] @ weight[V, H].T``, labels with some -100, the loss sum
scaled by 1/tokens as the engine does) at a LLaMA-3 vocabulary, each variant
in a fresh process so its peak resident set (``ru_maxrss``) is its own. A
third process only allocates the inputs: the difference to it is what the
loss itself costs. The hidden size is small so the logits dominate.

    PYTHONPATH=. python benchmarks/chunked_loss.py [--tokens 4096] [--vocab 128256] [--hidden 512]

Prints a table and writes benchmarks/results/chunked_loss.json. The target:
chunked saves at least the fp32 logits it never holds (tokens x vocab x 4
bytes), within 10%, with the same loss and gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("inputs", "plain", "chunked")


def child(variant: str, tokens: int, vocab: int, hidden: int) -> dict:
    import torch
    import torch.nn.functional as F

    from giantmodel.core.loss import chunked_linear_cross_entropy_sum, cross_entropy_sum

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden).requires_grad_()
    w = (torch.randn(vocab, hidden) * hidden ** -0.5).requires_grad_()
    y = torch.randint(0, vocab, (tokens,))
    y[: tokens // 8] = -100
    out = {"variant": variant}
    t0 = time.perf_counter()
    if variant != "inputs":
        if variant == "plain":
            loss, count = cross_entropy_sum(F.linear(h, w), y)
        else:
            loss, count = chunked_linear_cross_entropy_sum(h, w, y)
        (loss / count).backward()
        out.update(loss=float(loss.detach()), count=int(count),
                   grad_hidden_norm=float(h.grad.double().norm()),
                   grad_weight_norm=float(w.grad.double().norm()),
                   grad_hidden_sum=float(h.grad.double().sum()),
                   grad_weight_sum=float(w.grad.double().sum()))
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def run_variant(variant: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--hidden", str(args.hidden)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="micro-batch 1 x seq 4096")
    p.add_argument("--vocab", type=int, default=128256, help="LLaMA-3's vocabulary")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "chunked_loss.json"))
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.hidden)))
        return 0
    runs = {v: run_variant(v, args) for v in VARIANTS}
    base = runs["inputs"]["peak_rss_bytes"]
    logits = args.tokens * args.vocab * 4
    plain, chunked = runs["plain"], runs["chunked"]
    saved = plain["peak_rss_bytes"] - chunked["peak_rss_bytes"]
    rel = {k: abs(chunked[k] - plain[k]) / max(abs(plain[k]), 1e-30)
           for k in ("loss", "grad_hidden_norm", "grad_weight_norm")}
    result = {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden,
              "fp32_logits_bytes": logits, "runs": runs,
              "saved_bytes": saved, "saved_over_logits": saved / logits,
              "loss_cost_bytes": {v: runs[v]["peak_rss_bytes"] - base for v in ("plain", "chunked")},
              "relative_difference": rel, "target_met": saved >= 0.9 * logits}
    gib = 2**30
    print(f"tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}; "
          f"fp32 logits {logits / gib:.2f} GiB")
    print(f"{'variant':<10}{'peak RSS GiB':>14}{'above inputs GiB':>18}{'seconds':>9}")
    for v in VARIANTS:
        r = runs[v]
        print(f"{v:<10}{r['peak_rss_bytes'] / gib:>14.2f}"
              f"{(r['peak_rss_bytes'] - base) / gib:>18.2f}{r['seconds']:>9.1f}")
    print(f"saved {saved / gib:.2f} GiB = {saved / logits:.2f} x the fp32 logits "
          f"(target >= 0.9): {'met' if result['target_met'] else 'NOT met'}")
    print("relative difference chunked vs plain: "
          + ", ".join(f"{k} {v:.1e}" for k, v in rel.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
