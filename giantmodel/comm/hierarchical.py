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

All-to-all, with even or uneven splits (an MoE dispatch), goes the other way
round: a shared-memory all-to-all inside the node first hands local rank j
every block its node holds for the ranks of local index j on any node, then
local rank j exchanges with local rank j of every other node, one message per
node pair and L such exchanges at once. Every block crosses the network at
most once, as in a flat all-to-all, but each rank talks to N-1 peers over TCP
instead of NL-1, and blocks between ranks of one node never touch a socket.
Before any block crosses the network every rank learns every rank's split
sizes (a gloo all-gather of 2NL int64 per rank, overlapped with the
shared-memory leg, then a shared-memory all-gather), so split sizes that
disagree between two ranks fail on every rank alike, not inside gloo.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from giantmodel.comm.shm import OP_AVG, OP_MAX, OP_MIN, OP_SUM, ShmGroup, SplitMismatch, offsets
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

    def all_to_all(self, inp: torch.Tensor, out: torch.Tensor, send: list[int],
                   recv: list[int]) -> None:
        """Uneven all-to-all of bytes: ``inp`` (uint8, contiguous) holds
        ``send[r]`` bytes for each group rank r back to back, ``out`` gets
        ``recv[r]`` bytes from each. See :func:`plan_all_to_all`."""
        # The sizes cross the network first (see _check_splits), on gloo's
        # threads while the shared-memory leg runs: its latency, a thread
        # hand-off or two more than the exchange below, mostly hides there.
        w = len(send)
        mine = torch.tensor([*send, *recv], dtype=torch.int64)
        across = torch.empty(self.num_nodes * 2 * w, dtype=torch.int64)
        sizes_sent = self.cross._allgather_base(across, mine)
        # Local rank j forwards what its node peers send to local index j on
        # every node; those sizes are theirs, so the node learns them first.
        table = torch.empty(self.local_size * w, dtype=torch.int64)
        self.shm.all_gather(mine[:w], table)
        plan = plan_all_to_all(self.nodes, self.rank, table.view(self.local_size, w).tolist(),
                               recv)
        # Every full pass over the bytes costs as much as the network leg on
        # a host's memory bus (about 4 GB/s from a core here): blocks already
        # in order are not copied, and one rank per node skips the
        # shared-memory leg, which would only copy its input to itself.
        stage = _gather(inp, plan.local_blocks, self._buffer(torch.uint8, sum(plan.send_local), 0))
        if self.local_size > 1:
            mid, slot = self._buffer(torch.uint8, sum(plan.recv_local), 1), 0
            self.shm.all_to_all_v(stage, mid, plan.send_local, plan.recv_local)
        else:
            mid, slot = stage, 1  # mid may be buffer 0: gather the next stage elsewhere
        stage = _gather(mid, plan.cross_blocks, self._buffer(torch.uint8, sum(plan.send_cross),
                                                             slot))
        sizes_sent.wait()
        self._check_splits(across, w)
        # With each node holding consecutive ranks the network leg brings the
        # blocks in rank order, straight into ``out``.
        direct = [b for b in plan.placed if b[1]] == [b for b in zip(offsets(recv), recv) if b[1]]
        land = out if direct else self._buffer(torch.uint8, sum(plan.recv_cross), 2)
        self.cross.alltoall_base(land, stage, plan.recv_cross, plan.send_cross,
                                 dist.AllToAllOptions()).wait()
        if not direct:
            at = 0
            for start, n in plan.placed:
                out[start:start + n].copy_(land[at:at + n])
                at += n

    def _check_splits(self, across: torch.Tensor, w: int) -> None:
        """Raise :class:`SplitMismatch` on every rank alike when some rank a
        sends rank b other than b expects from a. ``across`` holds, node by
        node, the sizes (sent to each rank, then expected from each) of this
        local index's rank there.

        Before the network leg: there a mismatch hung gloo's exchange or
        failed inside it, on some ranks only. The leg before it is safe: it
        follows the senders' sizes alone. The shared-memory all-gather gives
        every rank every rank's sizes, so all reach the same verdict."""
        table = torch.empty(self.local_size * self.num_nodes * 2 * w, dtype=torch.int64)
        self.shm.all_gather(across, table)
        # entry l * N + n is local rank l of node n: group rank _order[l * N + n]
        sizes = torch.empty(w, 2, w, dtype=torch.int64)
        sizes.index_copy_(0, self._order, table.view(-1, 2, w))
        sent, expected = sizes[:, 0], sizes[:, 1]
        bad = sent != expected.t()
        if bool(bad.any()):
            a, b = bad.nonzero()[0].tolist()  # the first pair in rank order, on every rank
            raise SplitMismatch(a, b, int(sent[a, b]), int(expected[b, a]))


@dataclass(frozen=True)
class AllToAllPlan:
    """One rank's two legs of a hierarchical all-to-all. Blocks are
    ``(offset, bytes)``; a leg sends its blocks concatenated in list order."""

    local_blocks: list[tuple[int, int]]
    """Blocks of the input for the shared-memory leg: local rank 0's first."""
    send_local: list[int]
    """Bytes to each local rank in the shared-memory leg."""
    recv_local: list[int]
    """Bytes from each local rank in the shared-memory leg."""
    cross_blocks: list[tuple[int, int]]
    """Blocks of the shared-memory leg's result for the network leg: node 0's first."""
    send_cross: list[int]
    """Bytes to each node in the network leg."""
    recv_cross: list[int]
    """Bytes from each node in the network leg."""
    placed: list[tuple[int, int]]
    """Where each block the network leg brings goes in the output, in arrival order."""


def plan_all_to_all(nodes: tuple[tuple[int, ...], ...], rank: int, sent: list[list[int]],
                    recv: list[int]) -> AllToAllPlan:
    """The legs for group rank ``rank`` (local index j on node m).

    ``sent[i][d]`` is what local rank i of node m sends to group rank d;
    ``recv[s]`` what ``rank`` receives from group rank s. Leg 1 (shared
    memory): local rank i sends local rank j, for each node n in order, its
    block for (n, j). Leg 2 (network, among the local ranks j of all nodes):
    to node n go the blocks for (n, j) that every local rank i handed over, i
    in order; so from node n come the blocks of (n, 0), (n, 1), ... for here.
    """
    num = len(nodes)
    node = next(n for n, members in enumerate(nodes) if rank in members)
    j, size = nodes[node].index(rank), len(nodes[node])
    mine = sent[j]
    start = offsets(mine)
    local_blocks = [(start[nodes[n][p]], mine[nodes[n][p]]) for p in range(size)
                    for n in range(num)]
    send_local = [sum(mine[nodes[n][p]] for n in range(num)) for p in range(size)]
    recv_local = [sum(sent[i][nodes[n][j]] for n in range(num)) for i in range(size)]
    held: dict[tuple[int, int], tuple[int, int]] = {}  # (local i, node n) -> block
    at = 0
    for i in range(size):
        for n in range(num):
            held[i, n] = (at, sent[i][nodes[n][j]])
            at += held[i, n][1]
    cross_blocks = [held[i, n] for n in range(num) for i in range(size)]
    send_cross = [sum(held[i, n][1] for i in range(size)) for n in range(num)]
    recv_cross = [sum(recv[nodes[n][i]] for i in range(size)) for n in range(num)]
    where = offsets(recv)
    placed = [(where[nodes[n][i]], recv[nodes[n][i]]) for n in range(num) for i in range(size)]
    return AllToAllPlan(local_blocks, send_local, recv_local, cross_blocks, send_cross,
                        recv_cross, placed)


def _gather(src: torch.Tensor, blocks: list[tuple[int, int]], dst: torch.Tensor) -> torch.Tensor:
    """The blocks of ``src`` back to back: a view of ``src`` where they
    already lie so, else copied into ``dst`` (one copy)."""
    parts = [(o, n) for o, n in blocks if n]
    if not parts:
        return dst
    end = parts[0][0]
    for o, n in parts:
        if o != end:
            torch.cat([src[o:o + n] for o, n in parts], out=dst)
            return dst
        end += n
    return src[parts[0][0]:end]
