"""The ``comm:`` section of a job config: which backend, and how it is tuned."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from giantmodel.config.errors import ConfigError

BACKENDS = ("auto", "gloo", "nccl", "giant")
HIERARCHICAL = ("auto", "on", "off")

# The backend is created by torch inside init_process_group, which passes it
# only (store, rank, size, timeout); these variables carry the rest, and are
# inherited by ranks a launcher spawns.
ENV_PREFIX = "GIANTMODEL_COMM_"


@dataclass
class CommConfig:
    """Communication backend and its tuning."""

    backend: str = "auto"
    """Process-group backend: "gloo", "nccl", "giant" (shared-memory core with
    gloo/NCCL underneath) or "auto" (nccl when training on CUDA, else gloo)."""

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
    "auto" = on when the group spans several equally sized nodes."""

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
        if self.cuda_cpu_reduce and self.backend not in ("giant",):
            raise ConfigError("CPU-Reduce is a feature of the giant backend; set "
                              "comm.backend=giant or comm.cuda_cpu_reduce=false",
                              key="comm.cuda_cpu_reduce")

    def to_env(self) -> dict[str, str]:
        """The settings the backend reads when torch creates it."""
        out = {}
        for f in fields(self):
            if f.name in ("backend", "bucket_mb") or f.name.startswith("autotune"):
                continue
            value = getattr(self, f.name)
            out[ENV_PREFIX + f.name.upper()] = str(int(value) if isinstance(value, bool) else value)
        return out


@dataclass
class BackendSettings:
    """What a giant process group reads at creation (from the environment)."""

    chunk_bytes: int = 0  # 0 = automatic, see default_chunk_bytes
    threads: int = 0
    hierarchical: str = "auto"
    node_size: int = 0
    priority: bool = False
    cuda_cpu_reduce: bool = False

    @classmethod
    def from_env(cls) -> BackendSettings:
        env = os.environ
        p = ENV_PREFIX
        s = cls()
        chunk_kb = int(env.get(p + "CHUNK_KB", "0") or 0)
        if chunk_kb > 0:
            s.chunk_bytes = chunk_kb * 1024
        s.threads = int(env.get(p + "THREADS", "0") or 0)
        s.hierarchical = env.get(p + "HIERARCHICAL", "auto") or "auto"
        s.node_size = int(env.get(p + "NODE_SIZE", "0") or 0)
        s.priority = env.get(p + "PRIORITY", "0") in ("1", "true", "True")
        s.cuda_cpu_reduce = env.get(p + "CUDA_CPU_REDUCE", "0") in ("1", "true", "True")
        if s.chunk_bytes < 0 or s.chunk_bytes % 4096 or s.hierarchical not in HIERARCHICAL or s.node_size < 0:
            raise ConfigError(f"bad {p}* environment: chunk {s.chunk_bytes} B (multiple of "
                              f"4096), hierarchical {s.hierarchical!r}, node size "
                              f"{s.node_size}", key="comm")
        return s


def default_chunk_bytes(local_ranks: int, cpus: int) -> int:
    """1 MiB chunks fit in L2 and pipeline well while every rank has a core;
    with more ranks than cores each chunk boundary is a meeting point that
    waits for descheduled ranks, so fewer, larger chunks (4 MiB) win."""
    return (4 << 20) if local_ranks > max(1, cpus) else (1 << 20)
