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

Tensors already in host memory (a CPU run) are kept as they are: there is
nothing to offload to. ``force`` copies them anyway, which tests use to check
the bookkeeping on a CPU-only machine; there the "device copy" is a fresh
copy of the host buffer, so its lifetime can be observed like a GPU one.
"""

from __future__ import annotations

import torch
from torch import nn


class _Slot:
    __slots__ = ("device", "device_copy", "host", "ready")

    def __init__(self, host: torch.Tensor, device: torch.device, ready):
        self.host, self.device, self.ready = host, device, ready
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
        self._params: set[int] = set()
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
        self._params = {p.untyped_storage().data_ptr() for b in self.blocks
                        for p in b.parameters() if p.device.type != "meta"}

    # the latest forward pass's bookkeeping (for tests and debugging)
    slots = property(lambda self: self._gen.slots)
    fetch_order = property(lambda self: self._gen.fetch_order)
    in_flight_at_use = property(lambda self: self._gen.in_flight_at_use)

    def _pack(self, i: int, t: torch.Tensor):
        offload = (t.device.type != "cpu" or self.force) and (
            t.untyped_storage().data_ptr() not in self._params)
        if not offload:
            return t
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
        gen.slots[i].append(_Slot(host, t.device, ready))
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
