"""Communication traffic per mesh dimension: what each parallel dimension moves per step.

A pure function of the config and the resolved degrees (no process group), so
that rank placement (:mod:`giantmodel.distributed.placement`) and the planner
price the same bytes. Each entry names the mesh dimensions its groups span
(one dimension, or several flattened: gradient sync spans dp and cp), the
collective, the full (unsharded) buffer of one call, and calls per optimizer
step on one rank:

* ``tp``: 4 all-reduces of the micro-batch's activations per layer (attention
  and MLP outputs, forward and backward; with sequence parallelism the same
  volume as reduce-scatter + all-gather), 2 more around the vocab-parallel
  embedding and head, 3 small ones of the vocab-parallel cross-entropy; full
  recompute repeats the 2 forward ones per layer.
* ``cp``: per layer an all-gather of K and V in the forward and a
  reduce-scatter of their gradients in the backward.
* ``pp``: per micro-batch one activation forward and one gradient backward
  across each stage boundary (point-to-point), per virtual stage.
* data parallelism: ZeRO 0 all-reduces the fp32 gradients of the stage's
  (tp-local) parameters over dp x cp once per step; ZeRO 1/2 reduce-scatter
  them and all-gather the updated parameters; ZeRO 3 (FSDP2) all-gathers the
  parameters twice per micro-batch (forward, backward) and reduce-scatters
  the gradients over dp_shard x cp, and HSDP all-reduces the shard's
  gradients over dp_replicate.

Parameter counts are the config's own exact count
(:meth:`~giantmodel.config.model.ModelConfig.num_params`: biases, qk-norm,
tied heads, MoE layers), split into embedding, block and head here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from giantmodel.config.model import ModelConfig
from giantmodel.config.parallel import ParallelConfig
from giantmodel.config.train import TrainConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class Traffic:
    """One kind of call a mesh dimension (or a flattened set of them) makes."""

    dims: tuple[str, ...]
    """Mesh dimensions whose flattened groups run the call."""
    kind: str
    """all_reduce, all_gather, reduce_scatter (rings) or p2p (neighbouring stages)."""
    nbytes: float
    """Full buffer of one call (the gathered / reduced size; one message for p2p)."""
    count: float
    """Calls per optimizer step on one rank."""
    what: str = ""
    """What moves, for reports."""


def param_counts(model: ModelConfig) -> tuple[int, float, int]:
    """(embedding, one transformer block, final norm + head) parameter counts,
    from :meth:`ModelConfig.num_params` (one count for the whole project).
    The block is the mean over blocks (MoE layers may differ from dense ones)."""
    h, v = model.hidden_size, model.vocab_size
    blocks_and_final = model.num_params(include_embeddings=False)
    one = dataclasses.replace(model, num_layers=1, moe=None)
    two = dataclasses.replace(one, num_layers=2)
    final = 2 * one.num_params(False) - two.num_params(False)
    blocks = blocks_and_final - final
    block = blocks // model.num_layers if blocks % model.num_layers == 0 else blocks / model.num_layers
    head = 0 if model.tie_embeddings else v * h
    embed = model.num_params() - blocks_and_final - head
    return embed, block, final + head


def stage_param_numel(model: ModelConfig, pp: int, tp: int) -> float:
    """Parameters held by the largest pipeline stage on one tensor-parallel
    rank (block weights split by tp; norms are few enough to ignore)."""
    embed, block, head = param_counts(model)
    layers = -(-model.num_layers // pp)
    edge = max(embed, head) if pp > 1 else embed + head
    return (layers * block + edge) / tp


def mesh_traffic(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig,
                 degrees: dict[str, int], precision: str = "fp32",
                 recompute: str = "none", microbatches: int | None = None) -> list[Traffic]:
    """Every call a training step makes, by the mesh dimensions it spans.

    ``degrees`` holds pp, dp_replicate, dp_shard, cp, tp (as
    :class:`~giantmodel.distributed.parallel_dims.ParallelDims` resolves them)."""
    pp, tp, cp = degrees["pp"], degrees["tp"], degrees["cp"]
    rep, shard = degrees["dp_replicate"], degrees["dp_shard"]
    c = DTYPE_BYTES[precision]
    m = microbatches or train.global_batch_size // (train.micro_batch_size * rep * shard)
    layers = -(-model.num_layers // pp)
    tokens = train.micro_batch_size * train.seq_len / cp     # per rank, per micro-batch
    act = tokens * model.hidden_size * c
    out: list[Traffic] = []
    if tp > 1:
        per_mb = 4 * layers + (2 * layers if recompute == "full" else 0) + 2
        out.append(Traffic(("tp",), "all_reduce", act, per_mb * m, "activations"))
        out.append(Traffic(("tp",), "all_reduce", tokens * 4, 3 * m, "cross-entropy stats"))
    if cp > 1:
        kv = train.micro_batch_size * train.seq_len * 2 * model.kv_heads \
            * model.dim_per_head / tp * c
        gathers = 2 if recompute == "full" else 1
        out.append(Traffic(("cp",), "all_gather", kv, gathers * layers * m, "K/V"))
        out.append(Traffic(("cp",), "reduce_scatter", kv, layers * m, "K/V gradients"))
    if pp > 1:
        boundary = act / (tp if parallel.sp else 1)
        out.append(Traffic(("pp",), "p2p", boundary, 2 * m * parallel.pp_virtual,
                           "stage activations and gradients"))
    out += _data_parallel(model, parallel, pp, tp, cp, rep, shard, c, m)
    return out


def _data_parallel(model, parallel, pp, tp, cp, rep, shard, c, m) -> list[Traffic]:
    params = stage_param_numel(model, pp, tp)
    grads = params * 4  # gradients are reduced in fp32
    if rep * shard * cp == 1:
        return []
    all_dp = ("dp_replicate", "dp_shard", "cp")
    if parallel.zero == 0:
        return [Traffic(all_dp, "all_reduce", grads, 1, "gradients")]
    if parallel.zero in (1, 2):
        return [Traffic(all_dp, "reduce_scatter", grads, 1, "gradients"),
                Traffic(all_dp, "all_gather", params * 4, 1, "updated parameters")]
    out = []
    if shard * cp > 1:
        out += [Traffic(("dp_shard", "cp"), "all_gather", params * c, 2 * m, "parameters"),
                Traffic(("dp_shard", "cp"), "reduce_scatter", grads, m, "gradients")]
    if rep > 1:
        out.append(Traffic(("dp_replicate",), "all_reduce", grads / (shard * cp), 1,
                           "gradient shards (HSDP)"))
    return out
