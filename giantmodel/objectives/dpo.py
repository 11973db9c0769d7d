"""The preference objective (``objective: dpo``): DPO and its relatives.

The model, its parallel plans and what trains are the LM objective's
(full fine-tuning) or the LoRA objective's (``dpo.use_lora``); this class
wraps one of them and changes the loss. A micro-batch holds pair rows
(:mod:`giantmodel.data.preference`): the chosen and the rejected answers of
each pair are adjacent rows, so one forward scores both, and document ids
say which pair each token belongs to (several pairs share a row when
packed).

A sequence's log-prob is the sum of its answer tokens' log-probs. Under
tensor parallelism the head is vocabulary-parallel and each token's
log-softmax is reduced across the shards (``loss_parallel``), so every tp
rank holds the same sums; under pipeline parallelism the pair's two rows
travel through the stages together (a micro-batch is whole pair rows) and
the last stage scores them. The loss is a sum over pairs, and the engine
divides it by the global pair count (``loss_units``): the mean over every
pair of the global batch, on any layout.

The reference policy is:

* with LoRA, the same model with its adapters switched off
  (:func:`giantmodel.models.lora.adapters_off`): no second copy;
* with full fine-tuning, a frozen copy built, tensor-parallel sharded,
  FSDP-sharded over the policy's mesh (ZeRO-3 / HSDP; not yet together with
  tp, where each dp rank holds its tp share whole) and initialised like the
  policy, then loaded from ``checkpoint.init_from`` by the objective itself
  (so a resumed run, whose policy comes from its checkpoint, still gets the
  initial weights as its reference);
* with ``dpo.precompute_ref``, either of them run in one pass over every
  training and validation pair at setup, as soon as both the loaders and
  the reference's weights exist (:meth:`DPO.build_loaders` or
  :meth:`DPO.load_pretrained`, whichever comes last;
  :mod:`giantmodel.objectives.dpo_ref`), its table saved in ``run.dir``
  for a resumed run; training then runs no reference forward.

Under pipeline parallelism the reference runs as a forward-only walk of
the pipeline before each micro-batch's schedule step, and its log-probs
reach the last stage's loss inside the micro-batch's target
(:mod:`giantmodel.objectives.dpo_pipeline`); with ``dpo.precompute_ref``
they come from the table instead.

Outside pipelines, each micro-batch's trailing padding columns are cut
before the forwards (:meth:`DPO._trimmed`): pair rows are padded to
``train.seq_len``, and the columns past the longest sequence only cost time.

SimPO and ORPO need no reference. Metrics, named as TRL names them
(``rewards/chosen`` ...), are kept as sums over the step's pairs and reduced
over all ranks in :meth:`DPO.step_metrics`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from giantmodel.checkpoint import load_model_weights
from giantmodel.config.dpo import REFERENCE_FREE, DPOConfig
from giantmodel.config.errors import ConfigError
from giantmodel.config.schema import JobConfig
from giantmodel.core.loss import IGNORE_INDEX
from giantmodel.core.precision import Precision
from giantmodel.data import build_tokenizer
from giantmodel.data.loader import TrainLoader, ValLoader, check_batch_layout, rows_to_batch
from giantmodel.data.preference import (
    PairSamples,
    Truncation,
    build_preference_rows,
    preference_records,
)
from giantmodel.data.preference_builtin import tiny_preferences
from giantmodel.data.samples import BlendedSamples
from giantmodel.data.sft import check_sft, prepare_sft, sft_template, sft_tokenizer_path
from giantmodel.models.lora import adapters_off
from giantmodel.objectives.dpo_loss import metric_means, metric_sums, preference_loss
from giantmodel.objectives.dpo_pipeline import StageWalk, pack_reference, unpack_reference
from giantmodel.objectives.dpo_ref import RefTable, all_pair_rows, load_or_build
from giantmodel.objectives.lm import LanguageModel
from giantmodel.objectives.lora import LoRA
from giantmodel.parallel.collectives import all_reduce_sum_
from giantmodel.parallel.fsdp import _mixed_precision  # the policy's, for the sharded copy
from giantmodel.parallel.objective import BaseObjective, StageSpec
from giantmodel.parallel.tensor import apply_tensor_parallel

log = logging.getLogger(__name__)


class DPO(BaseObjective):
    name = "dpo"
    supports = frozenset({"tp", "pp"})

    def __init__(self, inner: LanguageModel, dpo: DPOConfig, run_dir: str | None = None, *,
                 init_from: str | None = None, precision: str = "fp32"):
        self.inner = inner
        self.cfg = dpo
        self.uses_lora = isinstance(inner, LoRA)
        self.needs_reference = dpo.loss_type not in REFERENCE_FREE
        # Full fine-tuning: each policy part's frozen twin, by id of the part.
        self._refs: dict[int, nn.Module] = {}
        self.run_dir = run_dir  # where precompute_ref's table is kept
        self._ref_rows: list[np.ndarray] = []  # precompute_ref: the pair rows to score
        self._ref_layout = (0, 1)  # (dp rank, dp size) of this rank's loaders
        self.ref_table: RefTable | None = None
        self.ref_forwards = 0  # reference forwards run so far (the pass's included)
        self._sums: torch.Tensor | None = None  # metric_sums over this step's pairs
        # Pipelines: (rows, metric_sums) of each loss call this step, and the
        # rows the step's micro-batches hold (see _step_sums).
        self._stage_calls: list[tuple[int, torch.Tensor]] = []
        self._step_rows = 0
        self.init_from = init_from  # the reference's weights (None: the initial draw)
        # The reference forward outside the engine's loss (the precompute pass,
        # the pipeline walk) runs under the autocast the policy's loss runs in,
        # so the first step's rewards are exactly zero.
        self._precision = "bf16" if precision == "fp8" else precision
        self._stages: dict[int, tuple[StageSpec, nn.Module]] = {}  # id(part) -> its stage
        self._tp_mesh = None
        self._walk: StageWalk | None = None  # pipeline parallelism: the reference's walk
        self._ref_loaded = False  # full fine-tuning: the frozen copy holds init_from
        self._base_loaded = False  # LoRA: load_pretrained filled the base
        self._warned_tp_copy = False

    @classmethod
    def from_config(cls, cfg: JobConfig) -> DPO:
        """Pre-flight: the layout, the tokenizer beside the initial weights,
        and every record of every file (a bad one fails naming its line)."""
        cfg.dpo.validate(cfg.train.seq_len)
        p = cfg.parallel
        if p.cp > 1:
            raise ConfigError("preference pairs are scored whole on each rank; set "
                              "parallel.cp=1", "parallel.cp")
        if cfg.train.micro_batch_size < 1:
            raise ConfigError("must be at least 1 pair row", "train.micro_batch_size")
        inner_cls = LoRA if cfg.dpo.use_lora else LanguageModel
        prepare_sft(cfg)  # builtin:NAME in init_from becomes its directory
        cfg.data.tokenizer = sft_tokenizer_path(cfg.data, cfg.checkpoint.init_from)
        # The chat template exists (the files are pairs, not SFT records: checked next).
        check_sft(dataclasses.replace(cfg.data, paths=[], valid_paths=[]))
        preference_records(cfg.data, tiny_preferences)  # every record parses
        inner = inner_cls.from_config(cfg)
        return cls(inner, cfg.dpo, cfg.run.dir, init_from=cfg.checkpoint.init_from,
                   precision=cfg.precision)

    # ------------------------------------------------------------ the model
    def build(self, stage: StageSpec) -> nn.Module:
        module = self.inner.build(stage)
        if any(spec.index == stage.index for spec, _ in self._stages.values()):
            # A second engine from this objective (a rebuild): forget the first's parts.
            self._stages.clear()
            self._refs.clear()
        self._stages[id(module)] = (stage, module)
        if self.needs_reference and not self.uses_lora:
            ref = self.inner.build(stage)
            ref.requires_grad_(False)
            self._refs[id(module)] = ref
        return module

    def blocks(self, module: nn.Module) -> list[str]:
        return self.inner.blocks(module)

    def edge_units(self, module: nn.Module) -> list[list[nn.Module]]:
        return self.inner.edge_units(module)

    def apply_tensor_parallel(self, module: nn.Module, tp_mesh, *, sp: bool) -> None:
        self.inner.apply_tensor_parallel(module, tp_mesh, sp=sp)
        self._tp_mesh = tp_mesh
        ref = self._refs.get(id(module))
        if ref is not None:
            apply_tensor_parallel(ref, tp_mesh, sp)

    def init_weights(self, module: nn.Module, device: torch.device) -> None:
        self.inner.init_weights(module, device)
        ref = self._refs.get(id(module))
        if ref is not None:
            self._shard_like(module, ref)
            # The same layout-independent draw as the policy: equal weights.
            self.inner.init_weights(ref, device)
            ref.requires_grad_(False)
            ref.eval()

    def _shard_like(self, policy: nn.Module, ref: nn.Module) -> None:
        """Under FSDP (ZeRO-3, HSDP; ZeRO-1/2 where they use it) the frozen
        copy, still on the meta device, is sharded over the policy's mesh in
        the same units (blocks, edge units, root), with the policy's
        mixed-precision policy so both compute alike, and resharded after
        every forward (it has no backward to wait for): each rank holds its
        shard, not a whole copy. With tensor parallelism too, the policy's
        parameters live on the combined (dp, tp) mesh, and the copy keeps
        its tp shards only: a warning says so once."""
        if not isinstance(policy, FSDPModule):
            return
        if self._tp_mesh is not None:
            if not self._warned_tp_copy:  # once, not per pipeline stage
                self._warned_tp_copy = True
                log.warning("dpo: with tensor parallelism and FSDP the frozen reference copy "
                            "is tensor-parallel sharded only (each dp rank holds its tp share "
                            "whole); dpo.use_lora avoids the copy")
            return
        mesh = next(p.device_mesh for p in policy.parameters() if isinstance(p, DTensor))
        kw = {"mesh": mesh, "mp_policy": _mixed_precision(self._precision),
              "reshard_after_forward": True}
        for name in self.inner.blocks(ref):
            fully_shard(ref.get_submodule(name), **kw)
        for unit in self.inner.edge_units(ref):
            if unit:
                fully_shard(unit, **kw)
        fully_shard(ref, **kw)

    def tied_parameters(self) -> list[tuple[str, str]]:
        return self.inner.tied_parameters()

    def load_pretrained(self, parts: list[nn.Module], path: str | Path) -> Path:
        """The policy from ``path`` (LoRA: the base); the frozen copy from
        ``checkpoint.init_from`` if not yet. Collective, on every rank."""
        out = self.inner.load_pretrained(parts, path)
        self._base_loaded = True
        self._load_reference(self.init_from or path)
        self._precompute_when_ready()
        return out

    def _load_reference(self, path: str | Path | None) -> None:
        """Full fine-tuning: every frozen copy from ``path`` (the run's
        ``checkpoint.init_from``), once: a resumed run restores its policy
        from its checkpoint and never loads ``init_from`` for it, so
        build_loaders loads the copy. Collective, on every rank."""
        if self._ref_loaded or not self._refs or not path:
            return
        self._ref_loaded = True
        load_model_weights(list(self._refs.values()), path)

    def _reference_ready(self) -> bool:
        """Whether the reference holds its final weights: the frozen copy
        once loaded, the LoRA base once ``load_pretrained`` ran; without
        ``init_from``, the initial draw."""
        if self.uses_lora:
            return self._base_loaded or not self.init_from
        return self._ref_loaded or not self.init_from

    def checkpoint_filter(self):
        return self.inner.checkpoint_filter()

    def loss_context(self) -> contextlib.AbstractContextManager:
        return self.inner.loss_context()

    def model_name(self) -> str:
        return self.inner.model_name()

    def num_params(self) -> int:
        return self.inner.num_params()

    def step_units(self) -> tuple[str, int]:
        # Both rows of every pair row are trained on.
        t = self.inner.train_cfg
        return "tokens", 2 * t.global_batch_size * t.seq_len

    def flops_per_unit(self) -> float:
        return self.inner.flops_per_unit()

    # ------------------------------------------------------------- the loss
    def loss_units(self, batch: dict) -> int:
        return int(_pair_slots(batch["labels"], batch["document_ids"])[2].sum())

    def _model_inputs(self, batch: dict, device: torch.device) -> tuple[torch.Tensor, dict]:
        """Token ids and, for packed pair rows only, positions and document
        ids (unpacked rows hold one sequence and padding after it, which
        causal attention never lets the sequence see)."""
        ids = batch["input_ids"].to(device)
        if not self.inner.data_cfg.pack:
            return ids, {}
        return ids, {"positions": batch["position_ids"].to(device),
                     "document_ids": batch["document_ids"].to(device)}

    def _trimmed(self, batch: dict, device: torch.device) -> dict:
        """The micro-batch without its trailing all-padding columns. Pair rows
        are padded to ``train.seq_len``; TRL pads each batch to its longest
        sequence. Causal attention never lets a token see a later one, so the
        kept columns' log-probs are unchanged, and the forwards, backward and
        reference cost what the real tokens need (about half the columns of
        the tiny preference set). The width is a multiple of the tensor-
        parallel degree (sequence parallelism shards it), and on an
        accelerator of 8 too (aligned GEMMs, few distinct shapes for the
        allocator and compiled graphs); on the CPU rounding up buys nothing
        and costs ~7% a step on the tiny set. Not under pipeline
        parallelism, whose stages exchange fixed shapes."""
        labels, docs = batch["labels"], batch["document_ids"]
        used = ((docs >= 0) | (labels != IGNORE_INDEX)).any(0)
        T = labels.shape[1]
        last = int(used.nonzero().max()) + 1 if bool(used.any()) else 1
        step = (1 if device.type == "cpu" else 8) * (
            self._tp_mesh.size() if self._tp_mesh is not None else 1)
        width = min(T, -(-last // step) * step)
        if width == T:
            return batch
        return {k: v[:, :width] if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == T else v
                for k, v in batch.items()}

    def loss(self, module: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        device = _device_of(module)
        cut = self._trimmed(batch, device)
        ids, kwargs = self._model_inputs(cut, device)
        labels, docs = cut["labels"].to(device), cut["document_ids"].to(device)
        policy, counts, valid = sequence_logps(module(ids, **kwargs), labels, docs)
        reference = None
        if self.needs_reference and self.cfg.precompute_ref:
            reference = self._table().lookup(batch, device)  # keyed by the whole rows
        elif self.needs_reference:
            reference = self._reference(module, ids, kwargs, labels, docs)
        return self._pair_loss(policy, counts, valid, reference)

    def _pair_loss(self, policy, counts, valid, reference, rows: int | None = None):
        """``rows``: the micro-batch's row count under a pipeline schedule."""
        keep = valid.nonzero().squeeze(1)
        policy, counts = policy[:, keep], counts[:, keep]
        reference = None if reference is None else reference[:, keep]
        losses, rc, rr, lc, lr = preference_loss(self.cfg, policy, counts, reference)
        if torch.is_grad_enabled() and not policy.is_meta:  # training, not eval
            sums = metric_sums(rc, rr, lc, lr)
            if rows is not None:
                self._stage_calls.append((rows, sums))
            else:
                self._sums = sums if self._sums is None else self._sums + sums
        return losses.sum(), torch.tensor(float(keep.numel()), device=policy.device)

    @torch.no_grad()
    def _reference(self, module, ids, kwargs, labels, docs) -> torch.Tensor:
        self.ref_forwards += 1
        return sequence_logps(self._reference_forward(module, ids, kwargs), labels, docs)[0]

    def _reference_forward(self, module: nn.Module, h: torch.Tensor, kwargs: dict):
        """The reference's output for one model part (the whole model, or a
        stage) on ``h`` (ids, or the previous stage's activation)."""
        if self.uses_lora:
            with adapters_off(module):
                return module(h, **kwargs)
        ref = self._refs[id(module)]
        out = ref(h, **kwargs)
        if isinstance(ref, FSDPModule):
            ref.reshard()  # FSDP2 keeps a root gathered after forward, for a backward
        return out

    def _table(self) -> RefTable:
        if self.ref_table is None:
            raise RuntimeError("dpo.precompute_ref: the reference table is built at setup, once "
                               "build_loaders has run and the weights are loaded "
                               "(load_pretrained, when checkpoint.init_from is set)")
        return self.ref_table

    def _precompute_when_ready(self) -> None:
        """``dpo.precompute_ref``'s pass, at setup: as soon as the pair rows
        are known and the reference holds its final weights (build_loaders
        and load_pretrained may come in either order; both call this on
        every rank, so the collective pass starts everywhere at once)."""
        if (not self.cfg.precompute_ref or not self.needs_reference
                or self.ref_table is not None or not self._ref_rows
                or not self._reference_ready()):
            return
        device = self._device()

        def score(batch: dict) -> torch.Tensor | None:
            with self._reference_context(device):
                return self._reference_sums(batch, device)

        dp_rank, dp_size = self._ref_layout
        self.ref_table, _ = load_or_build(score, all_pair_rows(self._ref_rows),
                                          self.inner.train_cfg.micro_batch_size, dp_rank,
                                          dp_size, device, self.run_dir)
        # FSDP2 keeps a root unit gathered after a forward, expecting a
        # backward to reshard it: left so, module.parameters() would give an
        # optimizer built after this pass the gathered copies, not the shards.
        for _, module in self._stages.values():
            for m in module.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def _reference_context(self, device: torch.device) -> contextlib.ExitStack:
        """What the engine's loss runs under: the loss context (the vocab-
        parallel log-softmax) and the run's autocast."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.loss_context())
        stack.enter_context(Precision(self._precision, device.type).autocast())
        return stack

    @torch.no_grad()
    def _reference_sums(self, batch: dict, device: torch.device) -> torch.Tensor | None:
        """Reference sums ``[2, pair rows * D]`` of a batch of pair rows: one
        forward of the whole model, or a walk of the pipeline (None on a rank
        without the last stage)."""
        if self._walk is None:
            batch = self._trimmed(batch, device)
        ids, kwargs = self._model_inputs(batch, device)
        labels, docs = batch["labels"].to(device), batch["document_ids"].to(device)
        if self._walk is None:
            return self._reference(next(iter(self._stages.values()))[1], ids, kwargs, labels,
                                   docs)
        self.ref_forwards += 1
        out = self._walk.forward(ids, kwargs, self._reference_forward, device)
        return None if out is None else sequence_logps(out, labels, docs)[0]

    def _step_sums(self) -> torch.Tensor:
        """The metric sums of the schedule's real loss calls this step.
        torch's schedules may call the loss once more before a first step's
        micro-batches (metadata inference; torch 2.13 does, on an empty
        activation and micro-batch 0's target): the real calls are the last
        ones, which together hold the step's rows."""
        calls, self._stage_calls = self._stage_calls, []
        total, rows = None, 0
        for n, sums in reversed(calls):
            if rows >= self._step_rows:
                break
            rows += n
            total = sums if total is None else total + sums
        return total

    def _device(self) -> torch.device:
        return _device_of(next(iter(self._stages.values()))[1])

    def step_metrics(self) -> dict[str, float]:
        """This step's ``rewards/*`` and ``logps/*`` means over the global
        batch's pairs; resets. Collective: every rank calls it after every
        step (tp copies count each pair equally often, so means are exact)."""
        self._sums = self._step_sums() if self._stage_calls else self._sums
        sums = self._sums if self._sums is not None else torch.zeros(7, dtype=torch.float64)
        self._sums, self._step_rows = None, 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            # A rank that scored no pair (a pipeline stage before the last)
            # holds host zeros; NCCL-backed groups reduce device tensors only.
            if sums.device.type == "cpu" and torch.cuda.is_available() and \
                    dist.get_backend() != "gloo":
                sums = sums.to(torch.device("cuda", torch.cuda.current_device()))
            sums = all_reduce_sum_(sums, dist.group.WORLD)
        return metric_means(sums.cpu())

    # ------------------------------------------------------------ pipelines
    def stage_inputs(self, batch: dict) -> tuple[tuple, dict, torch.Tensor]:
        """Called on every pipeline rank for each micro-batch, before the
        schedule runs it: the reference (the table's, or the pipeline walk's,
        a collective) joins the target, ``[rows, 3, T]`` int64: labels,
        document ids and the reference sums' float64 bits
        (:func:`pack_reference`), all cut by rows with the micro-batch, so
        a pair row's two rows and its reference stay together."""
        device = batch["input_ids"].device
        ids, kwargs = self._model_inputs(batch, device)
        if torch.is_grad_enabled():  # a training step's micro-batch, not evaluation's
            self._step_rows += batch["labels"].shape[0]
        channels = [batch["labels"], batch["document_ids"]]
        if self.needs_reference:
            rows, T = batch["labels"].shape
            reference = self._pipeline_reference(batch)
            channels.append(torch.zeros(rows, T, dtype=torch.int64) if reference is None
                            else pack_reference(reference.cpu(), rows, T))
        target = torch.stack([c.to(device) for c in channels], dim=1)
        return (ids,), kwargs, target

    def _pipeline_reference(self, batch: dict) -> torch.Tensor | None:
        """``[2, pair rows * D]`` on a rank holding the last stage, else None."""
        walk = self._pipeline_walk()
        device = self._device()
        if self.cfg.precompute_ref:
            return self._table().lookup(batch, device) if walk.has_last else None
        with self._reference_context(device):
            return self._reference_sums(batch, device)

    def _pipeline_walk(self) -> StageWalk:
        if self._walk is None:
            raise RuntimeError("dpo under pipeline parallelism: build_loaders must run before "
                               "the first step (it finds the pipeline's ranks)")
        return self._walk

    def stage_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, docs = target[:, 0], target[:, 1]
        if labels.shape[0] % 2:
            raise RuntimeError(f"a pipeline micro-batch of {labels.shape[0]} rows splits a pair "
                               "(chosen and rejected rows travel together)")
        policy, counts, valid = sequence_logps(output, labels, docs)
        reference = None
        if self.needs_reference:
            D = policy.shape[1] // max(labels.shape[0] // 2, 1)
            reference = unpack_reference(target[:, 2], D).to(policy.device)
        return self._pair_loss(policy, counts, valid, reference, rows=labels.shape[0])[0]

    # ------------------------------------------------------- around training
    def build_loaders(self, *, dp_rank: int, dp_size: int):
        d, t = self.inner.data_cfg, self.inner.train_cfg
        check_batch_layout(t.global_batch_size, t.micro_batch_size, dp_size)
        tokenizer = build_tokenizer(d)
        template = sft_template(d, tokenizer, d.tokenizer)
        trunc = Truncation(self.cfg.resolved_max_length(t.seq_len), self.cfg.max_prompt_length,
                           self.cfg.max_completion_length, self.cfg.truncation_mode)
        train_recs, valid_recs = preference_records(d, tiny_preferences)
        train = build_preference_rows(train_recs, tokenizer, template, t.seq_len, d.pack, trunc,
                                      "train")
        samples = PairSamples(BlendedSamples([train], None, seed=t.seed, shuffle=True))
        self._ref_rows, self._ref_layout = [train.rows], (dp_rank, dp_size)
        tl = TrainLoader(samples, global_batch_size=t.global_batch_size,
                         micro_batch_size=t.micro_batch_size, dp_rank=dp_rank,
                         dp_size=dp_size, seed=t.seed)
        valid = None
        if valid_recs:
            rows = build_preference_rows(valid_recs, tokenizer, template, t.seq_len, d.pack,
                                         trunc, "valid")
            valid = PairSamples(BlendedSamples([rows], None, seed=t.seed, shuffle=False))
            self._ref_rows.append(rows.rows)
        vl = PairValLoader(valid, micro_batch_size=t.micro_batch_size, dp_rank=dp_rank,
                           dp_size=dp_size, num_batches=d.val_batches)
        self._setup_reference(dp_rank)
        return tl, vl

    def _setup_reference(self, dp_rank: int) -> None:
        """After the engine built and initialised the parts: the frozen copy's
        weights, the pipeline's ranks and the precompute pass. Collective."""
        if not self.needs_reference:
            return
        self._load_reference(self.init_from)
        specs = [spec for spec, _ in self._stages.values()]
        if specs and not specs[0].whole and self._walk is None:
            tp_rank = 0 if self._tp_mesh is None else self._tp_mesh.get_local_rank()
            self._walk = StageWalk.discover(
                {spec.index: m for spec, m in self._stages.values()}, specs[0].num_stages,
                (dp_rank, tp_rank), self._mesh_by_names)
        self._precompute_when_ready()

    def _mesh_by_names(self, names: tuple[str, ...]):
        """The mesh of a DTensor activation received from the previous stage
        (sequence parallelism): the tensor-parallel one."""
        if self._tp_mesh is not None and tuple(self._tp_mesh.mesh_dim_names) == tuple(names):
            return self._tp_mesh
        raise RuntimeError(f"dpo reference walk: no mesh {names} for a received activation")

    def adapted_modules(self) -> list[str]:
        return self.inner.adapted_modules() if self.uses_lora else []


class PairValLoader(ValLoader):
    """Validation micro-batches of whole pair rows (chosen, rejected adjacent)."""

    def batches(self, num_batches: int):
        if self.samples is None:
            return
        n = len(self.samples)
        for j in range(num_batches):
            start = (j * self.B * self.dp + self.rank * self.B) % n
            rows = np.concatenate([self.samples.get_batch((start + i) % n, 1)
                                   for i in range(self.B)])
            yield rows_to_batch(rows, packed=True)


# --------------------------------------------------------------- log-probs
def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, T]`` log-prob of each label token (0 where ignored).
    ``logits`` may be a vocab-sharded DTensor (the tensor-parallel head):
    the log-softmax is then reduced across the shards under
    ``loss_parallel``, and every rank gets the whole ``[B, T]``."""
    flat = labels.reshape(-1)
    if isinstance(logits, DTensor):
        mesh = logits.device_mesh
        target = DTensor.from_local(flat, mesh, [Replicate()] * mesh.ndim)
        nll = F.cross_entropy(logits.float().flatten(0, -2), target, ignore_index=IGNORE_INDEX,
                              reduction="none")
        nll = nll.full_tensor() if isinstance(nll, DTensor) else nll
    else:
        nll = F.cross_entropy(logits.float().flatten(0, -2), flat, ignore_index=IGNORE_INDEX,
                              reduction="none")
    return -nll.view(labels.shape)


def _pair_slots(labels: torch.Tensor, docs: torch.Tensor
                ) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(slot of each token ``[B/2, 2, T]`` -- pair row j, document d -> j*D + d,
    padding on slot 0 with nothing scored --, D, which slots hold a pair
    ``[B/2 * D]``)."""
    rows, T = labels.shape
    docs = docs.reshape(rows // 2, 2, T)
    D = int(docs.max()) + 1 if docs.numel() else 1
    base = torch.arange(rows // 2, device=docs.device).view(-1, 1, 1) * D
    slots = base + docs.clamp(min=0)
    scored = (labels.reshape(rows // 2, 2, T) != IGNORE_INDEX)
    chosen_counts = torch.zeros(rows // 2 * D, device=docs.device, dtype=torch.long)
    chosen_counts.scatter_add_(0, slots[:, 0].reshape(-1), scored[:, 0].reshape(-1).long())
    return slots, D, chosen_counts > 0


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, docs: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair slot: summed answer log-probs ``[2, S]`` (chosen, rejected),
    scored token counts ``[2, S]`` and which slots hold a pair ``[S]``."""
    slots, _, valid = _pair_slots(labels, docs)
    logp = token_logps(logits, labels)
    rows, T = labels.shape
    scored = (labels != IGNORE_INDEX).reshape(rows // 2, 2, T)
    logp = logp.reshape(rows // 2, 2, T)
    S = valid.numel()
    sums, counts = [], []
    for side in (0, 1):
        idx = slots[:, side].reshape(-1)
        sums.append(torch.zeros(S, device=logp.device, dtype=logp.dtype).index_add(
            0, idx, logp[:, side].reshape(-1)))
        counts.append(torch.zeros(S, device=logp.device, dtype=torch.long).index_add(
            0, idx, scored[:, side].reshape(-1).long()))
    return torch.stack(sums), torch.stack(counts), valid


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        if p.requires_grad:
            return p.device
    return next(module.parameters()).device
