"""Pipeline parallelism: stages of one model replica on successive ranks.

Each pipeline rank builds the whole model on the meta device, deletes what its
stage(s) do not own, lets :func:`giantmodel.parallel.apply.parallelize_chunk`
apply tensor/sequence parallelism, recompute and data parallelism to each
stage, and only then materialises and initialises the weights. Parameter names
stay those of the single-process model, so checkpoints load under any layout.

Training runs one ``torch.distributed.pipelining`` schedule per optimizer step
over the trainer's micro-batches. The last stage's loss is the micro-batch's
token *sum* divided by the token count of the whole global batch (every
micro-batch of every data-parallel rank), and the schedule does not rescale
gradients, so the accumulated gradient is exactly that of the single-process
global token mean. Gradient reduction over dp/cp, ZeRO, the optimizer and
the global gradient norm are the SPMD engine's, applied to all local stages.

Evaluation runs forward only with plain send/recv between stages, so it does
not depend on the training schedule's micro-batch count. Tied embeddings are
two copies (first and last stage) whose gradients are summed every step.
Pipeline point-to-point traffic uses a group created with
``parallel.timeout_s``, so a stage waiting on a dead neighbour fails in time.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.models import build_model, init_weights
from giantmodel.models.registry import copy_full_into, full_init_tensor
from giantmodel.parallel.apply import loss_context, loss_fn, parallelize_chunk
from giantmodel.parallel.collectives import all_reduce_sum_
from giantmodel.core.tensors import local_tensor
from giantmodel.parallel.data import DataParallel
from giantmodel.parallel.grads import clip_grads_
from giantmodel.core.pipeline_split import stage_owner
from giantmodel.parallel.spmd import SPMDEngine
from giantmodel.core.precision import Precision


# ---------------------------------------------------------------- the model
def build_stage_module(model_cfg, layers: range, first: bool, last: bool) -> nn.Module:
    """The full model on the meta device, cut down to one stage."""
    model = build_model(model_cfg, device="meta")
    if not first:
        model.tok_embeddings = None
        model.pos_embeddings = None
        # Embedding dropout belongs to the first stage only; later stages get
        # hidden states that already went through it.
        model.embed_dropout = nn.Identity()
    if not last:
        model.norm = None
        model.output = None
    for i in range(model_cfg.num_layers):
        if i not in layers:
            del model.layers[str(i)]
    return model


def _schedule_class(name: str):
    from torch.distributed import pipelining as pl

    classes = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B,
               "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
               "zero_bubble": pl.ScheduleInterleavedZeroBubble,
               "zbv": pl.ScheduleZBVZeroBubble}
    if name not in classes:
        raise ValueError(f"unknown parallel.pp_schedule {name!r}; expected one of {sorted(classes)}")
    return classes[name]


# --------------------------------------------------------------- the engine
class PipelineEngine(SPMDEngine):
    """The :class:`~giantmodel.parallel.engine.Engine` contract for
    ``parallel.pp > 1``. ``parts`` holds this rank's stage modules in execution
    order. Gradient reduction over dp, ZeRO, the optimizer, clipping (global
    over every rank, stages included) and cp input sharding are those of the
    SPMD engine, applied to all local stages."""

    def __init__(self, cfg, dims: ParallelDims, device: torch.device):
        # SPMDEngine.__init__ builds a whole model; a stage builds only its part.
        self.cfg = cfg
        self.dims = dims
        self.device = device
        plan = dims.pipeline
        self.plan = plan
        self.n_micro = plan.n_micro
        self.schedule_name = plan.schedule
        self.virtual = plan.virtual
        self.num_stages = plan.num_stages
        self.pp_group = _pipeline_group(dims)
        self.pp_rank = dims.coordinate("pp")  # == rank in pp_group (check_pipeline_placement)
        self.layer_counts = list(plan.layer_counts)
        ranges = plan.layer_ranges()
        self.stage_ids = plan.stage_ids(self.pp_rank)
        self.parts: list[nn.Module] = []
        for sid in self.stage_ids:
            module = build_stage_module(cfg.model, ranges[sid], sid == 0,
                                        sid == self.num_stages - 1)
            module = parallelize_chunk(module, dims, cfg)
            init_weights(module, cfg.model, cfg.train.seed, device=device)
            self.parts.append(module)
        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids
        self._tie = _TiedEmbedding(self) if cfg.model.tie_embeddings else None
        self.data_parallel = DataParallel(dims, cfg)
        self._dp_group = dims.group("dp")
        self._dp_cp_group = dims.group("dp_cp")
        self._schedule = None
        self._step_tokens = 1.0
        self._precision: Precision | None = None

    # ------------------------------------------------------------- training
    def _get_schedule(self):
        """Built on first use: its first step infers the activation shapes."""
        if self._schedule is not None:
            return self._schedule
        from torch.distributed.pipelining import PipelineStage

        stages = [PipelineStage(part, sid, self.num_stages, self.device, group=self.pp_group,
                                get_mesh=self._mesh_by_names)
                  for part, sid in zip(self.parts, self.stage_ids)]
        cls = _schedule_class(self.schedule_name)
        # scale_grads=False: the loss is already divided by the global token count.
        multi = self.plan.multi_stage
        self._schedule = cls(stages if multi else stages[0], self.n_micro,
                             loss_fn=self._stage_loss, scale_grads=False)
        return self._schedule

    def _mesh_by_names(self, names: tuple[str, ...], layout=None):
        """Sub-mesh for a DTensor activation the pipeline received from a peer."""
        return self.dims.mesh[names[0] if len(names) == 1 else names]

    def _stage_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # The schedule calls this on the last stage once per micro-batch (and
        # once more while it infers shapes on the first step): no side effects.
        loss_sum, _ = loss_fn(logits, labels)
        return self._precision.scale_loss(loss_sum / self._step_tokens)

    def _step_inputs(self, microbatches: list[dict]) -> tuple[tuple, dict]:
        """Whole-step inputs for ``schedule.step``, which cuts them into
        ``n_micro`` equal micro-batches along dim 0 (the trainer's own ones
        unless ``parallel.pp_microbatches`` asks for another count; the loss
        is a token sum, so the cut does not change the result)."""
        sequences = sum(mb["input_ids"].shape[0] for mb in microbatches)
        if sequences % self.n_micro:
            raise ValueError(f"{sequences} sequences per step do not split into "
                             f"{self.n_micro} pipeline micro-batches")
        local = [self._local_inputs(mb) for mb in microbatches]
        args, kwargs = (), {}
        if self.has_first:
            args = (torch.cat([ids for ids, _, _ in local]),)
        if self.has_last:
            kwargs["target"] = torch.cat([labels for _, labels, _ in local])
        if self.dims.cp > 1:
            # Every stage needs the absolute positions of its sequence chunks
            # (RoPE / learned positions); [B, t] so they split with the batch.
            kwargs["positions"] = torch.cat([pos.expand(ids.shape[0], -1)
                                             for ids, _, pos in local])
        return args, kwargs

    def forward_backward(self, microbatches: list[dict], precision: Precision) -> float:
        for part in self.parts:
            part.train()
        self._precision = precision
        self._step_tokens = max(self._global_tokens(microbatches), 1.0)
        sched = self._get_schedule()
        args, kwargs = self._step_inputs(microbatches)
        losses: list[torch.Tensor] = []
        with loss_context(self.dims), precision.autocast():
            sched.step(*args, losses=losses, return_outputs=False, **kwargs)
        self.data_parallel.reduce_gradients(self.parts)
        if self._tie is not None:
            self._tie.sum_gradients()
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.has_last:
            total += sum(float(x.detach()) for x in losses) / precision.scale
        return self._reduce_loss(total)

    def _reduce_loss(self, local: torch.Tensor) -> float:
        """Last stage's share of the loss -> the global value on every rank."""
        all_reduce_sum_(local, self.pp_group)
        all_reduce_sum_(local, self._dp_cp_group)
        return float(local)

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def eval_loss(self, batches, precision: Precision) -> float:
        """Forward only, batch by batch, with plain send/recv between stages:
        independent of the training schedule's micro-batch count."""
        batches = list(batches)
        for part in self.parts:
            part.eval()
        tokens = self._global_tokens(batches)
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for mb in batches:
            ids, labels, positions = self._local_inputs(mb)
            with loss_context(self.dims):
                logits = self._forward_only(ids, positions, precision)
                if logits is not None:
                    total += float(loss_fn(logits, labels)[0])
        for part in self.parts:
            part.train()
        return self._reduce_loss(total) / max(tokens, 1.0)

    def _forward_only(self, ids: torch.Tensor, positions, precision: Precision):
        """Every local stage in global stage order; the logits on the rank
        that holds the last stage, else None."""
        by_stage = dict(zip(self.stage_ids, self.parts))
        pp, name = self.dims.pp, self.schedule_name
        h = None
        for sid in sorted(by_stage):
            if sid == 0:
                h = ids
            elif stage_owner(sid - 1, pp, name) != self.pp_rank:
                h = recv_activation(self._peer(sid - 1), self.pp_group, self.device,
                                    self._mesh_by_names)
            with precision.autocast():
                h = by_stage[sid](h, positions)
            if sid == self.num_stages - 1:
                return h
            if stage_owner(sid + 1, pp, name) != self.pp_rank:
                send_activation(h, self._peer(sid + 1), self.pp_group)
        return None

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global norm over every rank; a tied embedding counts once, as in
        the single-process model, though the first and last stage both hold it."""
        head = self._tie.head if self._tie is not None else None
        norm = clip_grads_([p for p in self.parameters() if p is not head], self.dims, max_norm)
        if head is not None and head.grad is not None and max_norm > 0 and math.isfinite(norm):
            coef = max_norm / (norm + 1e-6)  # the coefficient clip_grads_ applied to the rest
            if coef < 1.0:
                local_tensor(head.grad).mul_(coef)
        return norm

    def _peer(self, stage: int) -> int:
        """Global rank that runs ``stage`` in this rank's pipeline group."""
        local = stage_owner(stage, self.dims.pp, self.schedule_name)
        return dist.get_global_rank(self.pp_group, local)


# --------------------------------------------------------------- tied weights
class _TiedEmbedding:
    """``model.tie_embeddings`` across pipeline stages.

    The token embedding lives on the first stage and the output head on the
    last, as two copies of one matrix. Both start from the embedding's
    initial value; after every backward their gradients are summed (over a
    two-rank group, or locally when one rank holds both stages, as under
    ZBV), so identical AdamW updates keep the copies equal. Both copies are
    sharded alike (vocabulary rows over tp, dim 0 over FSDP), so local shards
    line up element for element.
    """

    def __init__(self, engine: PipelineEngine):
        self.embedding = self.head = None
        for part, sid in zip(engine.parts, engine.stage_ids):
            if sid == 0:
                self.embedding = part.tok_embeddings.weight
            if sid == engine.num_stages - 1:
                self.head = part.output.weight
        if self.head is not None:
            cfg = engine.cfg
            # Layout-independent init draws by name: give the head the
            # embedding's draw, as the single-process tied model has.
            copy_full_into(self.head, full_init_tensor("tok_embeddings.weight", self.head.shape,
                                                       cfg.model, cfg.train.seed))
        first = stage_owner(0, engine.dims.pp, engine.schedule_name)
        last = stage_owner(engine.num_stages - 1, engine.dims.pp, engine.schedule_name)
        self.same_rank = first == last
        self.group = None
        if not self.same_rank:
            pairs = [[row[first], row[last]] for row in _pipeline_groups(engine.dims)]
            # Every rank takes part in creating every pair's group.
            self.group, _ = dist.new_subgroups_by_enumeration(
                pairs, timeout=_group_timeout(engine.dims))

    def sum_gradients(self) -> None:
        held = [p for p in (self.embedding, self.head) if p is not None]
        mine = [p for p in held if p.grad is not None]
        if not held:  # a middle stage
            return
        if len(mine) != len(held):
            raise RuntimeError("tied embedding: a stage that holds a copy has no gradient for it")
        if self.same_rank:
            total = local_tensor(self.embedding.grad) + local_tensor(self.head.grad)
            local_tensor(self.embedding.grad).copy_(total)
            local_tensor(self.head.grad).copy_(total)
            return
        all_reduce_sum_(local_tensor(mine[0].grad), self.group)


def _pipeline_groups(dims) -> list[list[int]]:
    """Global ranks of every pipeline group, one row per group, by pp index."""
    layout = dims.mesh_layout()  # [pp, dp_replicate, dp_shard, cp, tp]
    return layout.reshape(dims.pp, -1).t().tolist()


def _group_timeout(dims) -> timedelta | None:
    timeout = getattr(dims, "timeout_s", None)
    return None if timeout is None else timedelta(seconds=timeout)


def _pipeline_group(dims):
    """This rank's pipeline group, created with ``parallel.timeout_s``.

    The mesh's own pp group gets its timeout only after creation, which gloo
    applies to collectives but not to point-to-point receives: a stage
    waiting on a dead neighbour would then hang for torch's default 30
    minutes. A group made with the timeout fails in time.
    """
    group, _ = dist.new_subgroups_by_enumeration(_pipeline_groups(dims),
                                                 timeout=_group_timeout(dims))
    return group


# ------------------------------------------------------------------ collectives
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]


def send_activation(t: torch.Tensor, dst: int, group) -> None:
    """Send a tensor of any shape (up to 5-D) and dtype: a header, then the
    data. A DTensor (a tensor-parallel activation) goes as its local shard
    plus its layout, which is small and only sent on the eval path."""
    is_dt = hasattr(t, "to_local")
    local = t.to_local() if is_dt else t
    header = torch.zeros(8, dtype=torch.int64)
    header[0], header[1], header[2] = local.dim(), _DTYPES.index(local.dtype), int(is_dt)
    header[3:3 + local.dim()] = torch.tensor(local.shape, dtype=torch.int64)
    dist.send(header.to(local.device), dst=dst, group=group)
    if is_dt:
        layout = (t.device_mesh.mesh_dim_names, tuple(t.placements), tuple(t.shape), t.stride())
        dist.send_object_list([layout], dst=dst, group=group, device=local.device)
    dist.send(local.contiguous(), dst=dst, group=group)


def recv_activation(src: int, group, device: torch.device, mesh_by_names) -> torch.Tensor:
    """Receive what :func:`send_activation` sent from global rank ``src``;
    ``mesh_by_names(names)`` resolves a DTensor's mesh."""
    header = torch.zeros(8, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    header = header.cpu()
    shape = tuple(int(x) for x in header[3:3 + int(header[0])])
    layout = None
    if int(header[2]):
        box: list = [None]
        dist.recv_object_list(box, src=src, group=group, device=device)
        layout = box[0]
    out = torch.empty(shape, dtype=_DTYPES[int(header[1])], device=device)
    dist.recv(out, src=src, group=group)
    if layout is None:
        return out
    from torch.distributed.tensor import DTensor

    names, placements, global_shape, stride = layout
    return DTensor.from_local(out, mesh_by_names(names), placements, run_check=False,
                              shape=torch.Size(global_shape), stride=stride)
