"""How a model is cut into pipeline stages, and which rank runs which stage.

Pure functions of the config: no process group, so the planner and the layout
validation use them before launch; the pipeline engine runs the plan made here.

Cost model (forward FLOPs per token, the backward is a fixed multiple of it and
does not change the balance):

* a transformer layer: 2 FLOPs per weight (its matmuls) plus causal attention,
  ``2 * seq_len * q_width`` (QK^T and AV, each half-masked on average);
* the embedding (first stage): a row lookup, counted as ``hidden`` FLOPs;
* the output head (last stage): ``2 * hidden * vocab`` for the projection plus
  about ``5 * vocab`` for the softmax cross-entropy over the logits.

With a large vocabulary the head alone can cost as much as several layers, so
the last stage gets fewer layers than the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from giantmodel.config.errors import ConfigError
from giantmodel.config.model import ModelConfig
from giantmodel.config.parallel import MULTI_STAGE_SCHEDULES, ParallelConfig
from giantmodel.config.train import TrainConfig


def layer_cost(model_cfg, seq_len: int) -> float:
    """Forward FLOPs per token of one transformer block."""
    h, f = model_cfg.hidden_size, model_cfg.ffn_hidden_size
    q = model_cfg.num_heads * model_cfg.dim_per_head
    kv = model_cfg.kv_heads * model_cfg.dim_per_head
    mlp_mats = 3 if model_cfg.arch == "llama" else 2
    weights = h * (q + 2 * kv) + q * h + mlp_mats * h * f
    return 2.0 * weights + 2.0 * seq_len * q


def embedding_cost(model_cfg) -> float:
    """Forward cost per token of the embedding lookup (first stage)."""
    return float(model_cfg.hidden_size)


def head_cost(model_cfg) -> float:
    """Forward cost per token of final norm, output projection and loss (last stage)."""
    return 2.0 * model_cfg.hidden_size * model_cfg.vocab_size + 5.0 * model_cfg.vocab_size


def balanced_split(num_layers: int, num_stages: int, per_layer: float,
                   first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Layers per stage (contiguous, each stage at least one layer) that
    minimise the most expensive stage; ties go to the split whose stages are
    closest to equal layer counts, then to the earliest stages holding more.

    Exact dynamic programme over (stage, layers used): O(S * L^2), trivial for
    real layer counts.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} stages")

    def cost(stage: int, n: int) -> float:
        c = n * per_layer
        if stage == 0:
            c += first_extra
        if stage == num_stages - 1:
            c += last_extra
        return c

    # best[s][k]: (max cost, spread) of the best split of the first k layers over
    # stages 0..s-1; choice[s][k]: layers of stage s-1 in that split.
    inf = (float("inf"), float("inf"))
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    even = num_layers / num_stages
    for s in range(1, num_stages + 1):
        for k in range(s, num_layers - (num_stages - s) + 1):
            for n in range(1, k - (s - 1) + 1):
                prev = best[s - 1][k - n]
                if prev[0] == float("inf"):
                    continue
                cand = (max(prev[0], cost(s - 1, n)), prev[1] + (n - even) ** 2)
                # strict '<' keeps the first n found (the smallest), so the
                # current stage takes fewer layers and earlier ones more.
                if _less(cand, best[s][k]):
                    best[s][k], choice[s][k] = cand, n
    counts, k = [], num_layers
    for s in range(num_stages, 0, -1):
        n = choice[s][k]
        counts.append(n)
        k -= n
    return counts[::-1]


def _less(a: tuple[float, float], b: tuple[float, float]) -> bool:
    # Costs are floats from a sum; treat relative differences below 1e-9 as ties.
    if abs(a[0] - b[0]) > 1e-9 * max(1.0, abs(b[0])):
        return a[0] < b[0]
    return a[1] < b[1] - 1e-12


def layers_per_stage(model_cfg: ModelConfig, *, seq_len: int, num_stages: int,
                     pp_layers: list[int] | None = None) -> list[int]:
    """``pp_layers`` when given (checked), else the cost-balanced split."""
    if pp_layers is not None:
        if len(pp_layers) != num_stages or sum(pp_layers) != model_cfg.num_layers:
            raise ConfigError(
                f"needs {num_stages} entries (pp*pp_virtual) summing to model.num_layers="
                f"{model_cfg.num_layers}, got {pp_layers}", "parallel.pp_layers")
        return list(pp_layers)
    return balanced_split(model_cfg.num_layers, num_stages, layer_cost(model_cfg, seq_len),
                          embedding_cost(model_cfg), head_cost(model_cfg))


def stage_layer_ranges(counts: list[int]) -> list[range]:
    """Global layer indices held by each stage, in stage order."""
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def stage_ids_for_rank(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """Global stage indices run by pipeline rank ``pp_rank``, in execution order.

    Looped placement (interleaved schedules): chunk v of rank s is stage
    ``v * pp + s``. The ZBV schedule needs a V: rank s holds stages s and
    ``2 * pp - 1 - s``, so the first and the last stage share rank 0.
    """
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [v * pp + pp_rank for v in range(virtual)]


def stage_owner(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank that runs global stage ``stage``."""
    if schedule == "zbv":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def pipeline_microbatches(train: TrainConfig, *, dp: int, pp_microbatches: int | None) -> int:
    """Micro-batches one pipeline step cuts a dp rank's share of the global
    batch into: ``parallel.pp_microbatches``, or the trainer's own count."""
    sequences = train.global_batch_size // dp
    if pp_microbatches is None:
        return sequences // train.micro_batch_size
    if pp_microbatches < 1 or sequences % pp_microbatches:
        raise ConfigError(
            f"must be a positive divisor of the {sequences} sequences each data-parallel rank "
            f"gets per step (train.global_batch_size / dp); got {pp_microbatches}",
            "parallel.pp_microbatches")
    return pp_microbatches


@dataclass(frozen=True)
class PipelinePlan:
    """How a model replica runs as pipeline stages: made once, by
    :func:`plan_pipeline`, when the layout is validated."""

    pp: int
    """Pipeline ranks per replica."""
    schedule: str
    """``parallel.pp_schedule``."""
    virtual: int
    """Stages per pipeline rank (2 for zbv)."""
    n_micro: int
    """Micro-batches per pipeline step."""
    layer_counts: tuple[int, ...]
    """Transformer layers of each global stage."""

    @property
    def num_stages(self) -> int:
        return len(self.layer_counts)

    @property
    def multi_stage(self) -> bool:
        """True when the schedule class takes a list of stages per rank."""
        return self.schedule in MULTI_STAGE_SCHEDULES

    def layer_ranges(self) -> list[range]:
        return stage_layer_ranges(list(self.layer_counts))

    def stage_ids(self, pp_rank: int) -> list[int]:
        return stage_ids_for_rank(pp_rank, self.pp, self.virtual, self.schedule)

    def owner(self, stage: int) -> int:
        return stage_owner(stage, self.pp, self.schedule)


def plan_pipeline(*, model: ModelConfig, train: TrainConfig, parallel: ParallelConfig,
                  pp: int, dp: int) -> PipelinePlan:
    """Check the pipeline settings against the model and batch and return the
    plan; needs no process group. ``pp`` must be > 1."""
    p = parallel
    n_micro = pipeline_microbatches(train, dp=dp, pp_microbatches=p.pp_microbatches)
    if p.pp_schedule == "zbv" and p.pp_virtual != 2:
        raise ConfigError(
            f"the zbv schedule runs exactly 2 stages per rank; set parallel.pp_virtual=2 "
            f"(got {p.pp_virtual})", "parallel.pp_virtual")
    key = "parallel.pp_microbatches" if p.pp_microbatches else "train.global_batch_size"
    if p.pp_schedule in MULTI_STAGE_SCHEDULES and p.pp_virtual > 1 and n_micro % pp:
        raise ConfigError(
            f"{p.pp_schedule} needs micro-batches per step ({n_micro}) to be a multiple of "
            f"parallel.pp={pp}; change train.global_batch_size, train.micro_batch_size or "
            "parallel.pp_microbatches", key)
    if p.pp_schedule != "gpipe" and n_micro < pp:
        raise ConfigError(
            f"{n_micro} micro-batches per step is fewer than parallel.pp={pp} stages, which "
            f"{p.pp_schedule} needs; raise train.global_batch_size, lower "
            "train.micro_batch_size, or set parallel.pp_microbatches", key)
    stages = pp * p.pp_virtual
    # A split given by hand may leave stages without blocks (Llama 3's first chunk holds only the
    # embedding, its last only the head); the automatic split gives every stage one at least.
    if model.num_layers < stages and p.pp_layers is None:
        raise ConfigError(
            f"model.num_layers={model.num_layers} is fewer than pp*pp_virtual={stages} stages; "
            "lower parallel.pp or parallel.pp_virtual, or give parallel.pp_layers", "parallel.pp")
    counts = layers_per_stage(model, seq_len=train.seq_len, num_stages=stages,
                              pp_layers=p.pp_layers)
    return PipelinePlan(pp=pp, schedule=p.pp_schedule, virtual=p.pp_virtual, n_micro=n_micro,
                        layer_counts=tuple(counts))


def check_pipeline_placement(rank_layout, pp: int) -> None:
    """Each pipeline group's ranks must increase along pp.

    ``rank_layout`` is the [pp, ...] tensor of global ranks by mesh position.
    A process group numbers its members in increasing global rank, and the
    pipeline schedules place stages by that number, while data parallelism
    pairs ranks by their mesh coordinate: the two agree only when every
    pipeline group is in increasing order. Needs no process group.
    """
    if pp <= 1:
        return
    for row in rank_layout.reshape(pp, -1).t().tolist():
        if row != sorted(row):
            raise ConfigError(
                f"places pipeline group {row} (stage order) out of increasing rank order; "
                "permute ranks so that each pipeline group's ranks increase from the first "
                "stage to the last", "parallel.placement")
