"""``giantmodel plan --topology FILE``: the planned layout's rank placement,
from the same cost model and search that ``parallel.placement: auto`` runs at
start-up (:mod:`giantmodel.distributed.placement`), so the plan and the run
agree."""

from __future__ import annotations

from giantmodel.config.errors import ConfigError
from giantmodel.distributed.links import load_topology
from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.distributed.placement import PlacementResult, plan_placement


def add_topology_argument(p) -> None:
    p.add_argument("--topology", default=None, metavar="FILE",
                   help="topology.yaml of the cluster (giantmodel bench topology, or by "
                        "hand): place the best layout's ranks on its links, and write "
                        "parallel.placement=auto with comm.topology=FILE into --out")


def place_on_topology(run_cfg, path: str, world: int) -> PlacementResult:
    """Place ``run_cfg``'s layout on the topology file; sets
    ``parallel.placement: auto`` and ``comm.topology`` in ``run_cfg`` so the
    run resolves the same placement."""
    topo = load_topology(path)
    if topo.world_size != world:
        raise ConfigError(f"{path} describes {topo.world_size} ranks but the plan is for "
                          f"{world} (--nodes x --gpus-per-node)", "--topology")
    dims = ParallelDims.from_config(run_cfg, world)
    result = plan_placement(run_cfg, dims, topo)
    run_cfg.parallel.placement = "auto"
    run_cfg.comm.topology = path
    return result
