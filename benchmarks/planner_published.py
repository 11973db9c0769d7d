"""Planner predictions against published training throughput.

Each row: a published run (model shape, GPUs, batch, layout where the source
gives it), the planner's predicted tokens/s per GPU, and the error. Where the
source gives no layout, the planner's own best layout on that cluster is
used (that is the question a user asks it). Published throughputs given as
TFLOP/s are converted to tokens/s with the source's own FLOP formula.

    PYTHONPATH=. python benchmarks/planner_published.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace

from giantmodel.config.model import ModelConfig
from giantmodel.config.schema import JobConfig
from giantmodel.core.pipeline_split import balanced_split, embedding_cost, head_cost, layer_cost
from giantmodel.planner.hardware import get_profile
from giantmodel.planner.layout import Cluster, Layout
from giantmodel.planner.memory import memory_report
from giantmodel.planner.perf import PerfOptions, estimate_time
from giantmodel.planner.search import search


@dataclass
class Run:
    source: str
    name: str
    model: ModelConfig
    gpu: str
    gpus: int
    global_batch: int
    seq_len: int
    published_tok_s_gpu: float
    layout: dict | None = None
    """tp, pp, recompute, zero, ... as published; None: planner's best."""
    note: str = ""


def gpt(name, layers, hidden, heads, vocab=51200, seq=2048):
    return ModelConfig(arch="gpt", name=name, hidden_size=hidden, num_layers=layers,
                       num_heads=heads, num_kv_heads=None, ffn_hidden_size=4 * hidden,
                       vocab_size=vocab, max_seq_len=seq)


def llama(name, layers, hidden, heads, ffn, vocab=32000, kv=None, seq=2048):
    return ModelConfig(arch="llama", name=name, hidden_size=hidden, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv, ffn_hidden_size=ffn,
                       vocab_size=vocab, max_seq_len=seq)


def megatron_tok_s(tflops: float, m: ModelConfig, seq: int) -> float:
    """Narayanan et al. 2021 eq. 3 (full recompute, so 96 not 72):
    F / token = 96 * L * h^2 * (1 + s/(6h) + V/(16 L h))."""
    L, h, V = m.num_layers, m.hidden_size, m.vocab_size
    per_token = 96 * L * h * h * (1 + seq / (6 * h) + V / (16 * L * h))
    return tflops * 1e12 / per_token


NARAYANAN = "Narayanan et al. 2021 (SC21, arXiv:2104.04473), Table 1, A100-80GB, fp16, full recompute"
RUNS: list[Run] = []
for name, heads, hidden, layers, tp, pp, gpus, batch, tflops in [
        ("gpt-1.7b", 24, 2304, 24, 1, 1, 32, 512, 137),
        ("gpt-7.5b", 32, 4096, 36, 4, 1, 128, 512, 142),
        ("gpt-18.4b", 48, 6144, 40, 8, 1, 256, 1024, 135),
        ("gpt-39.1b", 64, 8192, 48, 8, 2, 512, 1536, 138),
        ("gpt-145.6b", 96, 12288, 80, 8, 8, 1536, 2304, 148)]:
    m = gpt(name, layers, hidden, heads)
    RUNS.append(Run(NARAYANAN, name, m, "a100-80g", gpus, batch, 2048,
                    megatron_tok_s(tflops, m, 2048),
                    layout={"tp": tp, "pp": pp, "recompute": "full", "precision": "fp16",
                                "schedule": "interleaved_1f1b" if pp > 1 else "1f1b"},
                    note=f"{tflops} TFLOP/s/GPU published"))

LLAMA1 = "Touvron et al. 2023 (LLaMA, arXiv:2302.13971), sec. 2.4 and Table 15 GPU-hours, A100-80GB"
RUNS += [
    Run(LLAMA1, "llama-65b", llama("llama-65b", 80, 8192, 64, 22016), "a100-80g", 2048, 2048,
        2048, 380.0, note="380 tokens/s/GPU on 2048 GPUs (sec. 2.4)"),
    Run(LLAMA1, "llama-33b", llama("llama-33b", 60, 6656, 52, 17920), "a100-80g", 2048, 2048,
        2048, 1.4e12 / (530432 * 3600), note="1.4T tokens in 530,432 GPU-hours"),
    Run(LLAMA1, "llama-13b", llama("llama-13b", 40, 5120, 40, 13824), "a100-80g", 2048, 2048,
        2048, 1.0e12 / (135168 * 3600), note="1.0T tokens in 135,168 GPU-hours"),
]
LLAMA2 = "Touvron et al. 2023 (Llama 2, arXiv:2307.09288), Table 2 GPU-hours for 2T tokens, A100-80GB"
RUNS += [
    Run(LLAMA2, "llama2-7b", llama("llama2-7b", 32, 4096, 32, 11008, seq=4096), "a100-80g", 2048,
        1024, 4096, 2.0e12 / (184320 * 3600), note="2T tokens in 184,320 GPU-hours"),
    Run(LLAMA2, "llama2-70b", llama("llama2-70b", 80, 8192, 64, 28672, kv=8, seq=4096), "a100-80g",
        2048, 1024, 4096, 2.0e12 / (1720320 * 3600), note="2T tokens in 1,720,320 GPU-hours"),
]
TITAN = ("torchtitan docs/performance.md (Llama 3 on 64 A100-80GB, FSDP, local batch 1, "
         "seq 8192)")
RUNS += [
    Run(TITAN, "llama3-8b", llama("llama3-8b", 32, 4096, 32, 14336, vocab=128256, kv=8, seq=8192),
        "a100-80g", 64, 64, 8192, 2973.0,
        layout={"tp": 1, "pp": 1, "zero": 3, "recompute": "selective", "precision": "bf16", "micro_batch": 1},
        note="2973 WPS, selective op AC"),
    Run(TITAN, "llama3-70b", llama("llama3-70b", 80, 8192, 64, 28672, vocab=128256, kv=8, seq=8192),
        "a100-80g", 64, 64, 8192, 331.0,
        layout={"tp": 1, "pp": 1, "zero": 3, "recompute": "full", "precision": "bf16", "micro_batch": 1},
        note="331 WPS, full AC"),
]
TITAN_H100 = ("torchtitan docs/performance.md, Table 1 (Llama 3.1 8B, 8 H100 96GB HBM2e at "
              "2.4 TB/s, 500 W, FSDP, local batch 2, selective AC, no compile)")
RUNS += [
    Run(TITAN_H100, "llama3.1-8b", llama("llama3.1-8b", 32, 4096, 32, 14336, vocab=128256, kv=8,
                                         seq=8192),
        "h100-96g-500w", 8, 16, 8192, 5762.0,
        layout={"tp": 1, "pp": 1, "zero": 3, "recompute": "selective", "precision": "bf16", "micro_batch": 2},
        note="5,762 TPS/GPU; profile = h100-sxm with 96 GB at 2.4 TB/s (peak FLOP/s kept)"),
]


def _profile(name: str):
    if name == "h100-96g-500w":
        return replace(get_profile("h100-sxm"), name=name, memory_bytes=96e9, memory_bw=2.4e12)
    return get_profile(name)


def _layout(run: Run, spec: dict) -> Layout:
    m = run.model
    tp, pp = spec.get("tp", 1), spec.get("pp", 1)
    dp = run.gpus // (tp * pp)
    v = 1
    sched = spec.get("schedule", "1f1b")
    if sched == "interleaved_1f1b":
        v = next(x for x in (4, 3, 2) if m.num_layers % (pp * x) == 0)
    mb = spec.get("micro_batch", 1)
    split = (m.num_layers,) if pp * v == 1 else tuple(balanced_split(
        m.num_layers, pp * v, layer_cost(m, run.seq_len), embedding_cost(m), head_cost(m)))
    return Layout(tp=tp, pp=pp, dp=dp, dp_shard=dp if spec.get("zero", 0) else 1, cp=1,
                  sp=spec.get("sp", tp > 1), zero=spec.get("zero", 0), virtual=v, schedule=sched,
                  micro_batch=mb, n_micro=run.global_batch // (mb * dp), seq_len=run.seq_len,
                  precision=spec.get("precision", "bf16"), recompute=spec.get("recompute", "none"),
                  offload_activations=False, offload_optimizer=False, stage_layers=split)


def predict(run: Run) -> tuple[float, str]:
    hw = _profile(run.gpu)
    cluster = Cluster(run.gpus // hw.gpus_per_node, hw.gpus_per_node)
    opts = PerfOptions(overlap_grad_reduce=True)   # Megatron, FSDP and the LLaMA code overlap
    if run.layout is not None:
        best = None
        for mb in ((run.layout["micro_batch"],) if "micro_batch" in run.layout else (1, 2, 4, 8)):
            lay = _layout(run, dict(run.layout, micro_batch=mb))
            fits = memory_report(run.model, lay, hw).fits
            # A published micro-batch is timed as run; a searched one must fit.
            if run.global_batch % (mb * lay.dp) or not (fits or "micro_batch" in run.layout):
                continue
            perf = estimate_time(run.model, lay, hw, cluster, run.global_batch, opts)
            if best is None or perf.tokens_per_sec > best[0]:
                best = (perf.tokens_per_sec, lay.describe() + ("" if fits else " (over memory)"))
        if best is None:
            raise RuntimeError(f"{run.name}: the published layout does not fit by the model")
        return best[0] / run.gpus, best[1]
    cfg = JobConfig(model=run.model, precision="bf16")
    cfg.train.global_batch_size, cfg.train.seq_len = run.global_batch, run.seq_len
    cfg.train.micro_batch_size = 1
    cands = search(cfg, hw, cluster, opts)
    return cands[0].perf.tokens_per_sec / run.gpus, cands[0].layout.describe()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    print(f"{'run':<12} {'GPUs':>5} {'published':>10} {'predicted':>10} {'error':>7}  layout")
    for run in RUNS:
        pred, lay = predict(run)
        err = pred / run.published_tok_s_gpu - 1
        rows.append({"source": run.source, "run": run.name, "gpu": run.gpu, "gpus": run.gpus,
                         "published_tokens_per_sec_per_gpu": run.published_tok_s_gpu,
                         "predicted_tokens_per_sec_per_gpu": pred, "error": err, "layout": lay,
                         "note": run.note})
        print(f"{run.name:<12} {run.gpus:>5} {run.published_tok_s_gpu:>10.1f} {pred:>10.1f} "
              f"{err * 100:>+6.1f}%  {lay}")
    mean_abs = sum(abs(r["error"]) for r in rows) / len(rows)
    print(f"mean |error| {mean_abs * 100:.1f}%; within 15%: "
          f"{sum(abs(r['error']) <= 0.15 for r in rows)}/{len(rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
