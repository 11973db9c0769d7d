"""Parallel layout section of the job config (``parallel.*``).

Only checks that need no world size live here; checks against the world size
and the model shape are in :mod:`giantmodel.distributed.parallel_dims`, which
runs them before any process group is created.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from giantmodel.config.errors import ConfigError

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
# Schedules that run several stages (model chunks) per pipeline rank.
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble", "zbv")


@dataclass
class ParallelConfig:
    """Degrees of each parallel dimension and how they are realised."""

    dp: int = -1
    """Data-parallel degree; -1 fills whatever ranks tp*pp*cp leave."""
    zero: int = 0
    """ZeRO stage: 0 replicated (bucketed all-reduce), 1 optimizer states sharded, 2 gradients too, 3 parameters too (FSDP2). Stages 1 and 2 run on flat buffers where each rank owns whole parameters; where whole parameters cannot be shared out evenly (more ranks than a stage's large tensors can balance: the buffers would grow over 10%), they shard dim 0 through FSDP2 instead, with the same traffic per step. On GPUs they do so too where the first gradient bucket would hold over half the gradients (a large head balanced over many ranks), whose reduction could not overlap backward."""
    shard_group_size: int | None = None
    """Hybrid sharding (HSDP): shard within groups of this many dp ranks and replicate across groups; null shards across all of dp."""
    tp: int = 1
    """Tensor-parallel degree: splits heads, MLP, embedding and output head."""
    sp: bool = False
    """Sequence parallelism on top of tp: norms and dropout run on sequence shards."""
    pp: int = 1
    """Pipeline-parallel degree (number of stages per model replica)."""
    pp_schedule: Literal[PP_SCHEDULES] = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b (needs pp_virtual >= 2), zero_bubble (interleaved zero-bubble; any pp_virtual) or zbv (V-shaped zero-bubble; pp_virtual = 2)."""
    pp_virtual: int = 1
    """Virtual stages (model chunks) per pipeline rank, for interleaved_1f1b, zero_bubble and zbv."""
    pp_layers: list[int] | None = None
    """Hand-made split: transformer layers per stage (pp*pp_virtual entries); null balances by cost. A stage may hold none: [0, 1, ..., 1, 0] runs the embedding and the head as chunks of their own (Llama 3's split), so pp*pp_virtual may exceed model.num_layers."""
    pp_microbatches: int | None = None
    """Micro-batches per pipeline step; null derives it from train.global_batch_size / (micro_batch_size * dp)."""
    cp: int = 1
    """Context-parallel degree: splits the sequence of causal attention across ranks."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's routed experts are split over ep ranks, and tokens travel to their experts' ranks by all-to-all. The ep ranks are borrowed from dp x cp (ep must divide it): they still see different tokens and still hold every other weight. The (dp x cp) / ep ranks holding the same experts reduce expert gradients among themselves ("expert data parallel", Megatron-Core's expert_data_parallel group), so no extra ranks are needed and attention and dense weights keep their dp x cp reduction."""
    cp_method: Literal["allgather"] = "allgather"
    """How context-parallel attention exchanges K/V: all-gather of K/V with causal load balancing."""
    bucket_mb: float = 25.0
    """Gradient all-reduce bucket size in MiB (zero 0-2)."""
    keep_gathered_numel: int = 1_000_000_000
    """ZeRO-3 without pipelining: a block stays gathered from its forward to its backward when fewer than this many parameters run in between (twice those after it), DeepSpeed's stage3_max_reuse_distance rule; 0 reshards every block after forward (FSDP2's default): least memory, one more all-gather per block in backward."""
    placement: list[int] | Literal["auto"] | None = None
    """Rank placement: entry i is the global rank that takes mesh position i (pp, dp, cp, tp order, tp fastest); null is the identity; "auto" chooses the order with the least predicted communication time on the links of comm.topology (logged, and written resolved into run.dir/config.yaml)."""
    timeout_s: float = 600.0
    """Collective timeout: a dead or stuck rank makes the others fail after this many seconds."""

    def validate(self) -> None:
        for key in ("tp", "pp", "cp", "ep", "pp_virtual"):
            if getattr(self, key) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, key)}", f"parallel.{key}")
        if self.dp == 0 or self.dp < -1:
            raise ConfigError(f"must be >= 1, or -1 to fill the remaining ranks; got {self.dp}",
                              "parallel.dp")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"must be 0, 1, 2 or 3; got {self.zero}", "parallel.zero")
        if self.sp and self.tp == 1:
            raise ConfigError("sequence parallelism needs parallel.tp > 1", "parallel.sp")
        if self.shard_group_size is not None and self.shard_group_size < 1:
            raise ConfigError("must be >= 1 or null", "parallel.shard_group_size")
        if self.bucket_mb <= 0:
            raise ConfigError("must be positive", "parallel.bucket_mb")
        if self.keep_gathered_numel < 0:
            raise ConfigError("must be >= 0 (0 reshards every block after forward)",
                              "parallel.keep_gathered_numel")
        if self.timeout_s <= 0:
            raise ConfigError("must be positive", "parallel.timeout_s")
        if self.pp_virtual > 1 and self.pp_schedule not in MULTI_STAGE_SCHEDULES:
            raise ConfigError(
                f"pp_virtual={self.pp_virtual} needs an interleaved schedule; set "
                "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual")
        if self.pp_schedule == "interleaved_1f1b" and self.pp > 1 and self.pp_virtual < 2:
            raise ConfigError("interleaved_1f1b needs parallel.pp_virtual >= 2",
                              "parallel.pp_schedule")
        if self.pp_layers is not None and any(n < 0 for n in self.pp_layers):
            raise ConfigError("layer counts must be >= 0", "parallel.pp_layers")
