"""Hierarchical collectives across nodes: all-reduce, reduce-scatter, all-gather.

With L ranks per node and N nodes, an all-reduce of S bytes runs as
  1. intra-node reduce-scatter in shared memory: local rank i holds the
     node's partial sum of slice i (S/L bytes);
  2. N-way all-reduce of slice i among the local ranks i of every node, over
     gloo (TCP) -- L of these run at once, one per local rank, so the network
     carries L flows and each moves only S/L bytes;
  3. intra-node all-gather in shared memory of the finished slices.
A flat ring over all N*L ranks sends 2(NL-1)/(NL) * S per rank over TCP; this
sends 2(N-1)/N * S/L, and the shared-memory legs run near memory speed.

Reduce to one root and broadcast from it (what ZeRO's owner ranges use) take
the tensor through shared memory inside every node and once over the
network, among the ranks that share the root's local index.

Reduce-scatter and all-gather (what ZeRO's gradient and parameter shards and
FSDP2 use) take the same two levels: a shared-memory reduce-scatter inside
the node, then an all-to-all among the local ranks i of every node, each node
summing what it receives; all-gather is the mirror image. Per rank the
network carries (N-1)/N * S/L, where a flat ring over all ranks carries
(NL-1)/(NL) * S: with 2 ranks per node, half as much or less.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from giantmodel.comm.shm import OP_AVG, OP_MAX, OP_MIN, OP_SUM, ShmGroup
from giantmodel.comm.topology import Topology

_GLOO_OPS = {OP_SUM: dist.ReduceOp.SUM, OP_MAX: dist.ReduceOp.MAX, OP_MIN: dist.ReduceOp.MIN}


class HierarchicalAllReduce:
    """Runs all-reduce, reduce-scatter and all-gather over (shared memory
    within nodes) x (gloo across nodes).

    The tensor is cut into pieces so the legs overlap: while gloo carries
    piece k between nodes (on its own threads), this rank already
    reduce-scatters piece k+1 in shared memory.
    """

    PIECE_BYTES = 8 << 20
    SHARD_PIECE_BYTES = 2 << 20
    """Reduce-scatter and all-gather pieces: smaller, so the shared-memory
    leg before the network's first piece and the sum after its last are
    short. On 2 emulated hosts x 2 ranks at 1 Gbit/s, 2 MB pieces beat 8 MB
    ones from 4 MB up (16 MB: reduce-scatter 0.15-0.16 against 0.11 GB/s
    bus bandwidth, all-gather 0.16 against 0.11-0.13), and a ZeRO-1 step of
    21 MB of gradients ran at 1,800-1,926 tok/s against 1,528-1,767
    (benchmarks/results/peers-2026-11-27.md). All-reduce keeps PIECE_BYTES: 2 MB
    pieces were slower there at 4 MB."""

    def __init__(self, shm: ShmGroup, store, topo: Topology, timeout: timedelta):
        self.shm = shm
        self.rank = topo.rank
        self.nodes = topo.nodes
        self.local_rank = topo.local_rank
        self.local_size = topo.local_size
        self.num_nodes = topo.num_nodes
        self.node_index = topo.node_index
        # Group rank of (local rank l, node n) at position l * N + n: the
        # order the two-level legs leave the blocks in. Nodes need not hold
        # consecutive ranks (Slurm's cyclic distribution does not).
        self._order = torch.tensor([node[lr] for lr in range(topo.local_size)
                                    for node in topo.nodes], dtype=torch.long)
        # Local rank i of every node forms one cross-node group.
        self.cross = dist.ProcessGroupGloo(
            dist.PrefixStore(f"cross/{topo.local_rank}/", store), topo.node_index,
            topo.num_nodes, timeout)
        self._scratch: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def _buffer(self, dtype: torch.dtype, n: int, slot: int) -> torch.Tensor:
        """Reused scratch: fresh large allocations would page-fault on every call."""
        key = (dtype, slot)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype)
            self._scratch[key] = buf
        return buf[:n]

    def all_reduce(self, flat: torch.Tensor, op: int, scale: float) -> None:
        """In place on a contiguous 1-D tensor; OP_AVG multiplies the sum by scale."""
        L = self.local_size
        n = flat.numel()
        pieces = max(1, min(16, n * flat.element_size() // self.PIECE_BYTES))
        per_piece = -(-n // (L * pieces)) * L  # elements per piece, a multiple of L
        total = per_piece * pieces
        if total == n:
            padded = flat
        else:
            padded = self._buffer(flat.dtype, total, 0)
            padded[:n].copy_(flat)
            padded[n:].zero_()
        parts = self._buffer(flat.dtype, total // L, 1).view(pieces, per_piece // L)
        inner_op = OP_SUM if op == OP_AVG else op
        opts = dist.AllreduceOptions()
        opts.reduceOp = _GLOO_OPS[inner_op]
        chunks = padded.view(pieces, per_piece)
        works = []
        for k in range(pieces):
            self.shm.reduce_scatter_scaled(chunks[k], parts[k], inner_op, 1.0)
            works.append(self.cross.allreduce([parts[k]], opts))
        for k in range(pieces):
            works[k].wait()
            if op == OP_AVG:
                parts[k].mul_(scale)
            self.shm.all_gather(parts[k], chunks[k])
        if padded is not flat:
            flat.copy_(padded[:n])

    def _pieces(self, block: int, itemsize: int) -> list[tuple[int, int]]:
        """Column ranges [c0, c1) of every block: pieces of about
        SHARD_PIECE_BYTES across the whole tensor (at most 16), so the
        network carries piece k while this rank copies and reduces piece
        k+1 in shared memory."""
        total = block * itemsize * self.num_nodes * self.local_size
        n = max(1, min(16, total // self.SHARD_PIECE_BYTES, block))
        edges = [block * k // n for k in range(n + 1)]
        return list(zip(edges[:-1], edges[1:]))

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: int,
                       scale: float) -> None:
        """``out = op(block r of inp over ranks)`` for this rank r; ``inp``
        holds one contiguous block of ``out.numel()`` elements per group rank."""
        N, b = self.num_nodes, out.numel()
        blocks = inp.view(-1, b)
        pieces = self._pieces(b, inp.element_size())
        widest = max(c1 - c0 for c0, c1 in pieces)
        local_major = self._buffer(inp.dtype, blocks.size(0) * widest, 0)
        partial = self._buffer(inp.dtype, N * b, 1)
        received = self._buffer(inp.dtype, N * b, 2)
        inner_op = OP_SUM if op == OP_AVG else op
        works = []
        for c0, c1 in pieces:
            w = c1 - c0
            lm = local_major[:blocks.size(0) * w].view(-1, w)
            torch.index_select(blocks[:, c0:c1], 0, self._order, out=lm)
            # this local rank's piece of every node's block, summed over the node
            mine = partial[N * c0:N * c1]
            self.shm.reduce_scatter_scaled(lm.view(-1), mine, inner_op, 1.0)
            # piece n goes to node n; what comes back is this rank's piece from each node
            works.append(self.cross.alltoall_base(received[N * c0:N * c1], mine, [], [],
                                                  dist.AllToAllOptions()))
        for (c0, c1), work in zip(pieces, works):
            work.wait()
            parts = received[N * c0:N * c1].view(N, c1 - c0)
            dst = out.view(-1)[c0:c1]
            if inner_op == OP_SUM:
                torch.sum(parts, dim=0, out=dst)
            else:
                dst.copy_((torch.amax if inner_op == OP_MAX else torch.amin)(parts, dim=0))
        if op == OP_AVG:
            out.mul_(scale)

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` holds one block per group rank, block r being rank r's ``inp``."""
        N, b = self.num_nodes, inp.numel()
        src, blocks = inp.view(-1), out.view(-1, b)
        pieces = self._pieces(b, inp.element_size())
        widest = max(c1 - c0 for c0, c1 in pieces)
        gathered = self._buffer(inp.dtype, N * b, 1)
        # the network gets every piece at once; the shared-memory legs follow
        works = [self.cross._allgather_base(gathered[N * c0:N * c1], src[c0:c1])
                 for c0, c1 in pieces]
        local_major = self._buffer(inp.dtype, blocks.size(0) * widest, 0)
        for (c0, c1), work in zip(pieces, works):
            work.wait()
            w = c1 - c0
            lm = local_major[:blocks.size(0) * w]
            self.shm.all_gather(gathered[N * c0:N * c1], lm)
            blocks[:, c0:c1].index_copy_(0, self._order, lm.view(-1, w))

    def _place(self, root: int) -> tuple[int, int]:
        """(node index, local rank) of group rank ``root``."""
        node = next(i for i, ranks in enumerate(self.nodes) if root in ranks)
        return node, self.nodes[node].index(root)

    def reduce(self, flat: torch.Tensor, root: int, op: int, scale: float) -> None:
        """Group rank ``root``'s contiguous ``flat`` becomes ``op`` of every
        rank's, in place (the others' are left holding partial sums): a
        shared-memory all-reduce inside each node, then a reduce to
        ``root``'s node among the ranks of ``root``'s local rank."""
        node, local = self._place(root)
        inner_op = OP_SUM if op == OP_AVG else op
        self.shm.all_reduce_scaled(flat, flat, inner_op, 1.0)
        if self.local_rank == local:
            opts = dist.ReduceOptions()
            opts.reduceOp = _GLOO_OPS[inner_op]
            opts.rootRank = node
            self.cross.reduce([flat], opts).wait()
        if op == OP_AVG and self.rank == root:
            flat.mul_(scale)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        """Every rank's contiguous ``flat`` becomes group rank ``root``'s: over
        the network among the ranks of ``root``'s local rank, then from them
        through shared memory inside each node."""
        node, local = self._place(root)
        if self.local_rank == local:
            opts = dist.BroadcastOptions()
            opts.rootRank = node
            opts.rootTensor = 0
            self.cross.broadcast([flat], opts).wait()
        self.shm.broadcast(flat, local)
