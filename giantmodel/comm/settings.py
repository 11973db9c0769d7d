"""What a giant process group is told at creation.

torch creates a backend inside ``init_process_group`` / ``new_group`` and
hands the creator only the store, ranks, timeout and the ``pg_options``
object the caller passed. :class:`GiantOptions` is that object: build it from
the job's ``comm:`` section with :meth:`GiantOptions.from_config` and pass it
as ``pg_options``. A sub-group created without options (DeviceMesh creates
its groups that way) inherits the options of the default group, as torch's
own backends inherit theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

from giantmodel.config.comm import HIERARCHICAL, CommConfig
from giantmodel.config.errors import ConfigError


@dataclass(frozen=True)
class GiantOptions:
    """Creation-time settings of a giant process group."""

    chunk_bytes: int = 0
    """Shared-memory chunk in bytes; 0 picks :func:`default_chunk_bytes`."""
    threads: int = 0
    """Copy/reduce threads per rank; 0 = the host's cores over its ranks."""
    hierarchical: str = "auto"
    """Cross-node collectives: "on", "off" or "auto" (the reductions and
    gathers hierarchical for even nodes; all-to-all flat unless "on")."""
    node_size: int = 0
    """Ranks per emulated node; 0 learns nodes from host names."""
    priority: bool = False
    """Run queued collectives by priority instead of in issue order."""
    cuda_cpu_reduce: bool = False
    """Reduce CUDA tensors on the host (CPU-Reduce) instead of NCCL."""
    accelerate: bool = True
    """Use the shared-memory core; False delegates every collective (for comparisons)."""

    def __post_init__(self) -> None:
        if self.chunk_bytes < 0 or self.chunk_bytes % 4096:
            raise ConfigError(f"chunk of {self.chunk_bytes} bytes must be 0 or a positive "
                              "multiple of 4096", key="comm.chunk_kb")
        if self.hierarchical not in HIERARCHICAL:
            raise ConfigError(f"must be one of {HIERARCHICAL}, got {self.hierarchical!r}",
                              key="comm.hierarchical")
        if self.node_size < 0:
            raise ConfigError(f"must be >= 0, got {self.node_size}", key="comm.node_size")

    @classmethod
    def from_config(cls, cfg: CommConfig) -> GiantOptions:
        return cls(chunk_bytes=cfg.chunk_kb * 1024, threads=cfg.threads,
                   hierarchical=cfg.hierarchical, node_size=cfg.node_size,
                   priority=cfg.priority, cuda_cpu_reduce=cfg.cuda_cpu_reduce)


def default_chunk_bytes(local_ranks: int, cpus: int) -> int:
    """1 MiB chunks fit in L2 and pipeline well while every rank has a core;
    with more ranks than cores each chunk boundary is a meeting point that
    waits for descheduled ranks, so fewer, larger chunks (4 MiB) win."""
    return (4 << 20) if local_ranks > max(1, cpus) else (1 << 20)
