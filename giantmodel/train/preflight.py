"""The memory preflight of ``giantmodel train``: before the model is built
and before any process group exists, compare the planner's peak per rank
with the memory this rank has, and stop in one line when it cannot fit
(instead of an out-of-memory kill, exit 137 with no message, minutes in).

Available memory: on a GPU what ``torch.cuda.mem_get_info`` reports free on
the rank's device; on a CPU the host's ``MemAvailable`` (/proc/meminfo)
shared by the CPU ranks of this host. No collective: every rank reaches the
same verdict from the same figures (and torchrun stops the others when one
fails).
"""

from __future__ import annotations

import torch

from giantmodel.config import ConfigError, JobConfig
from giantmodel.core.memory_hook import memory_estimator


def host_available_bytes(path: str = "/proc/meminfo") -> float | None:
    """The kernel's estimate of memory available without swapping (bytes)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_per_rank(device: torch.device, local_world_size: int) -> tuple[float | None, str]:
    """(bytes this rank may use, what they are) on ``device``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"free on {device}"
    avail = host_available_bytes()
    if avail is None:
        return None, ""
    n = max(1, local_world_size)
    share = f" shared by {n} local ranks" if n > 1 else ""
    return avail / n, f"MemAvailable {avail / 1e9:.1f} GB of this host{share}"


def check_memory(cfg: JobConfig, device: torch.device, world_size: int,
                 local_world_size: int) -> None:
    """Raise ConfigError (one line: predicted and available memory, the
    cheapest fixes) when the job cannot fit; skipped by
    ``train.memory_check: false``, where no estimator is registered, and
    where the available memory cannot be read."""
    estimate = memory_estimator()
    if not cfg.train.memory_check or estimate is None:
        return
    available, where = available_per_rank(device, local_world_size)
    if available is None:
        return
    problem = estimate(cfg, world_size, device.type, available, where)
    if problem:
        raise ConfigError(problem, "train.memory_check")
