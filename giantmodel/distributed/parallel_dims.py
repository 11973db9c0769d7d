"""ParallelDims: THE topology object of a run.

It holds the degree of every parallel dimension, checks them against the world
size, the model shape and the batch before any process group exists, and
builds one named DeviceMesh from which every sub-group is taken. It is passed
explicitly to whatever needs a group; nothing reads process groups from
module-level globals.

Mesh dimensions, outermost first: ``pp, dp_replicate, dp_shard, cp, tp``.
TP is innermost so that, with the identity placement, a TP group is a set of
consecutive ranks (one node's fast links). ``placement`` permutes ranks onto
mesh positions; bandwidth-aware placement fills it.

Expert parallelism (``ep``) adds no ranks: it borrows them from dp x cp,
which :meth:`ParallelDims.build_mesh` reads as ``edp x ep`` (ep fastest, so
an ep group is a set of neighbouring dp x cp ranks) in a second mesh,
``EXPERT_MESH_DIMS``. Routed experts are sharded over ``ep``; the ``edp``
ranks hold the same experts and reduce their gradients ("expert data
parallel"). Why borrow rather than add a dimension: every rank of dp x cp
already sees its own tokens, so splitting the experts among them moves only
the routed tokens (the all-to-all) and leaves attention and dense weights
exactly as without ep (torchtitan borrows ep from dp_shard x cp the same way;
Megatron-Core's expert data-parallel group is our edp). ep may also span cp:
those ranks hold different tokens of the same sequences, which the experts
treat alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from giantmodel.config.errors import ConfigError
from giantmodel.config.schema import JobConfig
from giantmodel.core.layout import resolve_dp, validate_layout, validate_placement
from giantmodel.core.pipeline_split import PipelinePlan
from giantmodel.distributed.links import load_topology

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_MESH_DIMS = ("pp", "edp", "ep", "tp")


@dataclass
class ParallelDims:
    world_size: int
    """Number of ranks in the job."""
    dp_replicate: int = 1
    """Data-parallel replicas (all of dp for zero 0; the HSDP replica count otherwise)."""
    dp_shard: int = 1
    """Ranks that shard parameters/gradients/optimizer states within a replica."""
    cp: int = 1
    """Context-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    ep: int = 1
    """Expert-parallel degree, borrowed from dp x cp (module docstring)."""
    placement: list[int] | None = None
    """Global rank at each mesh position (row-major pp, dp_replicate, dp_shard, cp, tp); None is the identity."""
    timeout_s: float | None = None
    """Collective timeout applied to every mesh group (``parallel.timeout_s``)."""
    placement_pending: bool = False
    """True while ``parallel.placement: auto`` awaits :func:`~giantmodel.distributed.placement.resolve_placement`."""
    pipeline: PipelinePlan | None = None
    """Stages, schedule and micro-batches when ``pp > 1`` (made by :meth:`from_config`)."""
    _mesh: object = field(default=None, repr=False, compare=False)
    _flat: dict = field(default_factory=dict, repr=False, compare=False)
    _expert_mesh: object = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ build
    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> ParallelDims:
        """Resolve ``parallel.dp = -1``, split dp into replicate x shard by the
        ZeRO stage and hybrid group, and validate the whole layout (pipeline
        included) against ``cfg.model`` and ``cfg.train``: the one place a
        layout is checked, before any process group exists. A placement of
        "auto" is left None here; :func:`giantmodel.distributed.placement.resolve_placement`
        fills it once the process group exists, before :meth:`build_mesh`."""
        p = cfg.parallel
        replicate, shard = resolve_dp(p, world_size)
        # "auto" stays unresolved (None) until resolve_placement measures the links
        placement = None if p.placement == "auto" else p.placement
        dims = cls(world_size=world_size, dp_replicate=replicate, dp_shard=shard,
                   cp=p.cp, tp=p.tp, pp=p.pp, ep=p.ep, placement=placement,
                   timeout_s=p.timeout_s, placement_pending=p.placement == "auto")
        dims._check_ep(cfg)
        degrees = {"world_size": world_size, "tp": dims.tp, "cp": dims.cp, "pp": dims.pp,
                   "dp": dims.dp}
        dims.pipeline = validate_layout(degrees=degrees, rank_layout=dims.mesh_layout(),
                                        model=cfg.model, train=cfg.train, parallel=p)
        if p.placement == "auto" and cfg.comm.topology != "measure":
            load_topology(cfg.comm.topology, world_size)  # a bad file fails before any group
        return dims

    def _check_ep(self, cfg: JobConfig) -> None:
        """ep against the model and the dp x cp ranks it borrows (no group exists yet)."""
        if self.ep == 1:
            return
        moe = cfg.model.moe
        if moe is None:
            raise ConfigError(f"ep={self.ep} needs MoE layers and model.moe is not set (a dense "
                              "model has no experts to split); set parallel.ep=1", "parallel.ep")
        if moe.num_experts % self.ep:
            raise ConfigError(f"ep={self.ep} does not divide model.moe.num_experts "
                              f"{moe.num_experts}", "parallel.ep")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(f"ep={self.ep} does not divide the dp x cp = {self.dp} x {self.cp} "
                              "ranks it borrows from; raise parallel.dp or lower parallel.ep",
                              "parallel.ep")
        if self.pp > 1 and cfg.parallel.zero >= 2:
            # Not proven: FSDP2 units of experts inside pipeline stages hang.
            raise ConfigError(f"ep={self.ep} with pipeline stages runs ZeRO 0 or 1 only; set "
                              "parallel.zero to 0 or 1", "parallel.zero")

    @property
    def edp(self) -> int:
        """Ranks that hold the same experts on different tokens: (dp x cp) / ep."""
        return self.dp * self.cp // self.ep

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def microbatches(self, train) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return train.global_batch_size // (train.micro_batch_size * self.dp)

    # --------------------------------------------------------------- mesh
    @property
    def degrees(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def degree_map(self) -> dict[str, int]:
        """Degree of each mesh dimension, by name."""
        return dict(zip(MESH_DIMS, self.degrees))

    def mesh_layout(self):
        """[pp, dp_replicate, dp_shard, cp, tp] tensor of global ranks."""
        ranks = torch.tensor(self.placement if self.placement is not None
                             else list(range(self.world_size)), dtype=torch.int64)
        return ranks.view(*self.degrees)

    def build_mesh(self, device_type: str = "cpu"):
        """Create the DeviceMesh (and its process groups) and the flattened
        views used by data parallelism and loss reduction: ``dp``
        (replicate x shard), ``dp_shard_cp`` (FSDP's shard group when cp > 1)
        and ``dp_cp`` (groups that see different tokens)."""
        if self.placement_pending:
            raise ConfigError("'auto' must be resolved to a permutation before the mesh is "
                              "built (giantmodel.distributed.placement.resolve_placement)",
                              "parallel.placement")
        validate_placement(self.placement, self.world_size)
        mesh = DeviceMesh(device_type, self.mesh_layout(), mesh_dim_names=MESH_DIMS)
        # torch >= 2.11 wants flattened views kept by the caller rather than
        # sliced back out of the root mesh, so they live in ``_flat``.
        self._flat = {
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
        self._mesh = mesh
        if self.ep > 1:
            # The same ranks, dp x cp read as edp x ep. A mesh of its own (not
            # a flattened view): expert weights are DTensors on its ep
            # dimension, and FSDP2 shards them over edp, which it requires to
            # share a root mesh with ep.
            layout = self.mesh_layout().reshape(self.pp, self.edp, self.ep, self.tp)
            self._expert_mesh = DeviceMesh(device_type, layout, mesh_dim_names=EXPERT_MESH_DIMS)
        self._apply_timeout()
        return mesh

    @property
    def expert_mesh(self):
        """The ``pp x edp x ep x tp`` mesh (``ep > 1`` only)."""
        if self._expert_mesh is None:
            raise RuntimeError("no expert mesh: parallel.ep is 1 or build_mesh() was not called")
        return self._expert_mesh

    def _apply_timeout(self) -> None:
        """Give every mesh group ``parallel.timeout_s``: torch creates them
        with its 30-minute default, which would let a dead peer stall a tp
        or dp collective far longer than the configured timeout."""
        if self.timeout_s is None:
            return
        seen = set()
        groups = [self[name].get_group() for name in MESH_DIMS + tuple(self._flat)]
        if self._expert_mesh is not None:
            groups += [self._expert_mesh[n].get_group() for n in ("edp", "ep")]
        for group in groups:
            if id(group) not in seen:
                seen.add(id(group))
                _set_pg_timeout(timedelta(seconds=self.timeout_s), group)

    def destroy_mesh(self) -> None:
        """Forget the mesh (its groups are freed with the default group);
        lets one process build several layouts in a row (tests, benchmarks)."""
        self._mesh = None
        self._flat = {}
        self._expert_mesh = None

    @property
    def mesh(self):
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def __getitem__(self, name):
        """Sub-mesh by name: 'tp', 'cp', 'pp', 'dp', 'dp_shard', 'dp_cp', ...;
        a tuple of plain dimension names gives a multi-dimensional sub-mesh;
        'ep' and 'edp' come from the expert mesh."""
        if isinstance(name, str) and name in self._flat:
            return self._flat[name]
        if name in ("ep", "edp"):
            return self.expert_mesh[name]
        return self.mesh[name]

    def group(self, name: str):
        return self[name].get_group()

    def group_or_none(self, name: str):
        """The group of a mesh dimension, or None in a single process (where
        no mesh exists and every collective is a no-op)."""
        return None if self.world_size == 1 else self.group(name)

    def coordinate(self, name: str) -> int:
        """This rank's index along a (possibly flattened) mesh dimension (0 in
        a single process)."""
        return 0 if self.world_size == 1 else self[name].get_local_rank()

    @cached_property
    def summary(self) -> str:
        return (f"world={self.world_size} pp={self.pp} dp={self.dp} "
                f"(replicate={self.dp_replicate} x shard={self.dp_shard}) cp={self.cp} tp={self.tp}"
                + (f" ep={self.ep} (edp={self.edp})" if self.ep > 1 else ""))
