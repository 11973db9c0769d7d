"""Choose bucket size, chunk size and algorithm by measurement, cache the choice.

During warm-up every rank of the data-parallel group times the gradient sync
it is about to run (the model's gradient bytes, cut into buckets) for each
candidate. Times are maxed over ranks, so every rank sees the same numbers and
picks the same winner. The result is cached as JSON under a key made of the
machine type, model name, parameter count and world size; the next run with
the same key loads it and skips tuning. ``comm.autotune=false`` disables
tuning; ``comm.autotune_refresh=true`` measures again and overwrites.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from giantmodel.comm.backend import GiantProcessGroup
from giantmodel.config.comm import CommConfig

DEFAULT_BUCKET_MB = 25.0
BUCKET_CANDIDATES_MB = (1.0, 4.0, 16.0, 25.0, 64.0)
CHUNK_CANDIDATES_KB = (256, 1024, 4096)
# A smaller bucket starts syncing earlier in backward, so among buckets within
# this factor of the fastest sync, the smallest wins.
OVERLAP_SLACK = 1.05


@dataclass
class TuneResult:
    """What the tuner chose, and what it measured."""

    bucket_mb: float = DEFAULT_BUCKET_MB
    """DDP gradient bucket size (MiB)."""

    chunk_kb: int = 0
    """Shared-memory chunk (KiB); 0 when the group has no shared-memory core."""

    hierarchical: bool = False
    """Cross-node all-reduce is hierarchical (else flat gloo/NCCL)."""

    from_cache: bool = False
    """Loaded from the cache instead of measured."""

    seconds: dict[str, float] = field(default_factory=dict)
    """Measured sync time per candidate (max over ranks)."""


def machine_type() -> str:
    """A short description of the hardware the measurement is valid for."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "nogpu"
    return f"{platform.machine()}|{cpu}|{os.cpu_count()}cpu|{gpu}"


def cache_key(model_name: str, n_params: int, world_size: int, backend: str,
              machine: str | None = None) -> str:
    raw = json.dumps([machine or machine_type(), model_name, int(n_params), int(world_size),
                      backend])
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def cache_dir(cfg: CommConfig) -> Path:
    if cfg.autotune_cache_dir:
        return Path(cfg.autotune_cache_dir)
    base = os.environ.get("GIANTMODEL_CACHE", str(Path.home() / ".cache" / "giantmodel"))
    return Path(base) / "autotune"


def _time_sync(group, total_elems: int, bucket_elems: int, reps: int) -> float:
    """Seconds to all-reduce total_elems fp32 in buckets, max over ranks."""
    n_buckets = max(1, -(-total_elems // bucket_elems))
    buckets = [torch.ones(min(bucket_elems, total_elems - i * bucket_elems))
               for i in range(n_buckets)]
    dist.barrier(group=group)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        works = [dist.all_reduce(b, group=group, async_op=True) for b in buckets]
        for w in works:
            w.wait()
        best = min(best, time.perf_counter() - t0)
    t = torch.tensor([best], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _share(group, result: TuneResult | None) -> TuneResult:
    """Rank 0's result (or None) on every rank."""
    box = [result]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def measure(group, grad_bytes: int, reps: int = 3) -> TuneResult:
    """Time each candidate on ``group`` and return the winner (same on all ranks)."""

    total = max(1024, min(grad_bytes, 256 << 20) // 4)  # cap tuning cost on huge models
    res = TuneResult()
    giant = group if isinstance(group, GiantProcessGroup) and group.accelerated else None
    if giant is not None:
        algos = [True, False] if giant.topology.hierarchical else [giant.topology.hierarchical]
        best = None
        for chunk in CHUNK_CANDIDATES_KB:
            for hier in algos:
                giant.reconfigure(chunk_bytes=chunk * 1024, hierarchical=hier)
                s = _time_sync(group, total, min(total, 16 << 18), reps)
                res.seconds[f"chunk{chunk}k/{'hier' if hier else 'flat'}"] = s
                if best is None or s < best[0]:
                    best = (s, chunk, hier)
        _, res.chunk_kb, res.hierarchical = best
        giant.reconfigure(chunk_bytes=res.chunk_kb * 1024, hierarchical=res.hierarchical)
    times = {}
    for mb in BUCKET_CANDIDATES_MB:
        times[mb] = _time_sync(group, total, int(mb * (1 << 20)) // 4, reps)
        res.seconds[f"bucket{mb:g}MB"] = times[mb]
    fastest = min(times.values())
    res.bucket_mb = min(mb for mb, s in times.items() if s <= fastest * OVERLAP_SLACK)
    return res


def tune(group, cfg: CommConfig, model_name: str, n_params: int,
         grad_bytes: int | None = None) -> TuneResult:
    """Load the cached choice for this job, or measure and cache it.

    Collective over ``group``. With ``cfg.autotune`` off, returns the config's
    values (or defaults) without measuring. ``cfg.bucket_mb`` > 0 always wins
    over a tuned bucket size, ``cfg.chunk_kb`` > 0 over a tuned chunk.
    """
    if not cfg.autotune:
        return TuneResult(bucket_mb=cfg.bucket_mb or DEFAULT_BUCKET_MB, chunk_kb=cfg.chunk_kb)
    key = cache_key(model_name, n_params, group.size(), cfg.backend)
    path = cache_dir(cfg) / f"{key}.json"
    loaded = None
    if dist.get_rank() == dist.get_global_rank(group, 0) and path.exists() \
            and not cfg.autotune_refresh:
        try:
            loaded = TuneResult(**json.loads(path.read_text()))
            loaded.from_cache = True
        except (ValueError, TypeError):
            loaded = None  # a corrupt or old cache entry is re-measured
    loaded = _share(group, loaded)
    if loaded is not None:
        result = loaded
        _apply(group, result)
    else:
        result = measure(group, grad_bytes if grad_bytes is not None else 4 * n_params)
        if dist.get_rank() == dist.get_global_rank(group, 0):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(asdict(result), indent=1))
            os.replace(tmp, path)
    if cfg.bucket_mb > 0:
        result.bucket_mb = cfg.bucket_mb
    if cfg.chunk_kb > 0:
        result.chunk_kb = cfg.chunk_kb
        _apply(group, result)
    return result


def _apply(group, result: TuneResult) -> None:

    if isinstance(group, GiantProcessGroup) and result.chunk_kb:
        group.reconfigure(chunk_bytes=result.chunk_kb * 1024, hierarchical=result.hierarchical)
