"""A resolved layout: every degree and batch figure the cost models need.

Built from a JobConfig and a cluster shape through the same validation the
trainer runs (:class:`ParallelDims` and the pipeline checks), so a layout the
trainer would refuse is refused here with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass

from giantmodel.config.errors import ConfigError
from giantmodel.core.pipeline_split import stage_ids_for_rank
from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.models.lora import block_targets


@dataclass(frozen=True)
class Cluster:
    """How many GPUs, and how they sit in nodes."""

    nodes: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def __str__(self) -> str:
        return f"{self.nodes} x {self.gpus_per_node}"


@dataclass(frozen=True)
class Layout:
    """Degrees, schedule, batch shape and memory options of one candidate run."""

    tp: int
    pp: int
    dp: int
    dp_shard: int
    cp: int
    sp: bool
    zero: int
    virtual: int
    schedule: str
    micro_batch: int
    n_micro: int
    seq_len: int
    precision: str
    recompute: str
    offload_activations: bool
    stage_layers: tuple[int, ...]
    bucket_mb: float = 25.0
    lora_rank: int = 0
    """LoRA adapter rank (0: every parameter trains)."""
    lora_paths: tuple[str, ...] = ()
    """Block linears carrying adapters (e.g. ``attention.wq``); the rest is frozen."""
    lora_nf4: bool = False
    """QLoRA: adapted base weights stored as 4-bit NF4."""
    recompute_layers: tuple[str, ...] | None = None
    """Per-block recompute modes (one per model layer); None: ``recompute`` everywhere."""
    keep_gathered_numel: int = 1_000_000_000
    """``parallel.keep_gathered_numel``: zero 3 keeps a block gathered from its forward to its
    backward when fewer parameters run in between (``parallel.fsdp.kept_gathered``)."""
    weight_cast: str = "step"
    """``train.weight_cast``: step keeps the block linears' compute-dtype
    casts through the step (zero 0-2), use keeps none."""
    loss_impl: str = "plain"
    """``train.loss_impl`` as asked (tp > 1 and pipelines run plain whatever
    it says; :func:`giantmodel.planner.head.head_loss_impl` resolves it)."""
    optim_impl: str = "auto"
    """AdamW kernel (``optim.impl``): foreach allocates a temporary the size
    of the optimizer's parameters in each step; fused (auto, on CUDA and CPU) does not."""
    ep: int = 1
    """Expert parallelism (``parallel.ep``): routed experts split over ep of the dp x cp
    ranks, their states sharded over the (dp x cp) / ep ranks holding the same experts."""

    def layer_modes(self, pp_rank: int) -> list[str]:
        """Recompute mode of each block that pipeline rank ``pp_rank`` runs."""
        n = sum(self.stage_layers[s] for s in self.rank_stages(pp_rank))
        if self.recompute_layers is None:
            return [self.recompute] * n
        starts = [sum(self.stage_layers[:s]) for s in range(self.num_stages)]
        return [self.recompute_layers[starts[s] + i] for s in self.rank_stages(pp_rank)
                for i in range(self.stage_layers[s])]

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def rank_stages(self, pp_rank: int) -> list[int]:
        """Global stage ids run by pipeline rank ``pp_rank``."""
        if self.pp == 1:
            return list(range(self.num_stages))
        return stage_ids_for_rank(pp_rank, self.pp, self.virtual, self.schedule)

    def layer_mode_counts(self, pp_rank: int) -> dict[str, int]:
        """How many of pipeline rank ``pp_rank``'s blocks run each recompute mode."""
        if self.recompute_layers is None:
            return {self.recompute: sum(self.stage_layers[s] for s in self.rank_stages(pp_rank))}
        out: dict[str, int] = {}
        for mode in self.layer_modes(pp_rank):
            out[mode] = out.get(mode, 0) + 1
        return out

    def describe(self) -> str:
        zero = f"zero{self.zero}" + (f"/hsdp{self.dp_shard}" if self.zero and self.dp_shard < self.dp
                                     else "")
        pp = f"pp{self.pp}" + (f"v{self.virtual}" if self.virtual > 1 else "")
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else ""), pp, f"dp{self.dp}", zero]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"mb{self.micro_batch}x{self.n_micro}")
        if self.recompute_layers is None:
            parts.append(f"rc:{self.recompute}")
        else:
            counts = {m: self.recompute_layers.count(m) for m in ("none", "selective", "full")}
            parts.append("rc:" + "/".join(f"{counts[m]}{m[0]}" for m in counts if counts[m]))
        if self.lora_rank:
            parts.append(f"lora{self.lora_rank}" + ("-nf4" if self.lora_nf4 else ""))
        if self.offload_activations:
            parts.append("act-offload")
        return " ".join(parts)


def resolve_layout(cfg, cluster: Cluster) -> Layout:
    """The layout ``cfg`` describes on ``cluster``; raises ConfigError when the
    trainer would refuse it (degrees that do not divide the model or world)."""
    if cluster.nodes < 1 or cluster.gpus_per_node < 1:
        raise ConfigError(f"need at least one node and one GPU per node, got {cluster}",
                          "--nodes")
    dims = ParallelDims.from_config(cfg, cluster.world)
    p = cfg.parallel
    n_micro = dims.microbatches(cfg.train)
    micro_batch = cfg.train.micro_batch_size
    split = [cfg.model.num_layers]
    if dims.pipeline is not None:
        # a pipeline step may cut the batch into parallel.pp_microbatches pieces
        n_micro = dims.pipeline.n_micro
        micro_batch = cfg.train.global_batch_size // dims.dp // n_micro
        split = list(dims.pipeline.layer_counts)
    return Layout(
        tp=dims.tp, pp=dims.pp, dp=dims.dp, dp_shard=dims.dp_shard, cp=dims.cp, sp=p.sp,
        zero=p.zero, virtual=p.pp_virtual if dims.pp > 1 else 1, schedule=p.pp_schedule,
        micro_batch=micro_batch, n_micro=n_micro, seq_len=cfg.train.seq_len,
        precision=cfg.precision, recompute=cfg.recompute,
        offload_activations=cfg.offload.activations, stage_layers=tuple(split),
        bucket_mb=p.bucket_mb, ep=dims.ep,
        recompute_layers=tuple(cfg.recompute_layers) if cfg.recompute_layers else None,
        **job_fields(cfg))


def job_fields(cfg) -> dict:
    """The Layout fields every layout of ``cfg``'s job shares, whatever the
    degrees: the optimizer kernel and, for the lora objective, the adapters."""
    out = {"optim_impl": cfg.optim.impl, "keep_gathered_numel": cfg.parallel.keep_gathered_numel,
           "loss_impl": cfg.train.loss_impl, "weight_cast": cfg.train.weight_cast}
    if cfg.objective == "lora":
        out.update(lora_rank=cfg.lora.rank, lora_nf4=cfg.lora.quantize_base == "nf4",
                   lora_paths=tuple(block_targets(cfg.lora.targets, cfg.model.arch)))
    return out
