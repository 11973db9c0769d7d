"""Activation offload: saved activations go to host memory after each block's
forward and come back, ``prefetch_layers`` blocks ahead, during backward.

Each transformer block runs under its own ``saved_tensors_hooks``. In forward
every saved activation (parameters excepted) is copied to pinned host memory
on a side stream and the device copy is dropped. Backward visits the blocks
in reverse; the first time it needs a tensor of block ``i`` it starts the
host-to-device copies of blocks ``i .. i-prefetch_layers`` on the side stream,
so the next blocks' activations arrive while block ``i`` computes.

Residency guarantee (what the planner models). In backward, the offloaded
activations on the device are those of the block whose backward is running
plus the ``prefetch_layers`` blocks fetched ahead of it: at most
``prefetch_layers + 1`` blocks' worth at any moment. A device copy is handed
to autograd when its backward node first needs it and is not kept here, so
it is freed as soon as that node has run; nothing offloaded survives the
backward pass on the device. In forward, a block's activations are on the
device only while that block runs (the copy to host holds the device memory
until the side stream has read it). Host copies live until the next forward.
A second backward through the same graph (``retain_graph``) copies a tensor
again from its host copy.

What stays on the device: weights. A tensor autograd saves is kept as it
is when it is one of the block's parameters or a view of one (same storage;
the block's parameters as they are during its forward, so FSDP2's unsharded
weights count), or a chain of casts and views of a parameter that requires
grad (autograd's graph says so: ``ToCopyBackward0``/``TBackward0``/... down
to the parameter's ``AccumulateGrad``). The last rule covers autocast's bf16
weight copies, which would otherwise go to the host and back every
micro-batch; they are parameter-sized, made once per forward from values
that do not change, and freed after backward anyway. A cast of a frozen
parameter (``requires_grad=False``) has no graph to read and is offloaded
like an activation. DTensors (tensor parallel, FSDP2's sharded parameters)
are judged and copied by their local shard; an offloaded DTensor comes back
as a DTensor with its mesh, placements and global shape.

Tensors already in host memory (a CPU run) are kept as they are: there is
nothing to offload to. ``force`` copies them anyway, which tests use to check
the bookkeeping on a CPU-only machine; there the "device copy" is a fresh
copy of the host buffer, so its lifetime can be observed like a GPU one.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

# Autograd nodes of ops that only re-type or re-view their one input: a chain
# of them from a parameter's AccumulateGrad is that parameter in another form.
_CAST_OR_VIEW = frozenset({
    "ToCopyBackward0", "TBackward0", "ViewBackward0", "UnsafeViewBackward0",
    "TransposeBackward0", "PermuteBackward0", "ExpandBackward0", "AliasBackward0",
    "ReshapeAliasBackward0", "SliceBackward0", "SelectBackward0", "SqueezeBackward0",
    "UnsqueezeBackward0", "CloneBackward0", "DetachBackward0"})
_MAX_CHAIN = 8


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under a DTensor (the shard itself, without the
    autograd op that to_local() records). Tensor parallel's async
    redistribute leaves an AsyncCollectiveTensor there; the op that saved it
    has already waited on it, so waiting again only unwraps it."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if isinstance(t, AsyncCollectiveTensor):
        t = t.wait()
    return t


def _storage_ptr(t: torch.Tensor) -> int | None:
    """None for a wrapper subclass without storage of its own (a quantised
    weight, say): such a tensor is never copied here."""
    try:
        return _local(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def weight_derived(t: torch.Tensor) -> bool:
    """Whether autograd's graph shows ``t`` as casts/views of a parameter."""
    fn = t.grad_fn
    for _ in range(_MAX_CHAIN):
        if fn is None:
            return False
        if hasattr(fn, "variable"):  # AccumulateGrad: a leaf
            return isinstance(fn.variable, nn.Parameter)
        if fn.name() not in _CAST_OR_VIEW:
            return False
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


class _Slot:
    __slots__ = ("device", "device_copy", "dtensor", "host", "ready")

    def __init__(self, host: torch.Tensor, device: torch.device, ready, dtensor=None):
        self.host, self.device, self.ready = host, device, ready
        self.dtensor = dtensor  # (mesh, placements, shape, stride) of a DTensor
        self.device_copy: torch.Tensor | None = None


class _Generation:
    """The offloaded activations of one forward pass."""

    def __init__(self, n_blocks: int):
        self.slots: list[list[_Slot]] = [[] for _ in range(n_blocks)]
        self.fetched: set[int] = set()
        self.fetch_order: list[int] = []  # block indices as their fetches start
        self.in_flight_at_use: dict[int, set[int]] = {}  # block -> blocks fetched when first needed


class ActivationOffload:
    def __init__(self, blocks: list[nn.Module], prefetch_layers: int = 1, force: bool = False):
        self.blocks = blocks
        self.prefetch = max(0, prefetch_layers)
        self.force = force
        # One generation per forward pass, so several micro-batches may be in
        # flight (pipeline schedules); the attributes below show the latest.
        self._gen: _Generation | None = None
        self._params: dict[int, set[int]] = {}  # block -> its weights' storages, this forward
        self._stream = None
        self._contexts: dict[int, object] = {}
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(self._enter(i))
            block.register_forward_hook(self._exit(i))

    # --------------------------------------------------------------- forward
    def _enter(self, i: int):
        def hook(module, args):
            if i == 0:
                self._new_step()
            ctx = torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(i, t), lambda h: self._unpack(i, h))
            ctx.__enter__()
            self._contexts[i] = ctx
        return hook

    def _exit(self, i: int):
        def hook(module, args, output):
            self._contexts.pop(i).__exit__(None, None, None)
        return hook

    def _new_step(self) -> None:
        self._gen = _Generation(len(self.blocks))
        self._params = {}

    def _param_storages(self, i: int) -> set[int]:
        """Read at block ``i``'s first saved tensor, inside its forward: after
        every pre-forward hook, so FSDP2's unsharded weights are the ones
        registered (the sharded DTensors are not what the ops save)."""
        if i not in self._params:
            self._params[i] = {_storage_ptr(p) for p in self.blocks[i].parameters()
                               if p.device.type != "meta"}
        return self._params[i]

    def _keep(self, i: int, t: torch.Tensor) -> bool:
        if t.device.type == "cpu" and not self.force:
            return True
        ptr = _storage_ptr(t)
        return ptr is None or ptr in self._param_storages(i) or weight_derived(t)

    # the latest forward pass's bookkeeping (for tests and debugging)
    slots = property(lambda self: self._gen.slots)
    fetch_order = property(lambda self: self._gen.fetch_order)
    in_flight_at_use = property(lambda self: self._gen.in_flight_at_use)

    def _pack(self, i: int, saved: torch.Tensor):
        if self._keep(i, saved):
            return saved
        layout = None
        if isinstance(saved, DTensor):
            layout = (saved.device_mesh, saved.placements, saved.shape, saved.stride())
        t = _local(saved)
        ready = None
        if t.device.type == "cuda":
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)
                ready = torch.cuda.Event()
                ready.record(stream)
        else:
            host = t.detach().clone()
        gen = self._gen
        gen.slots[i].append(_Slot(host, t.device, ready, layout))
        return (gen, i, len(gen.slots[i]) - 1)

    # -------------------------------------------------------------- backward
    def _unpack(self, i: int, handle):
        if isinstance(handle, torch.Tensor):
            return handle
        gen, block, index = handle
        for j in range(block, max(-1, block - self.prefetch - 1), -1):
            self._fetch(gen, j)
        gen.in_flight_at_use.setdefault(block, set(gen.fetched))
        slot = gen.slots[block][index]
        if slot.device_copy is None:  # handed out already: a retain_graph re-run
            self._copy_in(slot)
        out, slot.device_copy = slot.device_copy, None
        if slot.ready is not None:
            torch.cuda.current_stream().wait_event(slot.ready)
            # allocated on the side stream, used and freed on this one: keep
            # the allocator from reusing it before this stream is done with it
            out.record_stream(torch.cuda.current_stream())
        if slot.dtensor is not None:
            mesh, placements, shape, stride = slot.dtensor
            with torch.no_grad():  # a wrapper only: no graph, no collective
                out = DTensor.from_local(out, mesh, placements, run_check=False,
                                         shape=shape, stride=stride)
        # Autograd holds the only reference from here, so the device copy is
        # freed once this node's backward has run (the residency guarantee).
        return out

    def _fetch(self, gen: _Generation, block: int) -> None:
        if block in gen.fetched:
            return
        gen.fetched.add(block)
        gen.fetch_order.append(block)
        for slot in gen.slots[block]:
            self._copy_in(slot)

    def _copy_in(self, slot: _Slot) -> None:
        if slot.device.type == "cuda":
            stream = self._side_stream()
            with torch.cuda.stream(stream):
                if slot.ready is not None:
                    stream.wait_event(slot.ready)
                slot.device_copy = slot.host.to(slot.device, non_blocking=True)
                slot.ready = torch.cuda.Event()
                slot.ready.record(stream)
        else:
            slot.device_copy = slot.host.clone()  # forced on the CPU: stands in for a transfer

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream


def apply_offload(model: nn.Module, blocks: list[nn.Module], prefetch_layers: int
                  ) -> ActivationOffload:
    """Offload each of ``blocks`` of ``model`` (a whole model or a stage)."""
    offload = ActivationOffload(blocks, prefetch_layers)
    model._activation_offload = offload  # kept alive with the model
    return offload
