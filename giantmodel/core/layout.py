"""Layout validation: the one place a parallel layout is checked.

Runs before any process group exists, on the degrees a world size resolves
to, against the model shape and the batch. Every message names the config
key to change. :meth:`giantmodel.distributed.parallel_dims.ParallelDims.from_config`
calls :func:`validate_layout` once per start; the planner goes through the
same call, so it refuses exactly what the trainer would.
"""

from __future__ import annotations

from giantmodel.config.errors import ConfigError
from giantmodel.config.model import ModelConfig
from giantmodel.config.parallel import ParallelConfig
from giantmodel.config.train import TrainConfig
from giantmodel.core.pipeline_split import PipelinePlan, check_pipeline_placement, plan_pipeline


def resolve_dp(parallel: ParallelConfig, world_size: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for ``world_size`` ranks: ``parallel.dp = -1``
    filled in, dp split by the ZeRO stage and the HSDP group size."""
    p = parallel
    others = p.tp * p.pp * p.cp
    if world_size % others:
        raise ConfigError(
            f"tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {others} does not divide the world size "
            f"{world_size}; change parallel.tp, parallel.pp or parallel.cp, or the number "
            "of processes", "parallel")
    dp = world_size // others if p.dp == -1 else p.dp
    if dp * others != world_size:
        raise ConfigError(
            f"dp*tp*pp*cp = {dp}*{p.tp}*{p.pp}*{p.cp} = {dp * others} but the world size "
            f"is {world_size}; set parallel.dp={world_size // others} or -1 to fill",
            "parallel.dp")
    if p.shard_group_size is not None and p.zero < 2:
        raise ConfigError(f"hybrid sharding needs parallel.zero=2 or 3 (got zero={p.zero}); "
                          "remove parallel.shard_group_size or raise parallel.zero",
                          "parallel.shard_group_size")
    if p.zero == 0:
        return dp, 1
    group = p.shard_group_size or dp
    if dp % group:
        raise ConfigError(f"shard_group_size {group} does not divide dp {dp}",
                          "parallel.shard_group_size")
    return dp // group, group


def validate_placement(perm: list[int] | None, world_size: int) -> list[int]:
    """``perm`` (the identity when None), checked to be a permutation of
    ``0..world_size-1``."""
    if perm == "auto":
        raise ConfigError("'auto' must be resolved to a permutation before the mesh is built "
                          "(giantmodel.distributed.placement.resolve_placement)",
                          "parallel.placement")
    if perm is None:
        return list(range(world_size))
    if len(perm) != world_size:
        raise ConfigError(
            f"has {len(perm)} entries but the world size is {world_size}; give one global "
            "rank per mesh position, or null for the identity", "parallel.placement")
    if sorted(perm) != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(perm))
        raise ConfigError(
            f"must be a permutation of 0..{world_size - 1}; ranks {missing} are missing "
            "(some other rank is listed twice)", "parallel.placement")
    return list(perm)


def validate_layout(*, degrees: dict[str, int], rank_layout, model: ModelConfig,
                    train: TrainConfig, parallel: ParallelConfig) -> PipelinePlan | None:
    """Check a resolved layout; return the pipeline plan when ``pp > 1``.

    ``degrees`` holds ``tp, cp, pp, dp`` and ``world_size``; ``rank_layout``
    is the [pp, dp_replicate, dp_shard, cp, tp] tensor of global ranks."""
    tp, cp, pp, dp = degrees["tp"], degrees["cp"], degrees["pp"], degrees["dp"]
    if parallel.placement != "auto":  # "auto" is resolved (and checked) at start-up
        validate_placement(parallel.placement, degrees["world_size"])
    if tp > 1:
        _check_tensor_parallel(tp, model, train, parallel)
    if cp > 1 and getattr(model, "attn_softcap", None) is not None:
        # context-parallel attention replaces the attention core and has no
        # score modifier: the cap would be lost silently
        raise ConfigError(f"parallel.cp={cp} with attention soft-capping (model.attn_softcap) is "
                          "not supported yet; use parallel.cp=1", "parallel.cp")
    if cp > 1 and train.seq_len % (2 * cp):
        raise ConfigError(
            f"train.seq_len={train.seq_len} must be divisible by 2*parallel.cp={2 * cp} "
            "(causal load balancing splits it into 2*cp chunks)", "train.seq_len")
    per_step = train.micro_batch_size * dp
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not a multiple of "
            f"micro_batch_size*dp = {train.micro_batch_size}*{dp} = {per_step}",
            "train.global_batch_size")
    if pp == 1:
        if parallel.pp_layers is not None and parallel.pp_layers != [model.num_layers]:
            raise ConfigError(f"gives a split {parallel.pp_layers} but parallel.pp=1; remove "
                              "it or set parallel.pp", "parallel.pp_layers")
        return None
    check_pipeline_placement(rank_layout, pp)
    return plan_pipeline(model=model, train=train, parallel=parallel, pp=pp, dp=dp)


def _check_tensor_parallel(tp: int, model: ModelConfig, train: TrainConfig,
                           parallel: ParallelConfig) -> None:
    if getattr(model, "mla", None) is not None:
        # the tp plan shards wq/wk/wv by heads; latent attention's low-rank
        # projections have no such plan yet
        raise ConfigError(f"parallel.tp={tp} with multi-head latent attention (model.mla) is "
                          "not supported yet; use parallel.tp=1 (pp, ZeRO and ep work)",
                          "parallel.tp")
    for key, value in (("num_heads", model.num_heads), ("num_kv_heads", model.kv_heads),
                       ("ffn_hidden_size", model.ffn_hidden_size),
                       ("vocab_size", model.vocab_size)):
        if value % tp:
            raise ConfigError(f"model.{key}={value} is not divisible by parallel.tp={tp}; "
                              "choose a tp that divides it", f"model.{key}")
    if parallel.sp and train.seq_len % tp:
        raise ConfigError(f"train.seq_len={train.seq_len} must be divisible by parallel.tp="
                          f"{tp} for sequence parallelism", "train.seq_len")
