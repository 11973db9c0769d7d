"""Planner time and memory model against real training steps on this host.

Two ranks on the backend training picks (`comm.backend: auto`: the giant
backend on one host), one thread each, each pinned to its own core as the
trainer pins CPU ranks (``train.bind_cores``), measure the host as a
planner profile (matmul curve, attention, memory bandwidth, the group's
all-reduce bandwidth, DTensor's per-op cost and the loss per logit at this
model's size), then train the same small LLaMA under eight layouts
(dp with zero 0-3, tp, tp + sp, pp, cp), each in fresh processes as a
training run would, timing steps (the median of ``--steps``; each layout
timed in ``--rounds`` turns, each against a profile measured in the same
turn, the median of the turns' ratios compared) and recording
peak RSS. The planner then predicts each step time and peak RSS from the
measured profile. About 3.5 minutes a round; it waits (``--max-wait``) for the 1-minute load average to fall to
1 first, since other work on the cores is timed with the layouts:

    PYTHONPATH=. python benchmarks/planner_cpu_check.py [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from giantmodel.planner.hostcheck import compare, run_check

MODEL = ["model.arch=llama", "model.hidden_size=384", "model.num_layers=4",
         "model.num_heads=6", "model.num_kv_heads=2", "model.ffn_hidden_size=1024",
         "model.vocab_size=8192", "model.max_seq_len=256"]
TRAIN = ["train.seq_len=256", "train.global_batch_size=8", "train.micro_batch_size=2",
         "precision=fp32", "optim.warmup_steps=0", "optim.grad_clip=1.0"]
LAYOUTS = [
    ["parallel.dp=2", "parallel.zero=0"],
    ["parallel.dp=2", "parallel.zero=1"],
    ["parallel.dp=2", "parallel.zero=2"],
    ["parallel.dp=2", "parallel.zero=3"],
    ["parallel.tp=2"],
    ["parallel.tp=2", "parallel.sp=true"],
    ["parallel.pp=2"],
    ["parallel.cp=2"],
]
PROFILE = {"sizes": [32, 64, 128, 256, 512, 768], "mem_mb": 64, "attn_seq": 256}


def run(model=MODEL, train=TRAIN, layouts=LAYOUTS, warmup=2, steps=5, profile=PROFILE,
        rounds=3):
    base = list(model) + list(train)
    per_rank = run_check(base, layouts, warmup, steps, profile, rounds=rounds)
    return compare(per_rank, base), per_rank[0]["profile"] | {
        "backend": per_rank[0]["backend"], "rounds": per_rank[0]["profiles"]}


def wait_for_quiet(max_wait: float, limit: float = 1.0) -> tuple[float, float, float]:
    """The load averages once the 1-minute one is at most ``limit``, or after
    ``max_wait`` seconds (then the run goes on and its output says the load)."""
    deadline = time.monotonic() + max_wait
    while os.getloadavg()[0] > limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=int, default=5,
                    help="timed steps per layout (the median is compared)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps per layout (measured: the second step after the "
                         "RSS passes still ran 35%% slower than the ones after it)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="times every layout is timed, the layouts in turn, each round with a "
                         "profile of its own (the median of the rounds' ratios is compared: a "
                         "shared VM's speed drifts by tens of percent over minutes)")
    ap.add_argument("--max-wait", type=float, default=300,
                    help="seconds to wait for the 1-minute load average to fall to 1 or below "
                         "before measuring (a run of this check leaves it near 2 for a minute)")
    args = ap.parse_args(argv)
    load = wait_for_quiet(args.max_wait)
    rows, prof = run(warmup=args.warmup, steps=args.steps, rounds=args.rounds)
    print(f"{'layout':<34} {'pred s':>7} {'meas s':>7} {'ratio':>6} {'pred RSS MB':>11} "
          f"{'meas RSS MB':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r['layout']:<34} {r['predicted_step_s']:>7.3f} {r['measured_step_s']:>7.3f} "
              f"{r['time_ratio']:>6.2f} {r['predicted_rss'] / 2**20:>11.1f} "
              f"{r['measured_rss'] / 2**20:>11.1f} {r['rss_ratio']:>6.3f}  rounds (pred/meas s) "
              + " ".join(f"{p:.3f}/{t:.3f}" for p, t in zip(r["rounds_predicted_s"],
                                                           r["rounds_step_s"], strict=True)))
    print(f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("profile: fp32 matmul curve (GFLOP/s):",
          " ".join(f"{int(n)}:{f / 1e9:.1f}" for n, f in prof["matmul_curve"]["fp32"]),
          f"| attention {prof['attention_efficiency']:.2f} of peak | copy "
          f"{prof['memory_bw'] / 1e9:.1f} GB/s, elementwise {prof['memory_efficiency']:.2f} | "
          f"all-reduce ({prof['backend']}) {prof['intra_bw'] / 1e9:.2f} GB/s, latency {prof.get('latency_s', 0) * 1e6:.0f} us")
    if len(prof["rounds"]) > 1:
        print("each round's profile: fp32 GFLOP/s at 512 / copy GB/s / all-reduce GB/s:",
              ", ".join(f"{dict(p['matmul_curve']['fp32'])[512] / 1e9:.1f} / "
                        f"{p['memory_bw'] / 1e9:.1f} / {p['intra_bw'] / 1e9:.2f}"
                        for p in prof["rounds"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "profile": prof, "load_before": load}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
