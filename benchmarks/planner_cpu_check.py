"""Planner time model against a measured training step on this host (CPU).

Measures the host's matmul rate and memory bandwidth (giantmodel.planner.
hwbench), predicts the step time of a small llama with that profile, then
times real steps (forward, backward, AdamW) of the same model and prints
both and their ratio. Also compares predicted activation bytes with the
live bytes a forward leaves for backward.

    PYTHONPATH=. python benchmarks/planner_cpu_check.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from giantmodel.config.model import ModelConfig
from giantmodel.core.loss import cross_entropy_sum
from giantmodel.models import build_model
from giantmodel.planner import hwbench
from giantmodel.planner.hardware import profile_from_dict
from giantmodel.planner.layout import Cluster, Layout
from giantmodel.planner.measure import LiveStorageCounter
from giantmodel.planner.memory import memory_report
from giantmodel.planner.perf import estimate_time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    prof = profile_from_dict("cpu", hwbench.measure("cpu", size=1024, mem_mb=256), "measured")
    rows = []
    for hidden, layers, mb, seq in ((256, 4, 4, 256), (512, 4, 2, 512)):
        m = ModelConfig(arch="llama", hidden_size=hidden, num_layers=layers, num_heads=8,
                        num_kv_heads=4, ffn_hidden_size=3 * hidden, vocab_size=4096,
                        max_seq_len=seq)
        layout = Layout(tp=1, pp=1, dp=1, dp_shard=1, cp=1, sp=False, zero=0, virtual=1,
                        schedule="1f1b", micro_batch=mb, n_micro=1, seq_len=seq, precision="fp32",
                        recompute="none", offload_activations=False, offload_optimizer=False,
                        stage_layers=(layers,))
        pred = estimate_time(m, layout, prof, Cluster(1, 1), mb)
        mem = memory_report(m, layout, None)
        model = build_model(m, "cpu")
        model.init_buffers("cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        ids = torch.randint(0, m.vocab_size, (mb, seq))
        times = []
        for i in range(args.steps + 1):
            t0 = time.perf_counter()
            live = LiveStorageCounter()
            with live:
                logits = model(ids)  # held through backward, as the engine does
                loss, _ = cross_entropy_sum(logits, ids)
            acts = live.live_bytes()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del logits, loss
            if i:
                times.append(time.perf_counter() - t0)
        measured = min(times)
        r = mem.worst.components
        pred_acts = (r["activations"] + r["embedding_head_activations"] - mb * seq * 8)
        row = {"model": f"llama h{hidden} L{layers} mb{mb} s{seq}", "predicted_step_s": pred.step_s,
                   "measured_step_s": measured, "time_ratio": pred.step_s / measured,
                   "predicted_activation_bytes": pred_acts, "measured_activation_bytes": acts,
                   "activation_ratio": pred_acts / acts}
        rows.append(row)
        print(f"{row['model']:<28} step predicted {pred.step_s:.3f} s measured {measured:.3f} s "
              f"(ratio {row['time_ratio']:.2f}); activations predicted {pred_acts / 1e6:.1f} MB "
              f"measured {acts / 1e6:.1f} MB (ratio {row['activation_ratio']:.3f})")
    print(f"host profile: fp32 {prof.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, memory "
          f"{prof.memory_bw / 1e9:.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
