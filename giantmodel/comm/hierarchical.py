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
    """Runs all-reduce over (shared memory within nodes) x (gloo across nodes)."""

    def __init__(self, shm: ShmGroup, store, topo: Topology, timeout: timedelta):
        self.shm = shm
        self.local_size = topo.local_size
        # Local rank i of every node forms one cross-node group.
        self.cross = dist.ProcessGroupGloo(
            dist.PrefixStore(f"cross/{topo.local_rank}/", store), topo.node_index,
            topo.num_nodes, timeout)

    def all_reduce(self, flat: torch.Tensor, op: int, scale: float) -> None:
        """In place on a contiguous 1-D tensor; OP_AVG multiplies the sum by scale."""
        L = self.local_size
        n = flat.numel()
        per = -(-n // L)
        padded = flat if per * L == n else torch.cat([flat, flat.new_zeros(per * L - n)])
        part = torch.empty(per, dtype=flat.dtype)
        inner_op = OP_SUM if op == OP_AVG else op
        self.shm.reduce_scatter_scaled(padded, part, inner_op, 1.0)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _GLOO_OPS[inner_op]
        self.cross.allreduce([part], opts).wait()
        if op == OP_AVG:
            part.mul_(scale)
        self.shm.all_gather(part, padded)
        if padded is not flat:
            flat.copy_(padded[:n])
