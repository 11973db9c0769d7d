"""The job config: every section of a training run in one typed object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from giantmodel.config.comm import CommConfig
from giantmodel.config.data import DataConfig
from giantmodel.config.dpo import DPOConfig
from giantmodel.config.errors import ConfigError
from giantmodel.config.lora import LoRAConfig
from giantmodel.config.model import ModelConfig
from giantmodel.config.parallel import ParallelConfig
from giantmodel.config.sd import SDConfig
from giantmodel.config.train import (
    CheckpointConfig,
    OffloadConfig,
    OptimConfig,
    ProfileConfig,
    RunConfig,
    TrainConfig,
    validate_accelerations,
)


@dataclass
class JobConfig:
    """One training job. Its defaults are the embedded default run: a tiny
    LLaMA trained on the Python standard library's sources, on the CPU."""

    objective: Literal["lm", "lora", "diffusion", "dpo"] = "lm"
    """What is trained: "lm" (next-token prediction for LLaMA / GPT: pretraining and
    supervised fine-tuning), "lora" (low-rank adapters on a frozen base, set in
    the lora section) or "diffusion" (Stable Diffusion text-to-image and
    DreamBooth; the ``sd`` section) or "dpo" (preference tuning on chosen/rejected
    pairs: DPO, IPO, SimPO, ORPO...; the ``dpo`` section, data.source preference)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture and shape."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch sizes, sequence length, logging and evaluation cadence."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    """Compute precision: fp32; bf16 autocast with fp32 master weights; fp16 autocast with dynamic loss scaling; fp8: bf16 autocast with the blocks' linears in fp8 (Transformer Engine or torchao float8, train.fp8_recipe; a GPU of compute capability 8.9 or newer)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: none; selective (keep matmul, attention and reduced outputs, recompute norms, casts, rotary, activations and gathers); full (whole blocks)."""
    recompute_layers: list[Literal["none", "selective", "full"]] | None = None
    """Per-block recompute, one mode per model layer (block i takes entry i); overrides ``recompute`` when set. ``giantmodel plan`` writes it when recomputing some blocks is enough to fit."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Data, ZeRO, tensor, sequence, pipeline and context parallelism."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and loading."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence, retention and initial weights."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Communication backend and its tuning."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Activation offload to host memory."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run directory and reporting."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """torch.profiler traces and CUDA memory snapshots."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters for the lora objective (ignored by the others)."""
    sd: SDConfig = field(default_factory=SDConfig)
    """Stable Diffusion models and recipe (objective "diffusion"; ignored by the others)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Preference-tuning loss, reference and truncation (objective "dpo"; ignored by the others)."""

    def validate(self) -> None:
        """Checks that need no process group and no world size."""
        self.model.validate()
        self.train.validate()
        self.optim.validate()
        self.parallel.validate()
        self.checkpoint.validate()
        self.comm.validate()
        self.data.validate()
        self.profile.validate()
        if self.objective == "lora":
            self.lora.validate(self.model.arch)
        elif self.objective == "diffusion":
            self.sd.validate()
        if self.objective == "dpo":
            self.dpo.validate(self.train.seq_len)
            if self.dpo.use_lora:
                self.lora.validate(self.model.arch)
        if (self.objective == "dpo") != (self.data.source == "preference"):
            raise ConfigError("objective dpo trains on data.source=preference, and only it "
                              "reads preference pairs; set both or neither", "data.source")
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len {self.train.seq_len} exceeds model.max_seq_len "
                f"{self.model.max_seq_len}; lower train.seq_len or raise model.max_seq_len",
                "train.seq_len")
        if (self.recompute_layers is not None
                and len(self.recompute_layers) != self.model.num_layers):
            raise ConfigError(
                f"has {len(self.recompute_layers)} entries but model.num_layers is "
                f"{self.model.num_layers}; give one mode per layer, or null to use recompute",
                "recompute_layers")
        self.offload.validate()
        validate_accelerations(self)
