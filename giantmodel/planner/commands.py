"""``giantmodel estimate`` and ``giantmodel plan``: argument setup and entry
points. Both run anywhere: no GPU and no process group."""

from __future__ import annotations

import argparse
import json
import sys
import time

from giantmodel.config import dump_config, load_config
from giantmodel.config.errors import ConfigError
from giantmodel.planner.hardware import get_profile, single_profile
from giantmodel.planner.layer_recompute import layer_recompute_plan
from giantmodel.planner.layout import Cluster, resolve_layout
from giantmodel.planner.memory import memory_report
from giantmodel.planner.perf import estimate_time
from giantmodel.planner.placement import add_topology_argument, place_on_topology
from giantmodel.planner.plots import plot_memory, plot_plan, pyplot
from giantmodel.planner.report import estimate_dict, format_estimate, format_plan, pipeline_report
from giantmodel.planner.sd import run_sd_estimate, run_sd_plan
from giantmodel.planner.search import apply_layout, search, smallest_fitting_cluster, verified


def _common(p: argparse.ArgumentParser, gpu_required: bool) -> None:
    p.add_argument("--config", default=None,
                   help="job YAML (default: the embedded default run)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides, e.g. train.micro_batch_size=2")
    p.add_argument("--gpu", default=None,
                   help="hardware profile: h100-sxm, h100-pcie, h200, a100-80g, a100-40g, "
                        "a800, v100-32g, v100-16g, cpu, measured (what `giantmodel bench hw` "
                        "wrote), or one from --hw-file" + ("" if gpu_required else "; default cpu"))
    p.add_argument("--hw-file", default=None, help="YAML with extra hardware profiles")
    p.add_argument("--profile", default=None,
                   help="a profile YAML written by `giantmodel bench hw --out FILE` (instead of --gpu)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node (default: the profile's, 8 for GPUs, 1 for cpu)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_estimate_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, gpu_required=False)
    p.add_argument("--plot", default=None, metavar="F.png",
                   help="also draw the memory per pipeline rank as stacked bars against the "
                        "device's capacity (needs matplotlib)")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, gpu_required=True)
    p.add_argument("--top", type=int, default=5, help="how many layouts to print")
    p.add_argument("--out", default=None, help="write the best layout as a runnable YAML here")
    p.add_argument("--plot", default=None, metavar="F.png",
                   help="also draw the best layout's pipeline timeline and the top layouts' "
                        "tokens/s and memory (needs matplotlib)")
    add_topology_argument(p)


def load_for_planning(path, overrides):
    """The job config, validated in the parts the planner reads; data paths
    and tokenizers need not exist on the machine that plans."""

    cfg = load_config(path, overrides, validate=False)
    cfg.model.validate()
    cfg.train.validate()
    cfg.parallel.validate()
    if cfg.recompute_layers is not None and len(cfg.recompute_layers) != cfg.model.num_layers:
        raise ConfigError(f"has {len(cfg.recompute_layers)} entries but model.num_layers is "
                          f"{cfg.model.num_layers}", "recompute_layers")
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len {cfg.train.seq_len} exceeds model.max_seq_len "
                          f"{cfg.model.max_seq_len}", "train.seq_len")
    return cfg


def _load(args):
    cfg = load_for_planning(args.config, args.overrides)
    if args.profile and args.gpu:
        raise ConfigError("give either --gpu or --profile, not both", "--profile")
    if args.profile:
        hw = single_profile(args.profile)
    elif args.gpu is None and getattr(args, "top", None) is not None:
        raise ConfigError("plan needs the hardware: --gpu NAME or --profile FILE", "--gpu")
    else:
        hw = get_profile(args.gpu or "cpu", args.hw_file)
    gpn = args.gpus_per_node or hw.gpus_per_node
    if args.nodes < 1 or gpn < 1:
        raise ConfigError(f"need --nodes >= 1 and --gpus-per-node >= 1, got {args.nodes} "
                          f"and {gpn}", "--nodes")
    return cfg, hw, Cluster(args.nodes, gpn)


def _check_plot(args, cfg, command: str) -> None:
    """Before the work: --plot needs matplotlib and an LM config."""
    if args.plot:
        pyplot(f"{command} --plot")
        if cfg.objective == "diffusion":
            raise ConfigError(f"{command} --plot draws language-model layouts; a diffusion "
                              "config has no pipeline to draw", "--plot")


def run_estimate(args) -> int:
    """Predict memory and speed of the config's own layout."""
    cfg, hw, cluster = _load(args)
    _check_plot(args, cfg, "estimate")
    if cfg.objective == "diffusion":
        return run_sd_estimate(cfg, hw, cluster, args.json)
    layout = resolve_layout(cfg, cluster)
    mem = memory_report(cfg.model, layout, hw)
    perf = estimate_time(cfg.model, layout, hw, cluster, cfg.train.global_batch_size)
    d = estimate_dict(cfg.model, layout, hw, cluster, mem, perf,
                      pipeline_report(cfg.model, layout, hw, cluster))
    d["memory"]["layer_recompute"] = layer_recompute_plan(cfg.model, layout, hw, cluster)
    print(json.dumps(d, indent=2) if args.json else format_estimate(d))
    if args.plot:
        plot_memory(mem, layout, hw.name, args.plot,
                    f"{cfg.model.name} on {cluster} {hw.name}: {layout.describe()}")
        print(f"wrote {args.plot}", file=sys.stderr)   # stderr: --json stays parseable
    return 0


def run_plan(args) -> int:
    """Search layouts, print the top K, write the best as YAML."""

    if args.top < 1:
        raise ConfigError(f"--top must be >= 1, got {args.top}", "--top")
    cfg, hw, cluster = _load(args)
    _check_plot(args, cfg, "plan")
    if cfg.objective == "diffusion":
        return run_sd_plan(cfg, hw, cluster, args.top, args.out, args.json)
    start = time.monotonic()
    cands = search(cfg, hw, cluster)
    best = verified(cfg, cands, cluster, args.top)
    if not best:
        need = smallest_fitting_cluster(cfg, hw, cluster.gpus_per_node)
        where = (f"the smallest cluster that would fit is {need} {hw.name} "
                 f"({need.world} GPUs, with zero 3, full recompute and activation offload)"
                 if need else "no cluster up to 4096 nodes fits it")
        raise ConfigError(
            f"{cfg.model.name} ({cfg.model.num_params() / 1e9:.2f}B params, seq_len "
            f"{cfg.train.seq_len}, global batch {cfg.train.global_batch_size}) fits no layout on "
            f"{cluster} {hw.name} ({hw.memory_bytes / 1e9:.0f} GB each); {where}")
    elapsed = time.monotonic() - start
    top = best[0]
    run_cfg = apply_layout(cfg, top.layout)
    placed = (place_on_topology(run_cfg, args.topology, cluster.world) if args.topology
              else None)
    if args.out:
        dump_config(run_cfg, args.out)
    if args.json:
        rows = [estimate_dict(cfg.model, c.layout, hw, cluster, c.memory, c.perf) for c in best]
        extra = {"placement": vars(placed)} if placed else {}
        print(json.dumps({"searched": len(cands), "seconds": elapsed, "top": rows,
                          "out": args.out, **extra}, indent=2))
    else:
        print(format_plan(best, cluster, hw.name))
        if placed:
            print(f"best layout on {args.topology}: {placed.log_line()}")
        print(f"{len(cands)} fitting layouts ranked in {elapsed:.1f} s")
        pl = pipeline_report(cfg.model, top.layout, hw, cluster)
        if len(pl["stages"]) > 1:
            print(f"best layout's pipeline imbalance {pl['imbalance']:.3f}; "
                  + (pl["suggestion"] if pl.get("suggested_pp_layers") is None else
                     f"suggested parallel.pp_layers={pl['suggested_pp_layers']}"))
        if args.out:
            print(f"wrote {args.out}: giantmodel train --config {args.out}")
    if args.plot:
        plot_plan(cfg.model, best, hw, cluster, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
