"""Training loop, optimizer, checkpoint and run sections of the job config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from giantmodel.config.errors import ConfigError
from giantmodel.config.modes import refuse_unused


@dataclass
class TrainConfig:
    """Length and shape of the training run."""

    steps: int = 200
    """Optimizer steps to run."""
    global_batch_size: int = 16
    """Sequences per optimizer step, summed over data-parallel ranks and micro-batches."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank; the rest of the global batch is gradient accumulation."""
    seq_len: int = 256
    """Tokens per training sequence; at most model.max_seq_len."""
    seed: int = 1234
    """Seed for weights, data order and dropout."""
    log_every: int = 10
    """Write a metrics record every N steps (and on the first and last step)."""
    eval_every: int = 100
    """Run validation (data.val_batches micro-batches) every N steps and after the last; 0 disables it."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train; auto picks cuda when available."""
    compile: bool = False
    """torch.compile each transformer block."""
    sample_tokens: int = 96
    """Tokens to generate as a sample after training (0: no sample)."""
    sample_prompt: str = "def "
    """Prompt for the sample printed after training."""
    threads: int | None = None
    """CPU intra-op threads per rank; null leaves torch's default (or, with
    bind_cores, as many as the rank's cores)."""
    bind_cores: bool = True
    """On a CPU device with several ranks per host, give each local rank an
    equal, disjoint share of the host's CPUs (as DeepSpeed's
    ``--bind_cores_to_rank`` and ``torch.backends.xeon.run_cpu`` do): a rank
    and its communication threads then stay on their cores instead of
    migrating between them. Skipped when ranks outnumber the CPUs, and when
    a launcher (srun --cpu-bind, numactl, taskset) already narrowed the
    process's CPU set."""
    max_skipped_steps: int = 20
    """Stop the run when this many optimizer steps in a row were skipped (a
    non-finite gradient on any rank, an fp16 overflow, a loss spike); 0 never
    stops. 20 fp16 overflows in a row have cut the loss scale by 2^20."""
    spike_factor: float = 0.0
    """Skip a step whose loss exceeds this factor times the median loss of the
    last 20 applied steps (checked once 5 are known); 0 disables the check."""
    loss_impl: Literal["auto", "chunked", "liger", "plain"] = "auto"
    """LM cross-entropy: chunked runs the output head and the loss a slice of
    tokens at a time, so the [tokens, vocab] logits are never held (2.1 GB in
    fp32 for 4096 tokens of a 128K vocabulary); liger is liger-kernel's fused
    linear cross-entropy (CUDA, when installed); plain computes the full
    logits; auto picks liger on CUDA when installed, else chunked. Layouts
    with tp > 1 or pipeline stages use plain (the head is sharded or split)."""
    memory_check: bool = True
    """Before building the model, compare the planner's peak memory per rank
    with what the rank has (GPU: free device memory; CPU: the host's
    MemAvailable shared by its local ranks) and stop in one line, with the
    cheapest fixes, when it cannot fit. Refused only when the prediction less
    6.5% (the planner's measured peak-RSS error, -0.1% to +6.4%) exceeds it;
    configs the planner does not model (MoE, Stable Diffusion) are not
    checked. false skips the check."""
    weight_cast: Literal["step", "use"] = "step"
    """Under bf16/fp16, how the block linears get their compute-dtype
    weights. step: cast once per optimizer step and kept (2 bytes per block
    linear parameter held through the step, as Megatron's bf16 parameters
    are; no per-micro-batch copy, no cast in the step's later micro-batches).
    use: cast at every forward and backward and dropped after it (nothing
    kept: for runs that cannot spare the 2 bytes, such as ZeRO-0/1 with full
    recompute at the edge of memory). ZeRO-3's gathers are already in the
    compute dtype: nothing to cast or keep either way."""
    tf32: bool = True
    """On CUDA, let fp32 matmuls and convolutions use TF32 tensor cores
    (fp32 range, 10-bit mantissa, several times faster); false keeps IEEE fp32."""
    fp8_recipe: Literal["auto", "delayed", "current", "tensorwise", "rowwise"] = "auto"
    """precision=fp8 only: how the linears of each block are scaled to fp8.
    delayed and current are Transformer Engine's recipes (scales from an amax
    history, or from each tensor as it is cast); tensorwise and rowwise are
    torchao float8's (one scale per tensor, with fp8 all-gathers under FSDP2;
    or one per row, more accurate and slower); auto takes Transformer Engine's
    current scaling when it is installed, else torchao tensorwise."""
    norm_impl: Literal["torch", "apex"] = "torch"
    """RMSNorm / LayerNorm kernels: torch's, or NVIDIA apex's fused CUDA
    kernels (apex.normalization; needs apex built from github.com/NVIDIA/apex)."""

    def validate(self) -> None:
        for key in ("steps", "global_batch_size", "micro_batch_size", "seq_len", "log_every"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"must be positive, got {getattr(self, key)}", f"train.{key}")
        if self.spike_factor != 0 and not self.spike_factor > 1:
            raise ConfigError(f"must be 0 (off) or > 1, got {self.spike_factor}",
                              "train.spike_factor")
        for key in ("eval_every", "sample_tokens", "max_skipped_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, key)}", f"train.{key}")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"{self.global_batch_size} is not a multiple of micro_batch_size "
                f"{self.micro_batch_size} (train.micro_batch_size)", "train.global_batch_size")


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Floor of the decay (cosine, linear, wsd)."""
    warmup_steps: int = 20
    """Linear warm-up from 0 to lr over this many steps."""
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """Decay after warm-up; wsd holds lr then decays linearly over the last decay_fraction of steps."""
    decay_fraction: float = 0.2
    """wsd only: share of the run spent decaying."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not norms, biases)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    impl: Literal["auto", "fused", "foreach", "plain", "apex"] = "auto"
    """AdamW kernel: fused (one kernel per tensor; CUDA and CPU), foreach (multi-tensor), plain for-loop, or apex (NVIDIA apex's FusedAdam in AdamW mode: CUDA, plain tensors only, so not with tp > 1 or zero 3); auto picks fused on CUDA and CPU, foreach elsewhere."""

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"must be positive, got {self.lr}", "optim.lr")
        # A constant schedule never reads min_lr, so its default may exceed a small lr.
        if self.schedule != "constant" and not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"must be in [0, optim.lr={self.lr}], got {self.min_lr}", "optim.min_lr")
        if self.warmup_steps < 0:
            raise ConfigError(f"must be >= 0, got {self.warmup_steps}", "optim.warmup_steps")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError("must be in (0, 1]", "optim.decay_fraction")
        if self.grad_clip < 0 or self.weight_decay < 0:
            bad = "grad_clip" if self.grad_clip < 0 else "weight_decay"
            raise ConfigError(f"must be >= 0, got {getattr(self, bad)}", f"optim.{bad}")
        refuse_unused(self, "optim", "schedule", {"decay_fraction": ("wsd",),
                                                  "min_lr": ("cosine", "linear", "wsd")})


@dataclass
class CheckpointConfig:
    """Sharded (DCP) checkpoints under run.dir/checkpoints."""

    every: int = 100
    """Save every N steps (and after the last step); 0 saves only at the end."""
    keep: int = 2
    """Keep the newest N checkpoints; older ones are deleted after a successful save. 0 keeps all."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    resume: bool = True
    """Resume from run.dir's latest checkpoint when one exists."""
    init_from: str | None = None
    """Start from these weights instead of a random init: a Hugging Face directory or a giantmodel checkpoint directory."""
    save_final: bool = True
    """Save after the last step even when it is not a multiple of every."""
    fallback: bool = False
    """When the latest checkpoint fails verification (a file missing, truncated or corrupted), resume from the newest older one that passes instead of stopping with an error."""

    def validate(self) -> None:
        for key in ("every", "keep"):
            if getattr(self, key) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, key)}", f"checkpoint.{key}")


@dataclass
class OffloadConfig:
    """Activation offload to host memory."""

    activations: bool = False
    """Move saved activations to pinned host memory after forward; bring them back for backward."""
    prefetch_layers: int = 1
    """How many layers ahead backward prefetches offloaded activations."""

    def validate(self) -> None:
        if self.prefetch_layers < 0:
            raise ConfigError("must be >= 0", "offload.prefetch_layers")
        refuse_unused(self, "offload", "activations", {"prefetch_layers": (True,)})


@dataclass
class RunConfig:
    """Where a run writes and how it reports."""

    dir: str = "runs/llama-tiny"
    """Run directory: resolved config, metrics.jsonl, TensorBoard events, checkpoints/."""
    tensorboard: bool = True
    """Deprecated alias kept for old configs: when run.loggers is null, false turns off the default TensorBoard events; run.loggers, when set, decides alone."""
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] | None = None
    """Experiment trackers that receive every metrics record (rank 0 only): tensorboard (events in run.dir/tb), wandb (honours WANDB_MODE, WANDB_PROJECT, WANDB_DIR, WANDB_RUN_ID; files in run.dir unless WANDB_DIR is set) and mlflow (honours MLFLOW_TRACKING_URI, default a file store in run.dir/mlruns). A resumed run continues the same W&B and MLflow runs. null: [tensorboard] when it is installed. A tracker that fails warns once; training goes on."""
    progress: bool = True
    """Show a live progress line (ETA, tokens/s, loss) when stdout and stderr are a terminal; plain lines otherwise."""

    def trackers(self) -> list[str]:
        """The trackers this run writes to (run.loggers, else the default)."""
        if self.loggers is not None:
            return list(dict.fromkeys(self.loggers))
        return ["tensorboard"] if self.tensorboard else []


@dataclass
class ProfileConfig:
    """torch.profiler traces and CUDA memory snapshots."""

    steps: list[int] | None = None
    """[first, last]: record a torch.profiler window over these optimizer steps (inclusive, counted from 1), with shapes and memory, into one Chrome trace per rank under run.dir/profile/ (open it in ui.perfetto.dev or chrome://tracing). null: no profile."""
    memory_snapshot_on_oom: bool = True
    """On CUDA out-of-memory, write the allocator's memory snapshot to run.dir/memory-snapshot-rank<R>.pickle and print how to view it (pytorch.org/memory_viz)."""
    memory_history: bool = False
    """On CUDA, record every allocation's stack from the start (torch.cuda.memory._record_memory_history), so the out-of-memory snapshot shows what allocated each block; costs host time per allocation."""

    def validate(self) -> None:
        if self.steps is None:
            return
        if len(self.steps) != 2 or not 1 <= self.steps[0] <= self.steps[1]:
            raise ConfigError(f"must be [first, last] with 1 <= first <= last, got {self.steps}",
                              "profile.steps")


def validate_accelerations(job) -> None:
    """What precision=fp8, train.norm_impl=apex and optim.impl=apex need of
    the rest of ``job`` (a JobConfig). What they need of the machine (a GPU,
    the packages) is checked once the device is known, before any process
    group: giantmodel.parallel.accel.plan_accelerations."""
    train, par = job.train, job.parallel
    if job.precision != "fp8" and train.fp8_recipe != "auto":
        raise ConfigError(f"is set to {train.fp8_recipe!r}, but precision is {job.precision}, "
                          "which ignores it; set precision=fp8 or remove train.fp8_recipe",
                          "train.fp8_recipe")
    if job.precision == "fp8":
        if job.objective != "lm":
            raise ConfigError(f"fp8 trains objective=lm only (this job is {job.objective}); "
                              "use precision=bf16", "precision")
        if par.tp > 1:
            # The fp8 linears replace nn.Linear; the tensor-parallel plan
            # shards nn.Linear weights as DTensors, which they do not take.
            raise ConfigError(f"fp8 needs parallel.tp=1 (got {par.tp}); shard with "
                              "parallel.zero=3 instead, or use precision=bf16", "precision")
    if job.optim.impl == "apex" and (par.tp > 1 or par.zero == 3):
        raise ConfigError("apex's FusedAdam takes plain tensors, and parallel.tp > 1 or "
                          "parallel.zero=3 makes the parameters DTensors; use optim.impl=fused",
                          "optim.impl")
    if train.norm_impl == "apex" and par.tp > 1 and par.sp:
        raise ConfigError("apex's fused norms take plain tensors, and parallel.sp makes the "
                          "norm weights DTensors; use train.norm_impl=torch", "train.norm_impl")
