"""Measure what a forward pass keeps alive for backward, on any device.

Two counters, both deduplicating by storage:

* :class:`SavedTensorCounter` - the tensors autograd packs for backward
  (``torch.autograd.graph.saved_tensors_hooks``). Checkpointed regions pack
  through their own hooks, so under recompute it misses their held inputs.
* :class:`LiveStorageCounter` - every storage an op creates during forward
  that is still alive afterwards (a dispatch mode with weak storage
  references). This is what the allocator would still hold, recompute or not.

The planner's activation model is checked against both; its DTensor
dispatch time counts the ops :class:`DTensorOpCounter` sees.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorageCounter(TorchDispatchMode):
    """Records storages created by ops run under it; ``live_bytes()`` sums
    those still alive, excluding the ones in ``exclude``."""

    def __init__(self):
        super().__init__()
        self._refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Storages an op reads but did not create here (parameters, inputs)
        # are remembered with size 0, so views of them are not counted.
        for t in tree_flatten((args, kwargs))[0]:
            self._note(t, created=False)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._note(t, created=True)
        return out

    def _note(self, t, created: bool) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        # Tensor subclasses (DTensor, functional-collective results) wrap a
        # plain local tensor that owns the storage.
        for attr in ("_local_tensor", "elem"):
            inner = getattr(t, attr, None)
            if isinstance(inner, torch.Tensor):
                self._note(inner, created)
                return
        st = t.untyped_storage()
        key = st.data_ptr()
        if not key:
            return
        old = self._refs.get(key)
        # The allocator reuses addresses: an expired entry is a different storage.
        if old is None or old[0].expired():
            self._refs[key] = (StorageWeakRef(st), st.nbytes() if created else 0)

    def live_bytes(self, exclude: tuple[torch.Tensor, ...] = ()) -> int:
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        return sum(n for k, (ref, n) in self._refs.items() if not ref.expired() and k not in skip)


class SavedTensorCounter:
    """Context manager counting the bytes of distinct storages saved for
    backward, skipping parameters (and anything else in ``exclude``)."""

    def __init__(self, exclude: tuple[torch.Tensor, ...] = ()):
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # a DTensor (sequence-parallel norms save them) owns no storage: its
        # local tensor does
        st = getattr(t, "_local_tensor", t).untyped_storage()
        if st.data_ptr() not in self._skip:
            self._seen[st.data_ptr()] = st.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())


class DTensorOpCounter(TorchDispatchMode):
    """Counts the aten ops run under it with a DTensor among their
    arguments (``n``): what tensor and sequence parallelism dispatch."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(t, DTensor) for t in tree_flatten((args, kwargs))[0]):
            self.n += 1
        return func(*args, **(kwargs or {}))
