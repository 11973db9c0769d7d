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
* with full fine-tuning, a frozen copy built, tensor-parallel sharded and
  loaded like the policy (not FSDP-sharded: under ZeRO-3 each rank holds its
  tp share of it whole);
* with ``dpo.precompute_ref``, either of them run in one pass over every
  training and validation pair before the first loss
  (:mod:`giantmodel.objectives.dpo_ref`), its table saved in ``run.dir``
  for a resumed run; training then runs no reference forward.

SimPO and ORPO need no reference. Metrics, named as TRL names them
(``rewards/chosen`` ...), are kept as sums over the step's pairs and reduced
over all ranks in :meth:`DPO.step_metrics`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from giantmodel.checkpoint import load_model_weights
from giantmodel.config.dpo import REFERENCE_FREE, DPOConfig
from giantmodel.config.errors import ConfigError
from giantmodel.config.schema import JobConfig
from giantmodel.core.loss import IGNORE_INDEX
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
from giantmodel.objectives.dpo_ref import RefTable, all_pair_rows, load_or_build
from giantmodel.objectives.lm import LanguageModel
from giantmodel.objectives.lora import LoRA
from giantmodel.parallel.collectives import all_reduce_sum_
from giantmodel.parallel.objective import BaseObjective, StageSpec
from giantmodel.parallel.tensor import apply_tensor_parallel


class DPO(BaseObjective):
    name = "dpo"
    supports = frozenset({"tp", "pp"})

    def __init__(self, inner: LanguageModel, dpo: DPOConfig, run_dir: str | None = None):
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

    @classmethod
    def from_config(cls, cfg: JobConfig) -> DPO:
        """Pre-flight: the layout, the tokenizer beside the initial weights,
        and every record of every file (a bad one fails naming its line)."""
        cfg.dpo.validate(cfg.train.seq_len)
        p = cfg.parallel
        if p.cp > 1:
            raise ConfigError("preference pairs are scored whole on each rank; set "
                              "parallel.cp=1", "parallel.cp")
        if p.pp > 1 and cfg.dpo.loss_type not in REFERENCE_FREE:
            raise ConfigError(f"loss {cfg.dpo.loss_type} needs a reference forward, which "
                              "pipeline stages do not run yet; set parallel.pp=1, or use a "
                              "reference-free loss (dpo.loss_type=simpo or orpo)", "parallel.pp")
        if cfg.train.micro_batch_size < 1:
            raise ConfigError("must be at least 1 pair row", "train.micro_batch_size")
        inner_cls = LoRA if cfg.dpo.use_lora else LanguageModel
        prepare_sft(cfg)  # builtin:NAME in init_from becomes its directory
        cfg.data.tokenizer = sft_tokenizer_path(cfg.data, cfg.checkpoint.init_from)
        # The chat template exists (the files are pairs, not SFT records: checked next).
        check_sft(dataclasses.replace(cfg.data, paths=[], valid_paths=[]))
        preference_records(cfg.data, tiny_preferences)  # every record parses
        inner = inner_cls.from_config(cfg)
        return cls(inner, cfg.dpo, cfg.run.dir)

    # ------------------------------------------------------------ the model
    def build(self, stage: StageSpec) -> nn.Module:
        module = self.inner.build(stage)
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
        ref = self._refs.get(id(module))
        if ref is not None:
            apply_tensor_parallel(ref, tp_mesh, sp)

    def init_weights(self, module: nn.Module, device: torch.device) -> None:
        self.inner.init_weights(module, device)
        ref = self._refs.get(id(module))
        if ref is not None:
            # The same layout-independent draw as the policy: equal weights.
            self.inner.init_weights(ref, device)
            ref.requires_grad_(False)
            ref.eval()

    def tied_parameters(self) -> list[tuple[str, str]]:
        return self.inner.tied_parameters()

    def load_pretrained(self, parts: list[nn.Module], path: str | Path) -> Path:
        out = self.inner.load_pretrained(parts, path)
        refs = [self._refs[id(p)] for p in parts if id(p) in self._refs]
        if refs:
            load_model_weights(refs, path)
        return out

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

    def loss(self, module: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        device = _device_of(module)
        ids, kwargs = self._model_inputs(batch, device)
        labels, docs = batch["labels"].to(device), batch["document_ids"].to(device)
        policy, counts, valid = sequence_logps(module(ids, **kwargs), labels, docs)
        reference = None
        if self.needs_reference and self.cfg.precompute_ref:
            reference = self.precompute_reference(module).lookup(batch, device)
        elif self.needs_reference:
            reference = self._reference(module, ids, kwargs, labels, docs)
        return self._pair_loss(policy, counts, valid, reference)

    def _pair_loss(self, policy, counts, valid, reference):
        keep = valid.nonzero().squeeze(1)
        policy, counts = policy[:, keep], counts[:, keep]
        reference = None if reference is None else reference[:, keep]
        losses, rc, rr, lc, lr = preference_loss(self.cfg, policy, counts, reference)
        if torch.is_grad_enabled() and not policy.is_meta:  # training, not eval
            sums = metric_sums(rc, rr, lc, lr)
            self._sums = sums if self._sums is None else self._sums + sums
        return losses.sum(), torch.tensor(float(keep.numel()), device=policy.device)

    @torch.no_grad()
    def _reference(self, module, ids, kwargs, labels, docs) -> torch.Tensor:
        self.ref_forwards += 1
        if self.uses_lora:
            with adapters_off(module):
                logits = module(ids, **kwargs)
        else:
            logits = self._refs[id(module)](ids, **kwargs)
        return sequence_logps(logits, labels, docs)[0]

    def precompute_reference(self, module: nn.Module) -> RefTable:
        """``dpo.precompute_ref``'s table, built (or loaded from ``run.dir``)
        on the first call: after the weights are loaded, before the first
        loss. Collective on first call: every rank calls it together."""
        if self.ref_table is not None:
            return self.ref_table
        if not self._ref_rows:
            raise RuntimeError("dpo.precompute_ref: build_loaders must run before the first loss")
        device = _device_of(module)

        def score(batch: dict) -> torch.Tensor:
            ids, kwargs = self._model_inputs(batch, device)
            return self._reference(module, ids, kwargs, batch["labels"].to(device),
                                   batch["document_ids"].to(device))

        dp_rank, dp_size = self._ref_layout
        self.ref_table, _ = load_or_build(score, all_pair_rows(self._ref_rows),
                                          self.inner.train_cfg.micro_batch_size, dp_rank,
                                          dp_size, device, self.run_dir)
        return self.ref_table

    def step_metrics(self) -> dict[str, float]:
        """This step's ``rewards/*`` and ``logps/*`` means over the global
        batch's pairs; resets. Collective: every rank calls it after every
        step (tp copies count each pair equally often, so means are exact)."""
        sums = self._sums if self._sums is not None else torch.zeros(7, dtype=torch.float64)
        self._sums = None
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
        device = batch["input_ids"].device
        ids, kwargs = self._model_inputs(batch, device)
        # Labels and document ids split with the rows into micro-batches.
        target = torch.stack([batch["labels"], batch["document_ids"]], dim=1)
        return (ids,), kwargs, target.to(device)

    def stage_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        policy, counts, valid = sequence_logps(output, target[:, 0], target[:, 1])
        return self._pair_loss(policy, counts, valid, None)[0]

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
        return tl, vl

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
