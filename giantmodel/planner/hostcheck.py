"""The planner against real training steps on this host (CPU ranks).

:func:`run_check` starts the ranks once for memory, then once per layout
for time. The first launch records, for each layout, every rank's peak RSS
above what the process held before the engine was built (:func:`rss_rank`).
The timed launches (:func:`time_rank`) each build one engine, as a training
process does; the first of them (of each round) also measures the host as a planner profile
(``hwbench.measure``, with all ranks busy at once, as they are in training,
the all-reduce bandwidth of the group, and DTensor's per-op cost and the
loss per logit at the checked model's size). Each runs warm-up and timed
optimizer steps on synthetic batches (step time: slowest rank, median over
steps). :func:`compare` then predicts both with the planner from the
measured profile.

Used by ``benchmarks/planner_cpu_check.py`` and tests/test_planner_host.py.
Memory and time need different allocator settings, hence the two launches.
For peak RSS each rank has glibc serve blocks of 64 KiB and more by mmap,
so a freed tensor leaves the RSS at once (otherwise RSS keeps every freed
block and reads high). But then every tensor a step allocates is a fresh
mapping whose pages fault in one by one: on this host that made a step 37%
slower than the same step in a plain process (1.04 s against 0.80 s, one
rank of the check's model). Timed steps run in fresh processes under
glibc's own settings, as a training process does, rather than in the
RSS passes' processes switched to a fixed 32 MiB threshold, as before.
"""

from __future__ import annotations

import gc
import statistics
import time

from giantmodel.comm import backend_for
from giantmodel.config import load_config
from giantmodel.core.precision import Precision
from giantmodel.distributed.init import WorldInfo, bind_cpu_cores
from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.objectives import LanguageModel
from giantmodel.parallel.engine import TrainEngine
from giantmodel.planner import hwbench
from giantmodel.planner.hardware import profile_from_dict
from giantmodel.planner.layout import Cluster, resolve_layout
from giantmodel.planner.memory import memory_report
from giantmodel.planner.perf import estimate_time
from giantmodel.testing import run_ranks

MIB = 2 ** 20
HOST_CHECK_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def use_mmap_for_large_blocks() -> None:
    """Serve allocations of 64 KiB and more by mmap, so that a freed tensor
    leaves the RSS at once (glibc otherwise keeps large freed blocks in its
    heap, and RSS then shows what was, not what is)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)    # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 * 1024)   # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _trim() -> None:
    """Hand freed heap pages back to the OS, so RSS shows what is live (with
    MALLOC_MMAP_THRESHOLD_ set, large tensors are mmapped and go back on free)."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> None:
    """Start a new VmHWM window (Linux: writing 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _batches(cfg, step: int, data_rank: int, data_world: int) -> list[dict]:
    import torch

    G, T, V = cfg.train.global_batch_size, cfg.train.seq_len, cfg.model.vocab_size
    gen = torch.Generator().manual_seed(7919 * (step + 1))
    seq = torch.randint(0, V, (G, T + 1), generator=gen)
    per = G // data_world
    ids = seq[data_rank * per:(data_rank + 1) * per, :-1].contiguous()
    labels = seq[data_rank * per:(data_rank + 1) * per, 1:].contiguous()
    mbs = cfg.train.micro_batch_size
    return [{"input_ids": ids[i:i + mbs], "labels": labels[i:i + mbs]}
            for i in range(0, per, mbs)]


def _run_steps(cfg, steps: int, usage_from: int = 0) -> tuple[list[float], dict]:
    """Build ``cfg``'s engine in this process group and run ``steps`` optimizer
    steps on synthetic batches; each step's seconds (slowest rank's), and this
    rank's page faults and system seconds per step from step ``usage_from``."""
    import resource

    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.from_config(cfg, world)
    if world > 1:
        dims.build_mesh("cpu")
    engine = TrainEngine(LanguageModel(cfg.model, data=cfg.data, train=cfg.train), dims,
                         torch.device("cpu"), parallel=cfg.parallel, recompute=cfg.recompute,
                         recompute_layers=cfg.recompute_layers, offload=cfg.offload,
                         compile=False, precision=cfg.precision, bucket_mb=cfg.parallel.bucket_mb)
    precision = Precision(cfg.precision, "cpu")
    opt = engine.build_optimizer(cfg.optim)
    times, usage = [], None
    for step in range(steps):
        if step == usage_from:
            usage = resource.getrusage(resource.RUSAGE_SELF)
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        engine.forward_backward(_batches(cfg, step, engine.data_rank, engine.data_world),
                                precision)
        engine.clip_grad_norm_(cfg.optim.grad_clip)
        engine.optimizer_step(opt)
        engine.zero_grad(opt)
        times.append(time.perf_counter() - t0)
    end = resource.getrusage(resource.RUSAGE_SELF)
    n = max(1, steps - usage_from)
    per_step = {"faults_per_step": (end.ru_minflt - usage.ru_minflt) / n if usage else 0.0,
                "sys_s_per_step": (end.ru_stime - usage.ru_stime) / n if usage else 0.0}
    if world > 1:
        t = torch.tensor(times)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)   # a step ends when its slowest rank does
        times = t.tolist()
        dims.destroy_mesh()
    del engine, opt
    gc.collect()
    return times, per_step


def rss_layout(cfg, steps: int) -> dict:
    """RSS before the engine is built and its peak over the build and
    ``steps`` optimizer steps (call under :func:`use_mmap_for_large_blocks`)."""
    _trim()
    base = _status_kib("VmRSS") * 1024
    _reset_peak_rss()
    _run_steps(cfg, steps)
    return {"base_rss": base, "peak_rss": _status_kib("VmHWM") * 1024}


def time_layout(cfg, warmup: int, steps: int) -> dict:
    """Median seconds of ``steps`` optimizer steps after ``warmup`` untimed
    ones (in a process under glibc's default allocator settings), with this
    rank's page faults and system seconds per timed step (a step that faults
    its tensors in afresh spends a tenth of its time in the kernel)."""
    times, usage = _run_steps(cfg, warmup + steps, usage_from=warmup)
    return {"step_s": statistics.median(times[warmup:]), "steps_s": times[warmup:]} | usage


def _init_group(cfg, rank: int, world: int) -> None:
    """The default process group on the backend training would get for
    ``cfg`` on this host (``comm.backend: auto`` is the giant backend for
    ranks on one host), so the profile and the steps measure that backend."""
    import torch.distributed as dist

    name, opts = backend_for(cfg.comm, "cpu", world)
    dist.init_process_group(name, rank=rank, world_size=world, pg_options=opts)


def _start(cfgs, rank: int, world: int) -> bool:
    import torch
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        # pinned as the trainer pins ranks on a CPU (train.bind_cores)
        if cfgs[0].train.bind_cores:
            bind_cpu_cores(WorldInfo(rank, world, rank, world), threads=1)
        _init_group(cfgs[0], rank, world)
    torch.set_num_threads(1)
    return own_group


def _finish(own_group: bool) -> str:
    import torch.distributed as dist

    backend = dist.get_backend()
    if own_group:
        dist.destroy_process_group()
    return backend


def rss_rank(rank: int, world: int, base_overrides: list[str], layouts: list[list[str]],
             steps: int) -> dict:
    """run_ranks target (run with :data:`HOST_CHECK_ENV`; with ``backend=None``
    it starts its own group): every layout's RSS before the build and peak
    over the build and ``steps`` optimizer steps on this rank."""
    cfgs = [load_config(overrides=list(base_overrides) + list(o)) for o in layouts]
    own_group = _start(cfgs, rank, world)
    use_mmap_for_large_blocks()
    # one step first: lazy initialisation (process-group buffers, kernels) is
    # not part of any layout's memory
    rss_layout(cfgs[0], 1)
    out = [rss_layout(cfg, steps) | {"overrides": list(o)} for o, cfg in zip(layouts, cfgs)]
    return {"rank": rank, "layouts": out, "backend": _finish(own_group)}


def time_rank(rank: int, world: int, base_overrides: list[str], layouts: list[list[str]],
              warmup: int = 2, steps: int = 3, profile_kw: dict | None = None,
              profile: bool = True) -> dict:
    """run_ranks target (``backend=None``: it starts its own group): the
    measured profile (unless ``profile`` is False), then every layout's step
    times on this rank."""
    cfgs = [load_config(overrides=list(base_overrides) + list(o)) for o in layouts]
    own_group = _start(cfgs, rank, world)
    prof = None
    if profile:
        # DTensor's per-op cost and the loss's per logit grow with the sizes: time them on
        # this model
        model = {"model": cfgs[0].model,
                 "tokens": cfgs[0].train.micro_batch_size * cfgs[0].train.seq_len}
        prof = hwbench.measure("cpu", **(model | (profile_kw or {})))
    out = [time_layout(cfg, warmup, steps) | {"overrides": list(o)}
           for o, cfg in zip(layouts, cfgs)]
    return {"rank": rank, "profile": prof, "layouts": out, "backend": _finish(own_group)}


def run_check(base_overrides: list[str], layouts: list[list[str]], warmup: int = 2,
              steps: int = 3, profile_kw: dict | None = None, world: int = 2,
              timeout: float = 900, rounds: int = 1) -> list[dict]:
    """Measure on ``world`` ranks of this host: peak RSS in one launch, then
    the profile with the first layout's steps, then each other layout's steps
    in a launch of its own, as training builds one engine per process (in
    one launch the check's later layouts ran 5-10% slower than when timed
    first, and cp2, the last, up to 0.13 s per step); per rank, what
    :func:`compare` takes.

    ``rounds`` > 1 times every layout that many times, the layouts in turn
    (the order rotated each round), each round measuring the profile afresh
    in its first launch: on a shared VM a layout's step moved by up to 40%
    between two runs minutes apart, the host's speed drifting, not the
    layout's, so :func:`compare` sets each round's steps against the
    profile measured beside them (``profiles``, ``rounds_step_s``)."""
    mem = run_ranks(rss_rank, world, base_overrides, layouts, warmup + steps,
                    timeout=timeout, backend=None, env=HOST_CHECK_ENV, start="spawn")
    timed: list[dict] | None = None
    for k in range(rounds):
        for j in range(len(layouts)):
            i = (j + k) % len(layouts)
            part = run_ranks(time_rank, world, base_overrides, [layouts[i]], warmup, steps,
                             profile_kw, j == 0, timeout=timeout, backend=None,
                             start="spawn")
            if timed is None:
                timed = [p | {"layouts": [None] * len(layouts), "profiles": []} for p in part]
            for t, p in zip(timed, part, strict=True):
                _add_round(t["layouts"], i, p["layouts"][0])
                if j == 0:
                    t["profiles"].append(p["profile"])
    for t, m in zip(timed, mem, strict=True):
        for lt, lm in zip(t["layouts"], m["layouts"], strict=True):
            lt["step_s"] = statistics.median(lt["rounds_step_s"])
            lt.update(base_rss=lm["base_rss"], peak_rss=lm["peak_rss"])
    return timed


def _add_round(slots: list, i: int, measured: dict) -> None:
    """Fold one round's timing of layout ``i`` into ``slots``: the first
    round's record, with every round's median step in ``rounds_step_s``."""
    if slots[i] is None:
        slots[i] = measured | {"rounds_step_s": []}
    slots[i]["rounds_step_s"].append(measured["step_s"])


def compare(per_rank: list[dict], base_overrides: list[str]) -> list[dict]:
    """Planner predictions next to the measurements (profile of rank 0; RSS
    of the rank the planner says is the largest, and every rank's). With
    several rounds, each round's step is predicted from that round's profile
    and the ratio is the median of the rounds' ratios."""

    world = len(per_rank)
    profiles = per_rank[0].get("profiles") or [per_rank[0]["profile"]]
    hws = [profile_from_dict("measured", p, "hostcheck") for p in profiles]
    cluster = Cluster(1, world)
    rows = []
    for i, first in enumerate(per_rank[0]["layouts"]):
        cfg = load_config(overrides=list(base_overrides) + first["overrides"], validate=False)
        layout = resolve_layout(cfg, cluster)
        gbs = cfg.train.global_batch_size
        preds = [estimate_time(cfg.model, layout, hw, cluster, gbs) for hw in hws]
        perf = preds[0]
        mem = memory_report(cfg.model, layout, hws[0])
        measured = [r["layouts"][i] for r in per_rank]
        rounds = first.get("rounds_step_s") or [first["step_s"]]
        # peak above the pre-build RSS, worst rank; predicted: the worst pp rank's peak
        grown = max(m["peak_rss"] - m["base_rss"] for m in measured)
        base = max(m["base_rss"] for m in measured)
        rows.append({
            "layout": " ".join(first["overrides"]) or "single", "describe": layout.describe(),
            "predicted_step_s": statistics.median(p.step_s for p in preds),
            "measured_step_s": first["step_s"],
            "measured_steps_s": first["steps_s"], "rounds_step_s": rounds,
            "rounds_predicted_s": [p.step_s for p in preds],
            "faults_per_step": [m["faults_per_step"] for m in measured],
            "sys_s_per_step": [m["sys_s_per_step"] for m in measured],
            "time_ratio": statistics.median(p.step_s / t for p, t in zip(preds, rounds,
                                                                         strict=True)),
            "predicted_rss": base + mem.peak_bytes_per_rank, "measured_rss": base + grown,
            "rss_ratio": (base + mem.peak_bytes_per_rank) / (base + grown),
            "predicted_growth": mem.peak_bytes_per_rank, "measured_growth": grown,
            "breakdown": perf.breakdown})
    return rows
