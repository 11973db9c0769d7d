"""Case 4, the GPU suite: LLaMA-1B class (Llama 3.2 1B shapes), bf16, seq 4096,
micro-batch 1, 8 micro-batches per step, on one CUDA device: giantmodel,
Megatron-Core, DeepSpeed and torchtitan, tokens/s, peak memory and MFU.

    python benchmarks/peers/run.py --suite gpu [--json gpu.json] [--titan-assets DIR]

Each system runs in its own environment (venvs.py), ``--reps`` times,
alternating; MFU uses one formula for all (giantmodel.metrics.flops: 6N plus
attention FLOPs per token, against the device's dense bf16 peak). Without a
CUDA device it prints the planner's prediction for the workload instead,
marked as a prediction, and runs nothing.

torchtitan needs a tokenizer (and reads its own data pipeline); it is run
only when ``--titan-assets`` names a local directory holding the tokenizer
files of a Llama 3 model, and reported as skipped with that reason otherwise.

Status: written, not run. No GPU has been lent to this project; see
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import venvs
import workload

HERE = Path(__file__).resolve().parent


def planner_prediction(case: workload.Case, gpu: str = "h100-sxm") -> dict:
    """What giantmodel's planner expects one H100 to do on this workload."""
    from giantmodel.metrics.flops import flops_per_token
    from giantmodel.planner.hardware import get_profile
    from giantmodel.planner.layout import Cluster, Layout
    from giantmodel.planner.memory import memory_report
    from giantmodel.planner.perf import estimate_time

    m = workload.model_config(case)
    seq = workload.seq_len(case)
    n_micro = case.global_batch // case.micro_batch
    hw = get_profile(gpu)
    layout = Layout(tp=1, pp=1, dp=1, dp_shard=1, cp=1, sp=False, zero=0, virtual=1,
                    schedule="1f1b", micro_batch=case.micro_batch, n_micro=n_micro,
                    seq_len=seq, precision="bf16", recompute="none",
                    offload_activations=False,
                    stage_layers=(m.num_layers,))
    step = estimate_time(m, layout, hw, Cluster(1, 1), case.global_batch).step_s
    tps = case.global_batch * seq / step
    peak = memory_report(m, layout, hw).peak_bytes_per_rank
    return {"gpu": gpu, "step_s": step, "tokens_per_sec": tps,
            "mfu": flops_per_token(m, seq) * tps / hw.flops("bf16"),
            "peak_memory_gib": peak / 2**30, "kind": "prediction (planner), not a measurement"}


def _run(cmd: list, out: Path, env: dict, timeout: float) -> dict:
    proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, check=False,
                          timeout=timeout)
    if proc.returncode != 0 or not out.is_file():
        return {"error": (proc.stdout + proc.stderr)[-2000:]}
    return json.loads(out.read_text())


def main(args) -> int:
    from run import _env, say

    case = workload.GPU_CASES[0]
    if not torch.cuda.is_available():
        pred = planner_prediction(case)
        say("[peers] GPU suite not run: no CUDA device here. Planner prediction for "
            f"{case.name} ({workload.GPU_MODEL['name']}, bf16, seq {workload.GPU_SEQ_LEN}) "
            f"on one {pred['gpu']}, for every system alike (PREDICTION, not measured):")
        say(f"  {pred['tokens_per_sec']:,.0f} tokens/s, MFU {pred['mfu']:.1%}, "
            f"peak memory {pred['peak_memory_gib']:.1f} GiB")
        if args.json:
            Path(args.json).write_text(json.dumps({"suite": "gpu", "run": False,
                                                   "prediction": pred}, indent=1))
        return 0
    from giantmodel.metrics.flops import flops_per_token, peak_flops

    pythons = {"giantmodel": sys.executable,
               "deepspeed": venvs.ensure(venvs.DEEPSPEED, say),
               "megatron-core": venvs.ensure(venvs.MEGATRON, say)}
    scripts = {"giantmodel": "gm_side.py", "deepspeed": "ds_side.py",
               "megatron-core": "megatron_side.py"}
    skipped = {}
    titan = getattr(args, "titan_assets", None)
    if titan:
        pythons["torchtitan"] = venvs.ensure(venvs.TORCHTITAN, say)
        scripts["torchtitan"] = "titan_side.py"
    else:
        skipped["torchtitan"] = "no --titan-assets: torchtitan needs a local Llama 3 tokenizer"
    env = {k: v for k, v in _env().items() if k != "DS_ACCELERATOR"}
    runs: dict[str, list] = {s: [] for s in pythons}
    with tempfile.TemporaryDirectory(prefix="gm-peers-gpu-") as tmp:
        for rep in range(args.reps):
            order = list(pythons) if rep % 2 == 0 else list(reversed(pythons))
            for system in order:
                out = Path(tmp) / f"{system}-{rep}.json"
                cmd = [pythons[system], HERE / scripts[system], "--case", case.name,
                       "--steps", 10, "--warmup", 3, "--out", out]
                if system == "torchtitan":
                    cmd += ["--assets", titan]
                r = _run(cmd, out, env, args.timeout)
                runs[system].append(r)
                say(f"  {system:<14} rep {rep + 1}: "
                    + (r.get("error", "")[-300:] or f"{r['tokens_per_sec']:,.0f} tok/s"))
    m = workload.model_config(case)
    peak = peak_flops(torch.device("cuda"), "bf16")
    summary = {}
    for system, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if ok:
            tps = statistics.median(r["tokens_per_sec"] for r in ok)
            summary[system] = {"tokens_per_sec": tps,
                               "mfu": flops_per_token(m, workload.seq_len(case)) * tps / peak,
                               "peak_memory_mib": max(ok[0]["peak_rss_mib"]),
                               "loss": ok[0]["loss"]}
    gm = summary.get("giantmodel", {}).get("tokens_per_sec")
    for system, s in summary.items():
        s["giantmodel_ratio"] = gm / s["tokens_per_sec"] if gm else None
        say(f"{system:<14} {s['tokens_per_sec']:>10,.0f} tok/s  MFU {s['mfu']:.1%}  "
            f"peak {s['peak_memory_mib']:,.0f} MiB  loss {s['loss']:.4f}"
            + (f"  giantmodel / this {s['giantmodel_ratio']:.2f}x" if s['giantmodel_ratio'] else ""))
    for system, why in skipped.items():
        say(f"{system}: skipped: {why}")
    if args.json:
        Path(args.json).write_text(json.dumps({"suite": "gpu", "run": True, "runs": runs,
                                               "summary": summary, "skipped": skipped,
                                               "prediction": planner_prediction(case)}, indent=1))
    return 0
