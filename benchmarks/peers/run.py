"""giantmodel side by side with its peers: one command, one table.

    python benchmarks/peers/run.py --suite cpu [--json peers.json]
    python benchmarks/peers/run.py --suite gpu          # see gpu.py

CPU suite (this host): giantmodel and DeepSpeed train the same LLaMA (same
initial weights, same token batches, fp32, same optimizer and clipping) on
dp2 at ZeRO 1/2/3, pp2 and dp4, on gloo ranks. Every case runs ``--reps``
times, alternating the systems; each ratio is the median of the per-rep
ratios. giantmodel runs at its defaults, and once more with the hand-tuned
settings in TUNED. The first rep runs ``--steps`` steps (losses compared
after them) and profiles one extra step of each system; later reps run
``--quick-steps``. Then case 2, the emulated 2-host cluster
(cluster_case.py; ``--cluster-rates``, skipped with the reason where
network namespaces cannot be made), and the collectives case (giant vs
DeepSpeed's shared-memory all-reduce). DeepSpeed's environment is made on first use
(benchmarks/peers/venvs.py). Megatron-Core and torchtitan have no CPU path
and are reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import ds_side
import gm_side
import launch
import venvs
import workload

# Hand-tuned giantmodel settings, reported beside the defaults.
# (The giant backend, tuned by hand until 2026-11-24, is now what
# comm.backend=auto picks on CPU.)
TUNED = ("train.compile=true",)
SKIPPED = {
    "megatron-core": "no CPU path: Megatron-Core's training loop and kernels need CUDA "
                     "(run with --suite gpu on a CUDA host)",
    "torchtitan": "falls back to CUDA: torchtitan's trainer takes its device from "
                  "the CUDA/ROCm device module (run with --suite gpu on a CUDA host)",
}


def say(text: str) -> None:
    print(text, flush=True)


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])
    env["TORCH_EXTENSIONS_DIR"] = str(venvs.torch_extensions_dir())
    env["DS_ACCELERATOR"] = "cpu"
    env.update(extra or {})
    return env


def _local_ranks(cmd: list, n: int):
    """``start`` for a RankGroup of ``n`` ranks on this host, each started as
    torchrun or srun starts one (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
    in the environment; one thread)."""
    def start(**popen_kwargs) -> list[subprocess.Popen]:
        return [subprocess.Popen([str(c) for c in cmd] + ["--serve"], env=_env({
            "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}),
            **popen_kwargs) for r in range(n)]
    return start


def side(system: str, ds_python: Path) -> tuple[list, object]:
    """A system's command line (less ``--serve``) and its summary."""
    if system.startswith("deepspeed"):
        cmd = [ds_python, HERE / "ds_side.py"]
        return cmd + (["--bind-cores"] if system == "deepspeed-bound" else []), ds_side.summarize
    cmd = [sys.executable, HERE / "gm_side.py"]
    if system == "giantmodel-tuned":
        for s in TUNED:
            cmd += ["--set", s]
    return cmd, gm_side.summarize


def run_cases(cases: list[workload.Case], ds_python: Path, args, tmp: Path) -> list[dict]:
    """For each rank count, every system's ranks are launched once and serve
    every rep (benchmarks/peers/launch.py); each rep runs the systems in
    turn, alternating their order rep by rep, and each system's ranks run
    the cases in turn, each case in a fresh child of the ranks."""
    from giantmodel.testing.ranks import free_port

    systems = ["giantmodel", "giantmodel-tuned", "deepspeed"]
    if args.no_tuned:
        systems.remove("giantmodel-tuned")
    if args.ds_bound:
        systems.append("deepspeed-bound")
    runs = {c.name: {s: [] for s in systems} for c in cases}
    groups = {n: [c for c in cases if c.ranks == n] for n in dict.fromkeys(c.ranks for c in cases)}
    for n, group in groups.items():
        with contextlib.ExitStack() as stack:
            ranks = {}
            for system in systems:
                cmd, summary = side(system, ds_python)
                cmd += ["--warmup", args.warmup]
                ranks[system] = stack.enter_context(
                    launch.RankGroup(_local_ranks(cmd, n), summary, args.timeout))
            for rep in range(args.reps):
                order = systems if rep % 2 == 0 else systems[::-1]
                for system in order:
                    got = ranks[system].run(
                        group, tmp / f"{system}-{rep}-{n}ranks", profile=rep == 0,
                        steps=args.steps if rep == 0 else args.quick_steps, port=free_port())
                    for case in group:
                        r = got[case.name]
                        runs[case.name][system].append(r)
                        say(f"  {case.name:<10} rep {rep + 1} {system:<17} " + (r.get("error") or (
                            f"{r['tokens_per_sec']:,.0f} tok/s, loss {r['loss']:.5f}, "
                            f"rss {max(r['peak_rss_mib']):.0f} MiB  ({r['command_wall_s']:.0f} s "
                            f"for the {len(group)} case{'s' * (len(group) > 1)})")))
    return [{"case": workload.case_dict(c), "runs": runs[c.name],
             "summary": summarize(runs[c.name])} for c in cases]


def summarize(systems: dict) -> dict:
    ds = systems["deepspeed"]
    out = {}
    for name in ("giantmodel", "giantmodel-tuned"):
        runs = systems.get(name)
        if not runs:
            continue
        pairs = [(g, d) for g, d in zip(runs, ds) if "error" not in g and "error" not in d]
        if not pairs:
            out[name] = {"error": "no successful pair of runs"}
            continue
        ratios = [g["tokens_per_sec"] / d["tokens_per_sec"] for g, d in pairs]
        g0, d0 = pairs[0]
        loss_diff = abs(g0["loss"] - d0["loss"]) / abs(d0["loss"])
        out[name] = {
            "ratio_median": statistics.median(ratios), "ratios": ratios,
            "tokens_per_sec_median": statistics.median(g["tokens_per_sec"] for g, _ in pairs),
            "ds_tokens_per_sec_median": statistics.median(d["tokens_per_sec"] for _, d in pairs),
            "peak_rss_mib": max(g0["peak_rss_mib"]), "ds_peak_rss_mib": max(d0["peak_rss_mib"]),
            "loss": g0["loss"], "ds_loss": d0["loss"], "steps": len(g0["losses"]),
            "loss_rel_diff": loss_diff}
        bound = [g["tokens_per_sec"] / d["tokens_per_sec"]
                 for g, d in zip(runs, systems.get("deepspeed-bound", []))
                 if "error" not in g and "error" not in d]
        if bound:
            out[name] |= {"ratio_vs_bound_median": statistics.median(bound),
                          "ratios_vs_bound": bound}
    return out


def collectives_case(ds_python: Path, ranks: int, tmp: Path, timeout: float) -> dict:
    """Case 3 in DeepSpeed's environment (collectives.py starts its own ranks)."""
    out = tmp / f"collectives-{ranks}.json"
    t0 = time.perf_counter()
    proc = subprocess.run([str(c) for c in (ds_python, HERE / "collectives.py", "--ranks",
                                            ranks, "--out", out)],
                          env=_env(), capture_output=True, text=True, check=False,
                          timeout=timeout)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        return {"error": f"exit {proc.returncode}: {tail}", "wall_s": time.perf_counter() - t0}
    return json.loads(out.read_text())


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_avg_start": workload.load_avg()}


def format_tables(result: dict) -> str:
    head = ("| case | giantmodel tok/s | DeepSpeed tok/s | default / DS (median of reps) | "
            "tuned / DS | default / DS cores bound | peak RSS MiB gm / DS | "
            "loss after N steps gm / DS (rel. diff) |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        s = c["summary"]
        g, t = s.get("giantmodel", {}), s.get("giantmodel-tuned", {})
        if "ratio_median" not in g:
            lines.append(f"| {c['case']['name']} | error: {g.get('error', '?')} | | | | | | |")
            continue
        tuned = f"{t['ratio_median']:.2f}x" if "ratio_median" in t else "-"
        bound = (f"{g['ratio_vs_bound_median']:.2f}x "
                 f"({', '.join(f'{r:.2f}' for r in g['ratios_vs_bound'])})"
                 if "ratio_vs_bound_median" in g else "-")
        lines.append(
            f"| {c['case']['name']} | {g['tokens_per_sec_median']:,.0f} | "
            f"{g['ds_tokens_per_sec_median']:,.0f} | **{g['ratio_median']:.2f}x** "
            f"({', '.join(f'{r:.2f}' for r in g['ratios'])}) | {tuned} | {bound} | "
            f"{g['peak_rss_mib']:.0f} / {g['ds_peak_rss_mib']:.0f} | "
            f"{g['loss']:.5f} / {g['ds_loss']:.5f} ({g['loss_rel_diff']:.1e}, {g['steps']} steps) |")
    return "\n".join(lines)


def format_profiles(result: dict) -> str:
    keys = ("compute_ops", "framework", "comm", "optimizer", "data", "idle")
    lines = ["| case | system | step ms | " + " | ".join(keys) + " |",
             "|---|---|---|" + "---|" * len(keys)]
    for c in result["cases"]:
        for system, runs in c["runs"].items():
            p = runs[0].get("profile") if runs else None
            if not p:
                continue
            lines.append(f"| {c['case']['name']} | {system} | {p['wall_ms']:.0f} | "
                         + " | ".join(f"{p.get(k, 0):.0f}" for k in keys) + " |")
    return "\n".join(lines)


def cpu_suite(args) -> dict:
    t_start = time.perf_counter()
    result = {"suite": "cpu", "machine": machine(), "skipped": SKIPPED, "tuned": list(TUNED),
              "cases": []}
    say(f"[peers] {result['machine']}")
    t0 = time.perf_counter()
    ds_python = venvs.ensure(venvs.DEEPSPEED, say)
    result["setup_s"] = {"deepspeed_env": round(time.perf_counter() - t0, 1),
                         "deepspeed_ops": round(venvs.prebuild_deepspeed_ops(
                             ds_python, _env(), say), 1)}
    for name, why in SKIPPED.items():
        say(f"[peers] {name}: skipped: {why}")
    if args.cases == "none":
        cases = []
    elif args.cases:
        cases = [workload.find_case(n) for n in args.cases.split(",")]
    else:
        cases = list(workload.CPU_CASES)
    with tempfile.TemporaryDirectory(prefix="gm-peers-") as tmp:
        if cases:
            result["cases"] = run_cases(cases, ds_python, args, Path(tmp))
        if args.cluster_rates:
            import cluster_case
            result["cluster"] = cluster_case.run(
                ds_python, [int(x) for x in args.cluster_rates.split(",")],
                [int(x) for x in args.cluster_stages.split(",")], args.reps,
                args.cluster_steps, _env(), Path(tmp), say, args.timeout)
        if not args.no_collectives:
            result["collectives"] = []
            for ranks in args.coll_ranks:
                coll = collectives_case(ds_python, ranks, Path(tmp), args.timeout)
                result["collectives"].append(coll)
                if "error" in coll:
                    say(f"  collectives ({ranks} ranks): {coll['error']}")
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    result["machine"]["load_avg_end"] = workload.load_avg()
    return result


def merge(results: list[dict]) -> dict:
    """Several partial runs (e.g. one case each, on a shared host) as one result."""
    out = dict(results[0])
    out["cases"] = [c for r in results for c in r.get("cases", [])]
    out["collectives"] = [c for r in results for c in r.get("collectives", [])]
    clusters = [r["cluster"] for r in results if r.get("cluster", {}).get("results")]
    if clusters:
        out["cluster"] = {"results": [x for c in clusters for x in c["results"]]}
    out["wall_s"] = sum(r.get("wall_s", 0) for r in results)
    out["machine"] = {**results[0]["machine"],
                      "load_avg_end": results[-1]["machine"].get("load_avg_end")}
    out["parts"] = [{"date": r["machine"]["date"], "load": [r["machine"].get("load_avg_start"),
                     r["machine"].get("load_avg_end")], "wall_s": r.get("wall_s")}
                    for r in results]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=("cpu", "gpu"), required=True)
    p.add_argument("--cases", default="", help="comma-separated subset of the CPU cases, or none")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="steps in the first rep (loss check)")
    p.add_argument("--quick-steps", type=int, default=6, help="steps in later reps (the first 2 untimed)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of a run")
    p.add_argument("--no-tuned", action="store_true", help="skip the hand-tuned giantmodel runs")
    p.add_argument("--no-collectives", action="store_true")
    p.add_argument("--ds-bound", action="store_true",
                   help="also run DeepSpeed with each rank pinned to its own cores (its launcher's "
                        "--bind_cores_to_rank), as giantmodel pins them by default "
                        "(train.bind_cores)")
    p.add_argument("--cluster-rates", default="1000",
                   help="case 2: inter-host link rates (Mbit/s) of the emulated 2-host "
                        "cluster, comma-separated (the issue's pair: 1000,200); empty to skip")
    p.add_argument("--cluster-stages", default="1,2,3", help="case 2: ZeRO stages")
    p.add_argument("--cluster-steps", type=int, default=6,
                   help="case 2: steps per run (the first 2 untimed)")
    p.add_argument("--coll-ranks", type=lambda s: [int(x) for x in s.split(",")], default=[2])
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--titan-assets", help="GPU suite: local Llama 3 tokenizer directory "
                   "for torchtitan")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--report", nargs="+", metavar="JSON",
                   help="print the tables of earlier --json files (merged) instead of running")
    args = p.parse_args(argv)
    if args.suite == "gpu":
        import gpu
        return gpu.main(args)
    result = merge([json.loads(Path(f).read_text()) for f in args.report]) if args.report \
        else cpu_suite(args)
    say("\n" + format_tables(result))
    say("\nOne step, rank 0, ms by category (first rep):\n" + format_profiles(result))
    if result.get("cluster", {}).get("results"):
        import cluster_case
        say("\nCase 2, emulated 2 hosts x 2 ranks:\n" + cluster_case.format_table(result["cluster"]))
    for coll in result.get("collectives", []):
        if "rows" in coll:
            import collectives
            say("\nAll-reduce, giant vs DeepSpeed shm:\n"
                + collectives.format_table(coll["rows"], coll["ranks"]))
    say(f"\n[peers] suite wall time {result['wall_s']:.0f} s; load avg "
        f"{result['machine']['load_avg_start']} -> {result['machine']['load_avg_end']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
