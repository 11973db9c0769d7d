"""One contiguous buffer per dtype, and the buckets that are slices of it.

The layout serves own data parallelism (zero 0, 1 and 2). Parameters are
taken in reverse registration order -- roughly the order in which backward
finishes their gradients -- and grouped into buckets of about
``parallel.bucket_mb``. A bucket is one slice of the buffer; a collective
runs on that slice in place, so nothing is concatenated or copied back.

With ZeRO (``owners > 1``) every parameter belongs to one data-parallel rank,
whole, so optimizer state stays one tensor per parameter under its canonical
name (checkpoints reshard through DCP as for any other layout). Inside a
bucket the parameters are ordered by owner: rank r's parameters fill the
r-th of ``owners`` equal chunks, padded to the largest. A reduce-scatter of
the bucket then leaves each rank the summed gradients of exactly the
parameters it owns, in place, and an all-gather of the bucket after the
optimizer step gives every rank every updated parameter.

Whole parameters cannot always split evenly: a bucket grows past the target
size until its owners' loads are within ``balance`` of each other, and an
unbalanced tail is merged into the bucket before it. Padding is therefore
at most ``balance`` of each bucket (about 2% by default) -- while there are
enough parameters to share out. With many owners and few, large parameters
(a 128k-token embedding on 32 ranks, one pipeline stage's eight layers on
64) no split balances, everything merges into one bucket, and the largest
parameter sets every owner's chunk: the buffers grow to several times the
model. :func:`padding` measures that, and past :data:`MAX_PADDING` the
engine shards through FSDP2 instead (``parallel.strategy.strategy_name``).

Short of that, the same merging can leave the first bucket -- the one that
backward fills first and whose reduction can start earliest -- holding most
of the gradients: with one large parameter (a 128k-token embedding) per
several owners, whole parameters balance only over most of the model. Llama
3 8B at dp 8 is one bucket, with 0.3% padding: no reduction can start
before backward ends, nor can the parameters' all-gather overlap anything.
:func:`padding_and_first_bucket` measures both; where the collectives could
run beside compute (on GPUs) and the first bucket holds more than
:data:`MAX_FIRST_BUCKET` of the gradients, the engine shards through FSDP2,
whose per-block units overlap both ways.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from giantmodel.core.tensors import local_tensor

BALANCE = 0.02
MAX_PADDING = 0.10
"""Padding (a fraction of the parameters) above which zero 1 and 2 leave the
flat buffers for FSDP2's even dim-0 shards."""
MAX_FIRST_BUCKET = 0.5
"""Share of the gradients in the first bucket above which zero 1 and 2 leave
the flat buffers for FSDP2 where collectives overlap compute: its reduction
could hide behind less than half of backward."""


@dataclass
class Slot:
    """Where one parameter lives in the buffer."""

    param: torch.Tensor
    bucket: int
    offset: int
    """Element offset in the whole buffer."""
    numel: int
    owner: int
    """Data-parallel rank that owns it (0 when nothing is sharded)."""


@dataclass
class Bucket:
    """A slice ``[start, start + size)`` of the buffer, ``owners`` equal chunks."""

    index: int
    start: int
    size: int
    owners: int
    slots: list[Slot] = field(default_factory=list)

    @property
    def chunk(self) -> int:
        return self.size // self.owners

    def chunk_start(self, owner: int) -> int:
        return self.start + owner * self.chunk


def _owner_loads(sizes: list[int], owners: int) -> tuple[list[int], list[int]]:
    """Largest first, each to the least-loaded owner (lowest rank on ties):
    (owner per size, loads). A heap of (load, rank) keeps this O(n log owners):
    the planner sizes layouts with thousands of data-parallel ranks."""
    loads = [0] * owners
    owner_of = [0] * len(sizes)
    heap = [(0, r) for r in range(owners)]   # already a heap: sorted
    for i in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        load, r = heapq.heappop(heap)
        owner_of[i] = r
        loads[r] = load + sizes[i]
        heapq.heappush(heap, (loads[r], r))
    return owner_of, loads


def _padding(sizes: list[int], owners: int) -> int:
    _, loads = _owner_loads(sizes, owners)
    return max(loads) * owners - sum(sizes)


def plan_buckets(sizes: list[int], owners: int, bucket_numel: int,
                 balance: float = BALANCE) -> list[list[int]]:
    """Indices of ``sizes`` per bucket, in order (see the module docstring)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        current.append(i)
        total += n
        if total >= bucket_numel and (
                owners == 1 or _padding([sizes[k] for k in current], owners) <= balance * total):
            buckets.append(current)
            current, total = [], 0
    if current:
        buckets.append(current)
    while owners > 1 and len(buckets) > 1:
        tail = [sizes[k] for k in buckets[-1]]
        if _padding(tail, owners) <= balance * sum(tail):
            break
        last = buckets.pop()
        buckets[-1] += last
    return buckets


@dataclass(frozen=True)
class LayoutSizes:
    """Element counts of one rank's flat buffers (for memory accounting)."""

    total: int
    """The whole buffer, padding included (gradients for zero 0/1, parameters for 1/2)."""
    owned: int
    """Elements of the parameters this rank owns (its optimizer state)."""
    shard: int
    """This rank's chunks of every bucket (zero 2's persistent gradients)."""
    largest: int = 0
    """The largest bucket, padding included: the size of zero 2's scratch buffers."""
    buckets: int = 0
    """How many buckets there are."""
    first: int = 0
    """Elements of the parameters in the first bucket (the first backward fills)."""


def layout_sizes(sizes: list[int], *, owners: int, bucket_numel: int, rank: int = 0,
                 balance: float = BALANCE) -> LayoutSizes:
    """What :class:`FlatLayout` allocates for parameters of ``sizes`` elements
    (registration order), without building any tensor: the planner's view."""
    ordered = list(reversed(sizes))
    total = owned = shard = largest = 0
    plan = plan_buckets(ordered, owners, bucket_numel, balance)
    first = sum(ordered[i] for i in plan[0]) if plan else 0
    for members in plan:
        msizes = [ordered[i] for i in members]
        if owners == 1:
            total += sum(msizes)
            owned += sum(msizes)
            shard += sum(msizes)
            largest = max(largest, sum(msizes))
            continue
        _, loads = _owner_loads(msizes, owners)
        total += max(loads) * owners
        owned += loads[rank]
        shard += max(loads)
        largest = max(largest, max(loads) * owners)
    return LayoutSizes(total, owned, shard, largest, len(plan), first)


def padding(sizes: list[int], *, owners: int, bucket_numel: int) -> float:
    """What whole-parameter ownership adds to the buffers of parameters of
    ``sizes`` elements, as a fraction of their total (0 for one owner)."""
    return padding_and_first_bucket(sizes, owners=owners, bucket_numel=bucket_numel)[0]


def padding_and_first_bucket(sizes: list[int], *, owners: int,
                             bucket_numel: int) -> tuple[float, float]:
    """(:func:`padding`, the share of the elements in the first bucket) of
    parameters of ``sizes`` elements in registration order; (0, 0) for one
    owner, whose buckets need no balance."""
    total = sum(sizes)
    if owners <= 1 or total == 0:
        return 0.0, 0.0
    flat = layout_sizes(sizes, owners=owners, bucket_numel=bucket_numel)
    return flat.total / total - 1.0, flat.first / total


class FlatLayout:
    """Slots and buckets of one dtype's parameters (see the module docstring).

    ``params`` are this rank's trainable parameters of one dtype in
    registration order; sizes are those of their local (tensor-parallel)
    storage.
    """

    def __init__(self, params: list[torch.Tensor], *, owners: int, bucket_numel: int,
                 balance: float = BALANCE):
        ordered = list(reversed(params))
        sizes = [local_tensor(p).numel() for p in ordered]
        self.owners = owners
        self.buckets: list[Bucket] = []
        self.slots: list[Slot] = []
        start = 0
        for b, members in enumerate(plan_buckets(sizes, owners, bucket_numel, balance)):
            msizes = [sizes[i] for i in members]
            owner_of, loads = _owner_loads(msizes, owners) if owners > 1 else (
                [0] * len(members), [sum(msizes)])
            bucket = Bucket(b, start, max(loads) * owners, owners)
            cursor = [bucket.chunk_start(r) for r in range(owners)]
            for i, r in zip(members, owner_of):
                slot = Slot(ordered[i], b, cursor[r], sizes[i], r)
                cursor[r] += sizes[i]
                bucket.slots.append(slot)
                self.slots.append(slot)
            self.buckets.append(bucket)
            start += bucket.size
        self.numel = start
        self.bucket_of = {id(s.param): s.bucket for s in self.slots}

    def view(self, buffer: torch.Tensor, slot: Slot, base: int = 0) -> torch.Tensor:
        """The slot's element range of ``buffer``, shaped like its parameter's
        local storage; ``base`` is the buffer offset ``buffer`` starts at (a
        bucket's start, for a buffer that holds one bucket)."""
        start = slot.offset - base
        return buffer[start:start + slot.numel].view(local_tensor(slot.param).shape)

    def bucket_view(self, buffer: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return buffer[bucket.start:bucket.start + bucket.size]

    def chunk_view(self, buffer: torch.Tensor, bucket: Bucket, owner: int,
                   base: int = 0) -> torch.Tensor:
        start = bucket.chunk_start(owner) - base
        return buffer[start:start + bucket.chunk]

    def owned_numel(self, owner: int) -> int:
        return sum(b.chunk for b in self.buckets) if self.owners > 1 else self.numel

    @property
    def padding(self) -> int:
        return self.numel - sum(s.numel for s in self.slots)
