"""The ``comm:`` section of a job config: which backend, and how it is tuned."""

from __future__ import annotations

from dataclasses import dataclass

from giantmodel.config.errors import ConfigError
from giantmodel.config.modes import refuse_unused

BACKENDS = ("auto", "gloo", "nccl", "giant")
HIERARCHICAL = ("auto", "on", "off")
# These tune the giant backend; other backends refuse them. ``autotune`` is
# not listed: turning the tuner off where there is none changes nothing.
_GIANT_ONLY = ("chunk_kb", "threads", "hierarchical", "node_size", "priority", "cuda_cpu_reduce",
               "autotune_refresh", "autotune_cache_dir", "bucket_mb")


@dataclass
class CommConfig:
    """Communication backend and its tuning."""

    backend: str = "auto"
    """Process-group backend: "gloo", "nccl", "giant" (shared-memory core with
    gloo/NCCL underneath) or "auto" (nccl when training on CUDA; on CPU, giant
    for several ranks on one host, else gloo). Tuning keys below need "giant" named."""

    chunk_kb: int = 0
    """Bytes (KiB) of each rank's shared-memory buffer; collectives are
    pipelined in chunks of this size. 0 = the tuned value, else 1024 (4096
    when a host runs more ranks than it has cores)."""

    threads: int = 0
    """Threads per rank for shared-memory copies and reductions. 0 = the
    host's cores divided by the ranks on it (at least 1)."""

    hierarchical: str = "auto"
    """Across nodes: "on" = intra-node reduce-scatter, per-local-rank
    inter-node all-reduce, intra-node all-gather; "off" = flat gloo/NCCL;
    "auto" = on when the group spans several equally sized nodes, except the
    all-to-all (expert-parallel dispatch), which stays flat unless "on": it
    sends the same bytes either way and was slower hierarchical on the
    emulated cluster (benchmarks/results/alltoall-hier-2026-11-28.md)."""

    node_size: int = 0
    """Ranks per node. 0 = learn it from the hosts' names. A value > 0 splits
    ranks into nodes of this size, to emulate several nodes on one host."""

    priority: bool = False
    """Run queued collectives by priority (first layers' gradient buckets
    first) instead of in issue order. Needs all of a group's ranks on one host."""

    cuda_cpu_reduce: bool = False
    """Reduce CUDA tensors on the host through pinned shared memory
    (CPU-Reduce, for PCIe hosts without peer access) instead of NCCL."""

    autotune: bool = True
    """Measure bucket size and algorithm during warm-up and cache the choice."""

    autotune_refresh: bool = False
    """Ignore a cached tuning result and measure again."""

    autotune_cache_dir: str = ""
    """Where tuning results are cached; "" = $GIANTMODEL_CACHE/autotune or
    ~/.cache/giantmodel/autotune."""

    bucket_mb: float = 0.0
    """Pin the gradient bucket size (MiB) that the giant backend's tuner
    writes into parallel.bucket_mb; 0 = measure it (25 when autotune is off)."""

    topology: str = "measure"
    """Links between ranks, for parallel.placement=auto: "measure" probes
    latency and bandwidth at start-up (a few seconds, cached per host set in
    $GIANTMODEL_CACHE/topology), or the path of a topology.yaml written by
    'giantmodel bench topology' or by hand (docs/placement.md)."""

    topology_refresh: bool = False
    """Measure the links again even when a cached measurement exists."""

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; use one of {BACKENDS}",
                              key="comm.backend")
        if self.chunk_kb < 0 or self.chunk_kb % 4:
            raise ConfigError(f"must be 0 (tuned) or a positive multiple of 4, got "
                              f"{self.chunk_kb}", key="comm.chunk_kb")
        if self.threads < 0:
            raise ConfigError(f"must be >= 0 (0 = automatic), got {self.threads}",
                              key="comm.threads")
        if self.hierarchical not in HIERARCHICAL:
            raise ConfigError(f"must be one of {HIERARCHICAL}, got {self.hierarchical!r}",
                              key="comm.hierarchical")
        if self.node_size < 0:
            raise ConfigError(f"must be >= 0 (0 = from host names), got {self.node_size}",
                              key="comm.node_size")
        if self.bucket_mb < 0:
            raise ConfigError(f"must be >= 0 (0 = tuned), got {self.bucket_mb}",
                              key="comm.bucket_mb")
        if not self.topology:
            raise ConfigError('must be "measure" or the path of a topology.yaml',
                              key="comm.topology")
        if self.cuda_cpu_reduce and self.backend not in ("giant",):
            raise ConfigError("CPU-Reduce is a feature of the giant backend; set "
                              "comm.backend=giant or comm.cuda_cpu_reduce=false",
                              key="comm.cuda_cpu_reduce")
        refuse_unused(self, "comm", "backend", dict.fromkeys(_GIANT_ONLY, ("giant",)))
