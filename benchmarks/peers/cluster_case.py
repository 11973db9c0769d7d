"""Case 2: 2 emulated hosts x 2 ranks (giantmodel.testing.cluster: network
namespaces, tc-shaped links), dp4 at ZeRO 1/2/3, at 1 Gbit/s and 200 Mbit/s
between hosts. Ranks 0,1 on host0 and 2,3 on host1, started srun-style.

The work: the suite's model at micro-batch 1 (one 256-token sequence per
rank, global batch 4), so that moving the gradients and parameters is most
of the step, as it is for a GPU cluster on such links; at micro-batch 4 the
4 ranks sharing 2 cores are compute-bound and no communication strategy
shows (benchmarks/results/peers-cluster-2026-11-24.md).

Systems: giantmodel at its defaults (``comm.backend: auto`` picks the giant
backend, hierarchical across the emulated hosts: it finds them by host
name), DeepSpeed at its defaults, and DeepSpeed with its best documented
settings (``overlap_comm``, ``contiguous_gradients``, 50M-element buckets).
Ratios are giantmodel over each DeepSpeed variant, median of the alternating
reps; the first rep of each system also profiles one step of rank 0.

    PYTHONPATH=. python benchmarks/peers/cluster_case.py --rates 1000,200 --json c.json

Needs root and the tools the harness names; prints why not and exits 0
otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ds_side
import gm_side
import launch
import workload

DS_TUNED = {"zero_optimization": {"overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": 50_000_000,
                                  "allgather_bucket_size": 50_000_000}}
HOSTS = [[0, 1], [2, 3]]


def systems(ds_python: Path) -> dict[str, tuple[list, object]]:
    """Each system's command (less ``--serve``) and the summary of its ranks' figures."""
    gm = [sys.executable, HERE / "gm_side.py"]
    ds = [ds_python, HERE / "ds_side.py"]
    return {"giantmodel": (gm, gm_side.summarize), "deepspeed": (ds, ds_side.summarize),
            "deepspeed-tuned": (ds + ["--ds-config", json.dumps(DS_TUNED)], ds_side.summarize)}


def run(ds_python: Path, rates: list[int], stages: list[int], reps: int, steps: int,
        env: dict, tmp: Path, say=print, timeout: float = 600) -> dict:
    """Each system's 4 ranks are launched once per link rate and serve every
    rep (launch.py); each rep runs the systems in turn, alternating their
    order, and each runs every stage in turn, each in a fresh child of the
    ranks."""
    from giantmodel.testing.cluster import EmulatedCluster, Link, unavailable_reason

    why = unavailable_reason()
    if why is not None:
        say(f"[peers] case 2 (emulated 2-host cluster) skipped: {why}")
        return {"skipped": why}
    out: dict = {"rates_mbit": rates, "results": []}
    cmds = systems(ds_python)
    cases = [workload.find_case(f"2host-zero{z}") for z in stages]
    ports = itertools.count(29500, len(cases))
    for rate in rates:
        runs = {c.name: {s: [] for s in cmds} for c in cases}
        with EmulatedCluster(2, link=Link(rate_mbit=rate or None)) as c, \
                contextlib.ExitStack() as stack:
            ranks = {}
            for system, (cmd, summary) in cmds.items():
                argv = [str(a) for a in cmd] + ["--warmup", "2", "--serve"]
                ranks[system] = stack.enter_context(launch.RankGroup(
                    functools.partial(c.popen_ranks, HOSTS, argv, env=env), summary, timeout))
            for rep in range(reps):
                order = list(cmds) if rep % 2 == 0 else list(reversed(cmds))
                for system in order:
                    got = ranks[system].run(cases, tmp / f"{rate}-{system}-{rep}", steps=steps,
                                            profile=rep == 0, port=next(ports))
                    for case in cases:
                        r = got[case.name]
                        runs[case.name][system].append(r)
                        say(f"  {rate} Mbit/s {case.name} rep {rep + 1} {system:<17} "
                            + (r.get("error") or f"{r['tokens_per_sec']:,.0f} tok/s, "
                               f"loss {r['loss']:.5f}  ({r['command_wall_s']:.0f} s for the "
                               f"{len(cases)} stages)"))
        out["results"] += [{"rate_mbit": rate, "case": k.name, "runs": runs[k.name],
                            "ratios": _ratios(runs[k.name])} for k in cases]
    return out


def _ratios(runs: dict) -> dict:
    out = {}
    for peer in ("deepspeed", "deepspeed-tuned"):
        pairs = [(g, d) for g, d in zip(runs["giantmodel"], runs[peer])
                 if "error" not in g and "error" not in d]
        if pairs:
            out[f"giantmodel/{peer}"] = statistics.median(
                g["tokens_per_sec"] / d["tokens_per_sec"] for g, d in pairs)
    return out


def _median_tps(runs: list) -> str:
    ok = [r["tokens_per_sec"] for r in runs if "error" not in r]
    return f"{statistics.median(ok):,.0f}" if ok else "error"


def _comm_ms(runs: list) -> str:
    prof = next((r.get("profile") for r in runs if r.get("profile")), None)
    return f"{prof['comm']:.0f} / {prof['wall_ms']:.0f}" if prof else "-"


def format_table(result: dict) -> str:
    lines = ["| link | case | giantmodel / DS | giantmodel / DS tuned | tok/s gm / DS / DS tuned "
             "| exposed comm / step ms, gm / DS |", "|---|---|---|---|---|---|"]
    for r in result.get("results", []):
        q = {k: f"{v:.2f}x" for k, v in r["ratios"].items()}
        cells = [q.get(k, "error") for k in ("giantmodel/deepspeed", "giantmodel/deepspeed-tuned")]
        runs = r["runs"]
        tps = " / ".join(_median_tps(runs[s]) for s in ("giantmodel", "deepspeed",
                                                         "deepspeed-tuned"))
        comm = f"{_comm_ms(runs['giantmodel'])} / {_comm_ms(runs['deepspeed'])}"
        lines.append(f"| {r['rate_mbit']} Mbit/s | {r['case']} | **{cells[0]}** | "
                     f"**{cells[1]}** | {tps} | {comm} |")
    return "\n".join(lines)


def main() -> int:
    import tempfile

    import venvs
    from run import _env

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="1000,200")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json")
    a = p.parse_args()
    ds_python = venvs.ensure(venvs.DEEPSPEED)
    with tempfile.TemporaryDirectory(prefix="gm-peers-cluster-") as tmp:
        result = run(ds_python, [int(x) for x in a.rates.split(",")],
                     [int(x) for x in a.stages.split(",")], a.reps, a.steps, _env(), Path(tmp))
    print(format_table(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
