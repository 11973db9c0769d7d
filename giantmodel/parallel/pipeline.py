"""The pipeline step runner: stages of one model replica on successive ranks.

Each pipeline rank asks the objective for the stage(s) it runs
(:class:`~giantmodel.parallel.objective.StageSpec`, from the layout's
:class:`~giantmodel.core.pipeline_split.PipelinePlan`); parameter names stay
those of the single-process model, so checkpoints load under any layout.

Training runs one ``torch.distributed.pipelining`` schedule per optimizer step
over the trainer's micro-batches. The last stage's loss is the micro-batch's
loss *sum* divided by the loss units of the whole global batch (every
micro-batch of every data-parallel rank), and the schedule does not rescale
gradients, so the accumulated gradient is exactly that of the single-process
global mean. The data-parallel strategy then sums gradients over dp x cp for
all local stages.

Evaluation runs forward only with plain send/recv between stages, so it does
not depend on the training schedule's micro-batch count. Weights an objective
shares between the first and the last stage (tied embeddings) are two copies
whose gradients are summed every step. Pipeline point-to-point traffic uses
a group created with ``parallel.timeout_s``, so a stage waiting on a dead
neighbour fails in time.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining as pl
from torch.distributed.tensor import DTensor

from giantmodel.core import compat
from giantmodel.core.precision import Precision
from giantmodel.core.tensors import local_tensor
from giantmodel.models.common.moe import moe_layers, set_aux_loss_factor
from giantmodel.models.registry import canonical_name
from giantmodel.parallel.collectives import all_reduce_sum_, sum_scalar
from giantmodel.parallel.objective import Objective, StageSpec
from giantmodel.parallel.strategy import align_grad_placements

_SCHEDULES = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B,
              "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
              "zero_bubble": pl.ScheduleInterleavedZeroBubble,
              "zbv": pl.ScheduleZBVZeroBubble}


class PipelineRunner:
    """Runs ``parallel.pp > 1``. ``parts`` are this rank's stage modules in
    execution order."""

    def __init__(self, objective: Objective, dims, device: torch.device, strategy):
        self.objective = objective
        self.dims = dims
        self.device = device
        self.strategy = strategy
        self.plan = dims.pipeline
        self.pp_group = _pipeline_group(dims)
        self.pp_rank = dims.coordinate("pp")  # == rank in pp_group (check_pipeline_placement)
        self.stage_ids = self.plan.stage_ids(self.pp_rank)
        self.dp_group = dims.group("dp")
        self.dp_cp_group = dims.group("dp_cp")
        self.parts: list[nn.Module] = []
        self.tied: list[_TiedPair] = []
        self._schedule = None
        self._units = 1.0
        self._precision: Precision | None = None
        self._in_schedule = False

    def stage_specs(self) -> list[StageSpec]:
        ranges = self.plan.layer_ranges()
        return [StageSpec(index=s, num_stages=self.plan.num_stages, layers=ranges[s])
                for s in self.stage_ids]

    def attach(self, parts: list[nn.Module]) -> None:
        self.parts = parts
        self.tied = [_TiedPair(self, first, last) for first, last in self.objective.tied_parameters()]

    # ------------------------------------------------------------- training
    def _get_schedule(self):
        """Built on first use: its first step infers the activation shapes."""
        if self._schedule is not None:
            return self._schedule
        stages = [compat.pipeline_stage(part, sid, self.plan.num_stages, self.device,
                                        group=self.pp_group, get_mesh=self._mesh_by_names)
                  for part, sid in zip(self.parts, self.stage_ids)]
        if not compat.has("pipeline_get_mesh"):
            # That pipelining sends only plain tensors: a DTensor activation
            # (sequence parallel) fails here with a message, not inside torch.
            for part, sid in zip(self.parts, self.stage_ids):
                if sid < self.plan.num_stages - 1:
                    part.register_forward_hook(self._check_sendable)
        for part in self.parts:
            _forget_first_moe_forward(part)
        cls = _SCHEDULES[self.plan.schedule]
        # scale_grads=False: the loss is already divided by the global loss units.
        self._schedule = cls(stages if self.plan.multi_stage else stages[0], self.plan.n_micro,
                             loss_fn=self._stage_loss, scale_grads=False)
        return self._schedule

    def _check_sendable(self, module, args, output) -> None:
        if self._in_schedule:  # eval's own send/recv carries DTensors
            compat.check_plain_activation(output)

    def _mesh_by_names(self, names: tuple[str, ...], layout=None):
        """Sub-mesh for a DTensor activation the pipeline received from a peer."""
        return self.dims.mesh[names[0] if len(names) == 1 else names]

    def _stage_loss(self, output: torch.Tensor, target) -> torch.Tensor:
        # The schedule calls this on the last stage once per micro-batch (and
        # once more while it infers shapes on the first step): no side effects.
        loss_sum = self.objective.stage_loss(output, target)
        return self._precision.scale_loss(loss_sum / self._units)

    def global_units(self, microbatches: list[dict]) -> float:
        local = sum(self.objective.loss_units(mb) for mb in microbatches)
        return max(sum_scalar(local, self.dp_group, self.device), 1.0)

    def _step_inputs(self, microbatches: list[dict]) -> tuple[tuple, dict]:
        """Whole-step inputs for ``schedule.step``, which cuts them into
        ``n_micro`` equal micro-batches along dim 0 (the trainer's own ones
        unless ``parallel.pp_microbatches`` asks for another count; the loss
        is a sum, so the cut does not change the result)."""
        sequences = sum(next(iter(mb.values())).shape[0] for mb in microbatches)
        if sequences % self.plan.n_micro:
            raise ValueError(f"{sequences} samples per step do not split into "
                             f"{self.plan.n_micro} pipeline micro-batches")
        pieces = [self.objective.stage_inputs(mb) for mb in microbatches]
        args, kwargs = (), {}
        if 0 in self.stage_ids:
            args = tuple(self._on_device(torch.cat(xs)) for xs in zip(*(a for a, _, _ in pieces)))
        for key in pieces[0][1]:
            kwargs[key] = self._on_device(torch.cat([kw[key] for _, kw, _ in pieces]))
        if self.plan.num_stages - 1 in self.stage_ids:
            kwargs["target"] = self._on_device(torch.cat([t for _, _, t in pieces]))
        return args, kwargs

    def _on_device(self, x):
        """Loader batches are host tensors; stage 0's embedding and the last
        stage's loss run on this rank's device (the schedule moves only the
        activations it sends between stages)."""
        if isinstance(x, torch.Tensor):
            return x.to(self.device, non_blocking=True)
        if isinstance(x, tuple | list):
            return type(x)(self._on_device(v) for v in x)
        if isinstance(x, dict):
            return {k: self._on_device(v) for k, v in x.items()}
        return x

    def forward_backward(self, microbatches: list[dict], precision: Precision) -> float:
        for part in self.parts:
            part.train()
        self._precision = precision
        self._units = self.global_units(microbatches)
        for part in self.parts:
            # MoE auxiliary losses back-propagate within each stage, with the
            # gradient the loss gives one unit (MoE's AuxLossScaler).
            set_aux_loss_factor(part, precision.scale / self._units)
        sched = self._get_schedule()
        args, kwargs = self._step_inputs(microbatches)
        losses: list[torch.Tensor] = []
        self._in_schedule = True
        try:
            with self.objective.loss_context(), precision.autocast():
                sched.step(*args, losses=losses, return_outputs=False, **kwargs)
        finally:
            self._in_schedule = False
        # Before the data-parallel sum, which only ever adds: the copies'
        # local gradients are summed first, whichever rank owns them later,
        # once both are in their parameters' placements.
        if self.tied:
            align_grad_placements(self.parts)
        for pair in self.tied:
            pair.sum_gradients()
        self.strategy.finish()
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        if losses:
            total += sum(float(x.detach()) for x in losses) / precision.scale
        return self._reduce_loss(total)

    def _reduce_loss(self, local: torch.Tensor) -> float:
        """Last stage's share of the loss -> the global value on every rank."""
        all_reduce_sum_(local, self.pp_group)
        all_reduce_sum_(local, self.dp_cp_group)
        return float(local)

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def eval_loss(self, batches, precision: Precision) -> float:
        """Forward only, batch by batch, with plain send/recv between stages:
        independent of the training schedule's micro-batch count."""
        batches = list(batches)
        for part in self.parts:
            part.eval()
        units = self.global_units(batches)
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for mb in batches:
            args, kwargs, target = self._on_device(self.objective.stage_inputs(mb))
            with self.objective.loss_context():
                out = self._forward_only(args, kwargs, precision)
                if out is not None:
                    total += float(self.objective.stage_loss(out, target))
        for part in self.parts:
            part.train()
        return self._reduce_loss(total) / units

    def _forward_only(self, args: tuple, kwargs: dict, precision: Precision):
        """Every local stage in global stage order; the last stage's output
        on the rank that holds it, else None."""
        by_stage = dict(zip(self.stage_ids, self.parts))
        h = None
        for sid in sorted(by_stage):
            inputs = args
            if sid > 0:
                if self.plan.owner(sid - 1) != self.pp_rank:
                    h = recv_activation(self._peer(sid - 1), self.pp_group, self.device,
                                        self._mesh_by_names)
                inputs = (h,)
            with precision.autocast():
                h = by_stage[sid](*inputs, **kwargs)
            if sid == self.plan.num_stages - 1:
                return h
            if self.plan.owner(sid + 1) != self.pp_rank:
                send_activation(h, self._peer(sid + 1), self.pp_group)
        return None

    # -------------------------------------------------------------- clipping
    def norm_filter(self, terms: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
        """A tied weight counts once, as in the single-process model, though
        the first and the last stage both hold a copy: the last stage's copy
        is left out of the norm (and clipped with the coefficient after)."""
        skip = {local_tensor(p.grad).data_ptr() for pair in self.tied
                for p in pair.second_copies() if p.grad is not None}
        return [(t, c) for t, c in terms if t.data_ptr() not in skip] if skip else terms

    @torch.no_grad()
    def after_clip(self, coefficient: float) -> None:
        if coefficient < 1.0:
            for pair in self.tied:
                for p in pair.second_copies():
                    if p.grad is not None:
                        local_tensor(p.grad).mul_(coefficient)

    def _peer(self, stage: int) -> int:
        """Global rank that runs ``stage`` in this rank's pipeline group."""
        return dist.get_global_rank(self.pp_group, self.plan.owner(stage))


# --------------------------------------------------------------- tied weights
class _TiedPair:
    """One weight shared between the first stage (``first``, a canonical
    name) and the last (``second``), as two copies of one matrix.

    Both start from the same initial value (the objective initialises the
    second copy with the first one's draw); after every backward their
    gradients are summed (over a two-rank group, or locally when one rank
    holds both stages, as under ZBV), so identical AdamW updates keep the
    copies equal. Both copies are sharded alike (tp rows, FSDP dim 0), so
    local shards line up element for element.
    """

    def __init__(self, runner: PipelineRunner, first: str, second: str):
        self.first = self.second = None
        for part in runner.parts:
            named = {canonical_name(n): p for n, p in part.named_parameters(remove_duplicate=False)}
            if self.first is None:
                self.first = named.get(first)
            if self.second is None:
                self.second = named.get(second)
        plan = runner.plan
        first_rank, last_rank = plan.owner(0), plan.owner(plan.num_stages - 1)
        self.same_rank = first_rank == last_rank
        self.group = None
        if not self.same_rank:
            pairs = [[row[first_rank], row[last_rank]] for row in _pipeline_groups(runner.dims)]
            # Every rank takes part in creating every pair's group.
            self.group, _ = dist.new_subgroups_by_enumeration(
                pairs, timeout=_group_timeout(runner.dims))

    def second_copies(self) -> list[torch.Tensor]:
        return [self.second] if self.second is not None and self.second is not self.first else []

    @torch.no_grad()
    def sum_gradients(self) -> None:
        held = [p for p in (self.first, self.second) if p is not None]
        if not held:  # a middle stage
            return
        if any(p.grad is None for p in held):
            raise RuntimeError("tied weights: a stage that holds a copy has no gradient for it")
        if self.same_rank:
            a, b = local_tensor(self.first.grad), local_tensor(self.second.grad)
            a.add_(b)
            b.copy_(a)
            return
        all_reduce_sum_(local_tensor(held[0].grad), self.group)


def _pipeline_groups(dims) -> list[list[int]]:
    """Global ranks of every pipeline group, one row per group, by pp index."""
    layout = dims.mesh_layout()  # [pp, dp_replicate, dp_shard, cp, tp]
    return layout.reshape(dims.pp, -1).t().tolist()


def _group_timeout(dims) -> timedelta | None:
    return None if dims.timeout_s is None else timedelta(seconds=dims.timeout_s)


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
    is_dt = isinstance(t, DTensor)
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
    names, placements, global_shape, stride = layout
    return DTensor.from_local(out, mesh_by_names(names), placements, run_check=False,
                              shape=torch.Size(global_shape), stride=stride)


def _forget_first_moe_forward(part: nn.Module) -> None:
    """The schedule's first step infers activation shapes with one extra
    forward of each stage before its first micro-batch (past the first
    stage, on empty tensors). MoE layers would count its routing in the
    step's expert loads (and so in the bias update): drop what that forward
    recorded, once."""
    layers = moe_layers(part)
    if not layers:
        return

    def forget(module, args, output) -> None:
        for layer in layers:
            layer.stats.zero_()
            layer.take_aux_loss()
        handle.remove()

    handle = part.register_forward_hook(forget)
