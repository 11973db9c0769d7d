"""Hierarchical all-reduce across nodes.

With L ranks per node and N nodes, an all-reduce of S bytes runs as
  1. intra-node reduce-scatter in shared memory: local rank i holds the
     node's partial sum of slice i (S/L bytes);
  2. N-way all-reduce of slice i among the local ranks i of every node, over
     gloo (TCP) -- L of these run at once, one per local rank, so the network
     carries L flows and each moves only S/L bytes;
  3. intra-node all-gather in shared memory of the finished slices.
A flat ring over all N*L ranks sends 2(NL-1)/(NL) * S per rank over TCP; this
sends 2(N-1)/N * S/L, and the shared-memory legs run near memory speed.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from giantmodel.comm.shm import OP_AVG, OP_MAX, OP_MIN, OP_SUM, ShmGroup
from giantmodel.comm.topology import Topology

_GLOO_OPS = {OP_SUM: dist.ReduceOp.SUM, OP_MAX: dist.ReduceOp.MAX, OP_MIN: dist.ReduceOp.MIN}


class HierarchicalAllReduce:
    """Runs all-reduce over (shared memory within nodes) x (gloo across nodes).

    The tensor is cut into pieces so the legs overlap: while gloo carries
    piece k between nodes (on its own threads), this rank already
    reduce-scatters piece k+1 in shared memory.
    """

    PIECE_BYTES = 8 << 20

    def __init__(self, shm: ShmGroup, store, topo: Topology, timeout: timedelta):
        self.shm = shm
        self.local_size = topo.local_size
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
