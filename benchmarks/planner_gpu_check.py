"""Planner predictions against one real GPU: peak memory and step time.

For each config, builds the project's model on the GPU (bf16 autocast, fp32
master weights, AdamW, the project's recompute), runs a few training steps,
and compares ``torch.cuda.max_memory_allocated`` with the planner's peak
(allocated bytes, without its fragmentation allowance and reserved memory)
and the best measured step with the predicted one.

    PYTHONPATH=. python benchmarks/planner_gpu_check.py --gpu h100-sxm [--json out.json]

Exits 0 with a note when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from giantmodel.config.model import ModelConfig
from giantmodel.planner.hardware import get_profile
from giantmodel.planner.layout import Cluster, Layout
from giantmodel.planner.memory import memory_report
from giantmodel.planner.perf import estimate_time

CONFIGS = [
    ("llama h2048 L8 mb4 s2048 none", "llama", 2048, 8, 16, 5632, 4, 2048, "none"),
    ("llama h2048 L8 mb8 s2048 selective", "llama", 2048, 8, 16, 5632, 8, 2048, "selective"),
    ("gpt h2048 L8 mb4 s1024 full", "gpt", 2048, 8, 16, 8192, 4, 1024, "full"),
]


def run_one(name, arch, h, layers, heads, ffn, mb, seq, mode, hw, steps):
    from giantmodel.core.loss import cross_entropy_sum
    from giantmodel.models import build_model, init_weights
    from giantmodel.parallel.recompute import apply_recompute

    m = ModelConfig(arch=arch, hidden_size=h, num_layers=layers, num_heads=heads,
                    num_kv_heads=heads // 2 if arch == "llama" else None, ffn_hidden_size=ffn,
                    vocab_size=32000, max_seq_len=seq)
    layout = Layout(tp=1, pp=1, dp=1, dp_shard=1, cp=1, sp=False, zero=0, virtual=1,
                    schedule="1f1b", micro_batch=mb, n_micro=1, seq_len=seq, precision="bf16",
                    recompute=mode, offload_activations=False,
                    stage_layers=(layers,))
    pred_mem = memory_report(m, layout, hw).peak_bytes_per_rank
    pred_t = estimate_time(m, layout, hw, Cluster(1, 1), mb).step_s
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(m, "meta")
    apply_recompute(model, {f"layers.{k}": mode for k in model.layers})
    init_weights(model, m, 0, "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, m.vocab_size, (mb, seq), device="cuda")
    times = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids)
        loss, _ = cross_entropy_sum(logits, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del logits, loss
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    return {"config": name, "predicted_peak_bytes": pred_mem, "measured_peak_bytes": peak,
                "memory_error": pred_mem / peak - 1, "predicted_step_s": pred_t,
                "measured_step_s": min(times), "time_error": pred_t / min(times) - 1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="h100-sxm", help="planner profile of this GPU")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    hw = get_profile(args.gpu)
    print(f"device {torch.cuda.get_device_name()} with planner profile {hw.name}")
    rows = []
    for cfg in CONFIGS:
        r = run_one(*cfg, hw=hw, steps=args.steps)
        rows.append(r)
        print(f"{r['config']:<36} memory {r['measured_peak_bytes'] / 1e9:6.2f} GB measured, "
              f"{r['predicted_peak_bytes'] / 1e9:6.2f} predicted ({r['memory_error'] * 100:+.1f}%); "
              f"step {r['measured_step_s'] * 1e3:7.1f} ms measured, "
              f"{r['predicted_step_s'] * 1e3:7.1f} predicted ({r['time_error'] * 100:+.1f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
