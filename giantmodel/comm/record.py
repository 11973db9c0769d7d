"""The giant backend's flight record: the newest collectives it ran itself.

torch's flight recorder lives inside its C++ gloo and NCCL process groups, so
it never sees a collective that the giant backend runs on its shared-memory
core. The hang report needs both: a rank stuck in a collective is found by
comparing each rank's newest entry per group. This ring holds the giant
backend's entries in the recorder's shape, and costs one append per call.
"""

from __future__ import annotations

import time
from collections import deque

_SIZE = 64
_ENTRIES: deque = deque(maxlen=_SIZE)


def note(group: str, seq: int, op: str, tensors) -> None:
    """Record that this process entered collective ``op`` (its ``seq``-th on
    ``group``, the name torch's c10d gives the group) on ``tensors``."""
    # t.shape is kept as is: formatting waits until a report asks for it
    _ENTRIES.append((time.time_ns(), group, seq, op,
                     [t.shape for t in tensors], [t.dtype for t in tensors]))


def entries() -> list[dict]:
    """The recorded collectives, oldest first, as flight-recorder entries
    (the keys the hang report reads)."""
    out = []
    for t_ns, group, seq, op, shapes, dtypes in list(_ENTRIES):
        out.append({"time_created_ns": t_ns, "process_group": [group, "giant"],
                    "collective_seq_id": seq, "profiling_name": f"giant:{op}",
                    "input_sizes": [list(s) for s in shapes],
                    "input_dtypes": [str(d).removeprefix("torch.") for d in dtypes]})
    return out


def clear() -> None:
    _ENTRIES.clear()
