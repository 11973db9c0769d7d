"""Recompute modes side by side on this host: activation memory and time.

One process, one thread. For each precision and mode (none, selective, full)
it builds the same LLaMA, applies giantmodel.parallel.recompute, and measures
the bytes a forward keeps alive for backward (live storages after forward,
logits included) and the forward + backward time (median of N), with the
planner's prediction of the bytes next to them. Modes are interleaved round
by round so host noise hits them alike.

    PYTHONPATH=. python benchmarks/planner_recompute.py [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from giantmodel.config.model import ModelConfig
from giantmodel.core.loss import cross_entropy_sum
from giantmodel.models import build_model
from giantmodel.parallel.recompute import apply_recompute
from giantmodel.planner.layout import Layout
from giantmodel.planner.measure import LiveStorageCounter
from giantmodel.planner.memory import rank_memory

MODES = ("none", "selective", "full")


def _model(m: ModelConfig, mode: str):
    torch.manual_seed(0)
    model = build_model(m, "cpu")
    model.init_buffers("cpu")
    apply_recompute(model, {f"layers.{k}": mode for k in model.layers})
    return model


def _predicted(m: ModelConfig, precision: str, mode: str, b: int, s: int) -> float:
    lay = Layout(tp=1, pp=1, dp=1, dp_shard=1, cp=1, sp=False, zero=0, virtual=1,
                 schedule="1f1b", micro_batch=b, n_micro=1, seq_len=s, precision=precision,
                 recompute=mode, offload_activations=False, stage_layers=(m.num_layers,))
    r = rank_memory(m, lay, 0, None).components
    return (r["activations"] + r["embedding_head_activations"] - b * s * 8
            + r["working_weights"])


def run(m: ModelConfig, precision: str, b: int, s: int, rounds: int) -> list[dict]:
    ac = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
          else torch.autocast("cpu", enabled=False))
    models = {mode: _model(m, mode) for mode in MODES}
    ids = torch.randint(0, m.vocab_size, (b, s))
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    kept: dict[str, int] = {}
    for r in range(rounds + 1):
        for mode in MODES:
            model = models[mode]
            live = LiveStorageCounter()
            t0 = time.perf_counter()
            with live, ac:
                logits = model(ids)
                loss, _ = cross_entropy_sum(logits, ids)
            kept[mode] = live.live_bytes()
            loss.backward()
            dt = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            del logits, loss
            if r:
                times[mode].append(dt)
    return [{"precision": precision, "mode": mode, "kept_bytes": kept[mode],
             "predicted_bytes": _predicted(m, precision, mode, b, s),
             "fwd_bwd_s": statistics.median(times[mode]), "times": times[mode]}
            for mode in MODES]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    m = ModelConfig(arch="llama", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                    ffn_hidden_size=1536, vocab_size=4096, max_seq_len=512)
    load = os.getloadavg()
    rows = []
    for precision in ("fp32", "bf16"):
        rows += run(m, precision, 4, 512, args.rounds)
    print(f"{'prec':<5} {'mode':<10} {'kept MB':>9} {'pred MB':>9} {'vs none':>8} "
          f"{'fwd+bwd s':>10} {'vs none':>8}")
    for r in rows:
        none = next(x for x in rows if x["precision"] == r["precision"] and x["mode"] == "none")
        print(f"{r['precision']:<5} {r['mode']:<10} {r['kept_bytes'] / 2**20:>9.1f} "
              f"{r['predicted_bytes'] / 2**20:>9.1f} {r['kept_bytes'] / none['kept_bytes']:>8.2f} "
              f"{r['fwd_bwd_s']:>10.3f} {r['fwd_bwd_s'] / none['fwd_bwd_s']:>8.2f}")
    print(f"load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
