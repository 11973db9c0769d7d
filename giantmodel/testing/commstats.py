"""Count bytes moved by collectives, per collective type, for volume checks.

A ``TorchDispatchMode`` sees every collective issued from Python: the c10d
ops behind ``torch.distributed.*`` (used by data parallelism and FSDP2) and
the functional collectives behind DTensor. For each call it records the
size of the *full* logical buffer: the all-reduced tensor, the gathered
output of an all-gather, the input of a reduce-scatter, the broadcast tensor.
Those are the quantities the textbook volume formulas are written in.
"""

from __future__ import annotations

from collections import defaultdict
from typing import ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name (without overload) -> (kind, which argument holds the full buffer)
_OPS = {
    "allreduce_": ("all_reduce", "arg0"),
    "all_reduce": ("all_reduce", "arg0"),
    "all_reduce_": ("all_reduce", "arg0"),
    "allreduce_coalesced_": ("all_reduce", "arg0"),
    "all_reduce_coalesced": ("all_reduce", "arg0"),
    "_allgather_base_": ("all_gather", "arg0"),
    "allgather_into_tensor_coalesced_": ("all_gather", "arg0"),
    "allgather_": ("all_gather", "arg0"),
    "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "_reduce_scatter_base_": ("reduce_scatter", "arg1"),
    "reduce_scatter_tensor": ("reduce_scatter", "arg0"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "arg0"),
    "reduce_scatter_": ("reduce_scatter", "arg1"),
    "broadcast_": ("broadcast", "arg0"),
    "broadcast": ("broadcast", "arg0"),
    "alltoall_base_": ("all_to_all", "arg1"),
    "all_to_all_single": ("all_to_all", "arg0"),
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _group_size(group) -> int:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(funcol._resolve_group_name(group)).size()


class CommCounter(TorchDispatchMode):
    """``with CommCounter() as c: ...`` then ``c.bytes`` / ``c.calls`` by kind."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.unknown: dict[str, int] = defaultdict(int)
        self.log: list[tuple[str, str, int]] = []
        self._inside_funcol = 0
        self._saved: dict = {}

    # DTensor issues some collectives from inside its op handlers (e.g.
    # loss_parallel's all-reduces), where a dispatch mode does not see them;
    # the functional-collective entry points are wrapped to catch those.
    _FUNCOL: ClassVar[dict[str, tuple[str, int | None]]] = {
        "all_reduce": ("all_reduce", 1),
        "all_gather_tensor": ("all_gather", None),
        "all_gather_single": ("all_gather", None),
        "all_gather_tensor_autograd": ("all_gather", None),
        "all_gather_single_autograd": ("all_gather", None),
        "reduce_scatter_tensor": ("reduce_scatter", 1),
        "reduce_scatter_single": ("reduce_scatter", 1),
        "reduce_scatter_tensor_autograd": ("reduce_scatter", 1),
        "reduce_scatter_single_autograd": ("reduce_scatter", 1),
    }

    def _wrap(self, name: str, fn):
        kind, fixed = self._FUNCOL[name]

        def counted(tensor, *args, **kwargs):
            group = kwargs.get("group", args[-1] if args else None)
            n = _nbytes(tensor) * (fixed or _group_size(group))
            self.bytes[kind] += n
            self.calls[kind] += 1
            self.log.append((kind, name, n))
            self._inside_funcol += 1
            try:
                return fn(tensor, *args, **kwargs)
            finally:
                self._inside_funcol -= 1
        return counted

    def __enter__(self):
        import torch.distributed._functional_collectives as funcol

        for name in self._FUNCOL:
            if hasattr(funcol, name):
                self._saved[name] = getattr(funcol, name)
                setattr(funcol, name, self._wrap(name, self._saved[name]))
        return super().__enter__()

    def __exit__(self, *exc):
        import torch.distributed._functional_collectives as funcol

        for name, fn in self._saved.items():
            setattr(funcol, name, fn)
        self._saved = {}
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns = getattr(func, "namespace", "")
        if self._inside_funcol == 0 and ns in ("c10d", "_c10d_functional", "c10d_functional"):
            name = func._schema.name.split("::")[-1]
            entry = _OPS.get(name)
            if entry is None:
                if name not in ("wait_tensor", "barrier", "monitored_barrier"):
                    self.unknown[name] += 1
                return out
            kind, where = entry
            if where == "out":
                n = _nbytes(out)
            else:
                n = _nbytes(args[int(where[3:])])
            self.bytes[kind] += n
            self.calls[kind] += 1
            self.log.append((kind, name, n))
        return out


# Per-rank bytes sent by a bandwidth-optimal (ring) implementation, as a
# multiple of the logical buffer size above, for a group of n ranks.
_RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
         "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n,
         "all_to_all": lambda n: (n - 1) / n}


def ring_bytes(log: list[tuple[str, str, int]], group_size: int) -> float:
    """Bytes each rank puts on the wire for the collectives in ``log`` (a
    :class:`CommCounter` log), all issued on groups of ``group_size`` ranks."""
    return sum(_RING[kind](group_size) * n for kind, _, n in log)
