"""The language-model objective: next-token prediction for LLaMA and GPT.

Pretraining and supervised fine-tuning both train this objective; they differ
only in their data (which tokens carry a label). Fine-tuning batches
(``data.source: sft``) may be packed: several examples share a row, and the
batch carries ``document_ids`` and ``position_ids``, which go to the model so
attention stays within each example and positions restart at each one, on
every layout (pipeline stages get them as keyword inputs). The model is a plain
decoder (:mod:`giantmodel.models`); this class adds what the engine needs:
Megatron-style tensor parallelism with a vocabulary-parallel head and loss,
causal context parallelism over sequence shards, pipeline stages with the
token embedding and output head on the first and last stage, and tied
embeddings across stages.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch import nn

from giantmodel.checkpoint import load_model_weights
from giantmodel.config.data import DataConfig
from giantmodel.config.errors import ConfigError
from giantmodel.config.model import ModelConfig
from giantmodel.config.schema import JobConfig
from giantmodel.config.train import TrainConfig
from giantmodel.core.loss import IGNORE_INDEX, check_loss_impl, head_computes_loss, resolve_loss_impl
from giantmodel.data import build_loaders, build_tokenizer, vocab_size_of
from giantmodel.data.chat import chat_reply
from giantmodel.data.sft import prepare_sft, sft_template
from giantmodel.metrics.flops import flops_per_token
from giantmodel.models import build_model, init_weights
from giantmodel.models.common.moe import MoE, moe_layers, set_aux_loss_units
from giantmodel.models.generate import generate_text
from giantmodel.models.registry import init_parameter
from giantmodel.parallel.context import apply_context_parallel, balanced_positions, shard_sequence
from giantmodel.parallel.objective import BaseObjective, StageSpec
from giantmodel.parallel.tensor import (
    apply_tensor_parallel,
    loss_parallel_context,
    vocab_parallel_cross_entropy,
)

_EMBEDDING, _HEAD = "tok_embeddings.weight", "output.weight"
# Pipeline stages' keyword input: each sequence's loss units, [B] (MoE auxiliary losses).
_AUX_UNITS = "moe_aux_units"

log = logging.getLogger(__name__)


class LanguageModel(BaseObjective):
    name = "lm"
    supports = frozenset({"tp", "cp", "pp"})

    def __init__(self, model: ModelConfig, *, data: DataConfig, train: TrainConfig):
        self.model_cfg = model
        self.data_cfg = data
        self.train_cfg = train
        self.seed = train.seed
        self._vocab_parallel = False
        self._cp_mesh = None
        self._loss_impl: str | None = None  # train.loss_impl, resolved at the first loss
        self._moe: dict[int, list[MoE]] = {}  # each model part's MoE layers

    @classmethod
    def from_config(cls, cfg: JobConfig) -> LanguageModel:
        """Checks that need the data (before any process group). Fine-tuning
        settings are made concrete in ``cfg`` first: ``checkpoint.init_from:
        builtin:tiny-chat`` becomes the built model's directory and an unset
        ``data.tokenizer`` the one beside the initial weights."""
        prepare_sft(cfg)
        if cfg.data.source == "sft" and cfg.data.pack and cfg.parallel.cp > 1:
            raise ConfigError("packed examples need whole sequences on each rank; set "
                              "data.pack=false or parallel.cp=1", "data.pack")
        vocab = vocab_size_of(cfg.data)
        if vocab is not None and vocab > cfg.model.vocab_size:
            raise ConfigError(
                f"the tokenizer has {vocab} tokens but model.vocab_size is "
                f"{cfg.model.vocab_size}; set model.vocab_size >= {vocab}", "model.vocab_size")
        device = cfg.train.device
        check_loss_impl(cfg.train.loss_impl, "cuda" if device == "auto" and
                        torch.cuda.is_available() else device)
        if cfg.parallel.pp > 1 and cfg.train.loss_impl not in ("auto", "plain"):
            log.warning("train.loss_impl=%s: pipeline stages compute the plain loss on the "
                        "last stage's logits", cfg.train.loss_impl)
        return cls(cfg.model, data=cfg.data, train=cfg.train)

    # ------------------------------------------------------------ the model
    def build(self, stage: StageSpec) -> nn.Module:
        model = build_model(self.model_cfg, device="meta")
        if not stage.whole:
            model.keep_stage(stage.layers, stage.first, stage.last)
            if self.model_cfg.moe is not None:
                model.register_forward_pre_hook(_take_aux_units, with_kwargs=True)
        return model

    def blocks(self, module: nn.Module) -> list[str]:
        return [f"layers.{k}" for k in module.layers]

    def edge_units(self, module: nn.Module) -> list[list[nn.Module]]:
        if self.model_cfg.tie_embeddings:
            return []  # a shared embedding/head weight must live in one unit: the root
        emb = [m for m in (module.tok_embeddings, module.pos_embeddings) if m is not None]
        head = [m for m in (module.norm, module.output) if m is not None]
        return [unit for unit in (emb, head) if unit]

    def apply_tensor_parallel(self, module: nn.Module, tp_mesh, *, sp: bool) -> None:
        apply_tensor_parallel(module, tp_mesh, sp)
        self._vocab_parallel = True

    def apply_context_parallel(self, module: nn.Module, cp_mesh) -> None:
        apply_context_parallel(list(module.layers.values()), cp_mesh)
        self._cp_mesh = cp_mesh

    def init_weights(self, module: nn.Module, device: torch.device) -> None:
        init_weights(module, self.model_cfg, self.seed, device=device)
        if self.model_cfg.tie_embeddings and module.output is not None and module.tok_embeddings is None:
            # A last stage without the embedding holds the head as a copy of
            # it: give it the embedding's draw, as the single-process tied model has.
            init_parameter(module.output.weight, _EMBEDDING, self.model_cfg, self.seed)

    def tied_parameters(self) -> list[tuple[str, str]]:
        return [(_EMBEDDING, _HEAD)] if self.model_cfg.tie_embeddings else []

    # ------------------------------------------------------------- the loss
    def loss_units(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def _local_inputs(self, batch: dict, device: torch.device):
        """(ids, labels, model keyword inputs) for this rank: its two
        load-balanced sequence chunks and their positions under context
        parallelism; a packed batch's positions and document ids ([B, T])."""
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        if "document_ids" in batch:
            return ids, labels, {"positions": batch["position_ids"].to(device),
                                 "document_ids": batch["document_ids"].to(device)}
        if self._cp_mesh is None:
            return ids, labels, {}
        cp, rank = self._cp_mesh.size(), self._cp_mesh.get_local_rank()
        positions = balanced_positions(ids.shape[1], cp, rank, device)
        return (shard_sequence(ids, cp, rank), shard_sequence(labels, cp, rank),
                {"positions": positions})

    def loss(self, module: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        device = _device_of(module)
        ids, labels, kwargs = self._local_inputs(batch, device)
        impl = self._head_loss_impl(module, device)
        if impl == "plain":
            loss_sum, count = vocab_parallel_cross_entropy(module(ids, **kwargs), labels)
        else:
            # The head returns the loss sum: [tokens, vocab] logits never exist.
            with head_computes_loss(module.output, labels, impl):
                loss_sum = module(ids, **kwargs)
            count = (labels != IGNORE_INDEX).sum()
        if self.model_cfg.moe is not None:
            layers = self._moe.setdefault(id(module), moe_layers(module))
            loss_sum = with_aux_losses(loss_sum, count, layers)
        return loss_sum, count

    def _head_loss_impl(self, module: nn.Module, device: torch.device) -> str:
        """``train.loss_impl`` for this model and layout (pipeline stages
        compute their loss in ``stage_loss``, on logits)."""
        if self._loss_impl is None:
            requested = self.train_cfg.loss_impl
            self._loss_impl, why = resolve_loss_impl(requested, module.output, device.type,
                                                     vocab_parallel=self._vocab_parallel)
            if why and requested != "auto":
                log.warning("train.loss_impl=%s: using the plain loss: %s", requested, why)
        return self._loss_impl

    def loss_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel_context(self._vocab_parallel)

    def stage_inputs(self, batch: dict) -> tuple[tuple, dict, torch.Tensor]:
        device = batch["input_ids"].device
        ids, labels, kwargs = self._local_inputs(batch, device)
        if kwargs.get("positions") is not None:
            # Every stage needs the absolute positions of its tokens (RoPE /
            # learned positions) and packed rows their document ids; [B, t]
            # so they split with the batch into pipeline micro-batches.
            kwargs["positions"] = kwargs["positions"].expand(ids.shape[0], -1)
        if self.model_cfg.moe is not None:
            # Each stage weights its MoE auxiliary losses by its micro-batch's
            # loss units, as loss() does with the whole count; [B] so the
            # schedule splits it with the micro-batches.
            kwargs[_AUX_UNITS] = (labels != IGNORE_INDEX).sum(dim=1)
        return (ids,), kwargs, labels

    def stage_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(output, target)[0]

    # ------------------------------------------------------- around training
    def build_loaders(self, *, dp_rank: int, dp_size: int):
        t = self.train_cfg
        return build_loaders(self.data_cfg, seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                             micro_batch_size=t.micro_batch_size, dp_rank=dp_rank,
                             dp_size=dp_size, seed=t.seed, vocab_size=self.model_cfg.vocab_size)

    def load_pretrained(self, parts: list[nn.Module], path: str | Path) -> Path:
        return load_model_weights(parts, path)

    def model_name(self) -> str:
        return self.model_cfg.name

    def num_params(self) -> int:
        return self.model_cfg.num_params()

    def step_units(self) -> tuple[str, int]:
        return "tokens", self.train_cfg.global_batch_size * self.train_cfg.seq_len

    def flops_per_unit(self) -> float:
        return flops_per_token(self.model_cfg, self.train_cfg.seq_len)

    def sample(self, model: nn.Module) -> str | None:
        """A continuation of ``train.sample_prompt``; after fine-tuning on
        conversations, the assistant's reply to it as a user turn, rendered
        with the run's chat template."""
        t, d = self.train_cfg, self.data_cfg
        if not t.sample_tokens:
            return None
        tokenizer = build_tokenizer(d)
        if d.source == "sft":
            template = sft_template(d, tokenizer, d.tokenizer)
            return chat_reply(model, tokenizer, template,
                              [{"role": "user", "content": t.sample_prompt}],
                              max_new_tokens=t.sample_tokens, seed=t.seed)
        return generate_text(model, tokenizer, t.sample_prompt,
                             max_new_tokens=t.sample_tokens, seed=t.seed)


def with_aux_losses(loss_sum: torch.Tensor, count: torch.Tensor,
                    layers: list[MoE]) -> torch.Tensor:
    """``loss_sum`` with the MoE layers' auxiliary losses of this forward
    added to its gradient, its value unchanged (the logged loss stays the LM
    loss; the auxiliary losses are logged on their own).

    Each layer's auxiliary loss is a mean over this micro-batch's tokens. It
    is weighted by ``count``, this micro-batch's share of the global token
    count the engine divides every loss sum by: the step then minimises
    coeff x the token-weighted mean over micro-batches and data-parallel
    ranks, the same under any gradient accumulation or dp degree."""
    terms = [aux for aux in (m.take_aux_loss() for m in layers) if aux is not None]
    if not terms:
        return loss_sum
    weighted = torch.stack(terms).sum() * count
    return loss_sum + (weighted - weighted.detach())


def _take_aux_units(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A pipeline stage's forward pre-hook: its MoE layers back-propagate
    their auxiliary losses themselves, weighted by this micro-batch's loss
    units (see ``AuxLossScaler``); the model never sees the keyword."""
    units = kwargs.pop(_AUX_UNITS, None)
    set_aux_loss_units(module, None if units is None else units.sum())
    return args, kwargs


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
