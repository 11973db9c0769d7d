"""Which ranks of a process group share a host ("node"), learned at creation."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from giantmodel.comm.settings import GiantOptions
from giantmodel.config.errors import ConfigError


@dataclass(frozen=True)
class Topology:
    """Nodes of one process group, in group ranks."""

    rank: int
    """This process's rank in the group."""

    nodes: tuple[tuple[int, ...], ...]
    """Group ranks on each node, nodes ordered by their lowest rank."""

    hierarchical: bool
    """True when collectives run hierarchically across nodes."""

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def node_index(self) -> int:
        return next(i for i, n in enumerate(self.nodes) if self.rank in n)

    @property
    def local_rank(self) -> int:
        return self.nodes[self.node_index].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.nodes[self.node_index])

    @classmethod
    def discover(cls, store, rank: int, size: int, global_ranks: list[int] | None,
                 settings: GiantOptions) -> Topology:
        """Exchange a node key per rank through ``store`` and group ranks by it.

        The key is the host name, or, with ``node_size`` set, the global rank
        divided by ``node_size`` so that one host can emulate several nodes.
        """
        global_rank = (global_ranks[rank] if global_ranks
                       else int(os.environ.get("RANK", rank)))
        if settings.node_size > 0:
            key = f"emulated-{global_rank // settings.node_size}"
        else:
            key = socket.gethostname()
        store.set(f"topo/{rank}", key)
        keys = [store.get(f"topo/{r}").decode() for r in range(size)]
        groups: dict[str, list[int]] = {}
        for r, k in enumerate(keys):
            groups.setdefault(k, []).append(r)
        nodes = tuple(tuple(g) for g in groups.values())
        even = len({len(n) for n in nodes}) == 1
        if settings.hierarchical == "on" and not even:
            raise ConfigError(f"hierarchical collectives need equally sized nodes, got "
                              f"{[len(n) for n in nodes]} ranks per node; set "
                              "comm.hierarchical=off or fix comm.node_size",
                              key="comm.hierarchical")
        hier = len(nodes) > 1 and even and settings.hierarchical != "off"
        return cls(rank=rank, nodes=nodes, hierarchical=hier)
