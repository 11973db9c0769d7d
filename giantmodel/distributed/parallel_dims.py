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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from giantmodel.config.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


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
    placement: list[int] | None = None
    """Global rank at each mesh position (row-major pp, dp_replicate, dp_shard, cp, tp); None is the identity."""
    timeout_s: float | None = None
    """Collective timeout applied to every mesh group (``parallel.timeout_s``)."""
    _mesh: object = field(default=None, repr=False, compare=False)
    _flat: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ build
    @classmethod
    def from_config(cls, cfg, world_size: int) -> ParallelDims:
        """Resolve ``parallel.dp = -1``, split dp into replicate x shard by the
        ZeRO stage and hybrid group, and validate the whole layout."""
        p = cfg.parallel
        others = p.tp * p.pp * p.cp
        if world_size % others:
            raise ConfigError(
                f"tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {others} does not divide the world size "
                f"{world_size}; change parallel.tp/pp/cp or the number of processes",
                "parallel")
        dp = world_size // others if p.dp == -1 else p.dp
        if dp * others != world_size:
            raise ConfigError(
                f"dp*tp*pp*cp = {dp}*{p.tp}*{p.pp}*{p.cp} = {dp * others} but the world size "
                f"is {world_size}; set parallel.dp={world_size // others} or -1 to fill", "parallel.dp")
        if p.zero == 0:
            replicate, shard = dp, 1
        else:
            group = p.shard_group_size or dp
            if dp % group:
                raise ConfigError(
                    f"shard_group_size {group} does not divide dp {dp}", "parallel.shard_group_size")
            replicate, shard = dp // group, group
        dims = cls(world_size=world_size, dp_replicate=replicate, dp_shard=shard,
                   cp=p.cp, tp=p.tp, pp=p.pp, placement=p.placement,
                   timeout_s=p.timeout_s)
        dims.validate_against(cfg)
        return dims

    # -------------------------------------------------------------- checks
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def validate_against(self, cfg) -> None:
        """Layout checks that need the model and batch: all before any process group."""
        m, t, p = cfg.model, cfg.train, cfg.parallel
        from giantmodel.distributed.placement import validate_placement

        validate_placement(self.placement, self.world_size)
        if self.cp > 1 and p.cp_method != "allgather":
            raise ConfigError(
                f"cp_method={p.cp_method!r} is not available; context parallelism exchanges "
                "K/V by all-gather: set parallel.cp_method=allgather", "parallel.cp_method")
        if self.tp > 1:
            for key, value in (("num_heads", m.num_heads), ("num_kv_heads", m.kv_heads),
                               ("ffn_hidden_size", m.ffn_hidden_size),
                               ("vocab_size", m.vocab_size)):
                if value % self.tp:
                    raise ConfigError(
                        f"model.{key}={value} is not divisible by parallel.tp={self.tp}; "
                        f"choose a tp that divides it", f"model.{key}")
            if p.sp and t.seq_len % self.tp:
                raise ConfigError(f"train.seq_len={t.seq_len} must be divisible by parallel.tp="
                                  f"{self.tp} for sequence parallelism", "train.seq_len")
        stages = self.pp * p.pp_virtual
        if self.pp > 1 and m.num_layers < stages:
            raise ConfigError(
                f"model.num_layers={m.num_layers} is fewer than pp*pp_virtual={stages} stages",
                "parallel.pp")
        if p.pp_layers is not None:
            if len(p.pp_layers) != stages or sum(p.pp_layers) != m.num_layers:
                raise ConfigError(
                    f"needs {stages} entries (pp*pp_virtual) summing to model.num_layers="
                    f"{m.num_layers}, got {p.pp_layers}", "parallel.pp_layers")
        if self.cp > 1 and t.seq_len % (2 * self.cp):
            raise ConfigError(
                f"train.seq_len={t.seq_len} must be divisible by 2*parallel.cp={2 * self.cp} "
                "(causal load balancing splits it into 2*cp chunks)", "train.seq_len")
        self._validate_batch(cfg)

    def _validate_batch(self, cfg) -> None:
        t = cfg.train
        per_step = t.micro_batch_size * self.dp
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                f"micro_batch_size*dp = {t.micro_batch_size}*{self.dp} = {per_step}",
                "train.global_batch_size")
        if self.pp > 1:
            # Schedule, micro-batch (incl. parallel.pp_microbatches) and
            # placement checks of the pipeline, all before any process group.
            from giantmodel.parallel.pipeline_split import (check_pipeline_placement,
                                                            validate_pipeline)
            validate_pipeline(cfg, self.pp, self.dp)
            check_pipeline_placement(self)

    def microbatches(self, cfg) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return cfg.train.global_batch_size // (cfg.train.micro_batch_size * self.dp)

    # --------------------------------------------------------------- mesh
    @property
    def degrees(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def mesh_layout(self):
        """[pp, dp_replicate, dp_shard, cp, tp] tensor of global ranks."""
        import torch

        ranks = torch.tensor(self.placement if self.placement is not None
                             else list(range(self.world_size)), dtype=torch.int64)
        return ranks.view(*self.degrees)

    def build_mesh(self, device_type: str = "cpu"):
        """Create the DeviceMesh (and its process groups) and the flattened
        views used by data parallelism and loss reduction: ``dp``
        (replicate x shard), ``dp_shard_cp`` (FSDP's shard group when cp > 1)
        and ``dp_cp`` (groups that see different tokens)."""
        from torch.distributed.device_mesh import DeviceMesh

        from giantmodel.distributed.placement import validate_placement

        if self.placement is not None:
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
        self._apply_timeout()
        return mesh

    def _apply_timeout(self) -> None:
        """Give every mesh group ``parallel.timeout_s``: torch creates them
        with its 30-minute default, which would let a dead peer stall a tp
        or dp collective far longer than the configured timeout."""
        if self.timeout_s is None:
            return
        from datetime import timedelta

        from torch.distributed.distributed_c10d import _set_pg_timeout

        seen = set()
        for name in MESH_DIMS + tuple(self._flat):
            group = self[name].get_group()
            if id(group) not in seen:
                seen.add(id(group))
                _set_pg_timeout(timedelta(seconds=self.timeout_s), group)

    def destroy_mesh(self) -> None:
        """Forget the mesh (its groups are freed with the default group);
        lets one process build several layouts in a row (tests, benchmarks)."""
        self._mesh = None
        self._flat = {}

    @property
    def mesh(self):
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def __getitem__(self, name):
        """Sub-mesh by name: 'tp', 'cp', 'pp', 'dp', 'dp_shard', 'dp_cp', ...;
        a tuple of plain dimension names gives a multi-dimensional sub-mesh."""
        if isinstance(name, str) and name in self._flat:
            return self._flat[name]
        return self.mesh[name]

    def group(self, name: str):
        return self[name].get_group()

    def coordinate(self, name: str) -> int:
        """This rank's index along a (possibly flattened) mesh dimension."""
        return self[name].get_local_rank()

    @cached_property
    def summary(self) -> str:
        return (f"world={self.world_size} pp={self.pp} dp={self.dp} "
                f"(replicate={self.dp_replicate} x shard={self.dp_shard}) cp={self.cp} tp={self.tp}")
