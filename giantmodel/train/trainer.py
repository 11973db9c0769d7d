"""The training loop: config in, trained model, metrics and checkpoints out.

Order matters: every check that can fail on user input (config, layout, data
paths, tokenizer vocabulary) runs before a process group exists, so a bad run
fails in a second with one clear line instead of a hang across ranks.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch

from giantmodel.checkpoint import CheckpointManager, ModelState, OptimizerState, RNGState
from giantmodel.checkpoint.run_dir import RunLock, check_run_paths
from giantmodel.comm import backend_for
from giantmodel.comm.autotune import tune
from giantmodel.config import ConfigError, JobConfig, dump_config
from giantmodel.config.errors import RunStopped
from giantmodel.core.optim import SchedulerState, build_scheduler
from giantmodel.core.precision import Precision, configure_tf32
from giantmodel.data.checks import check_data
from giantmodel.distributed.init import (
    HostLostError,
    bind_cpu_cores,
    describe_lost_peer,
    describe_silent_peers,
    gather_peer_hosts,
    init_distributed,
    is_collective_failure,
    pick_device,
    probe_peer_hosts,
    shutdown_distributed,
    world_info,
)
from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.distributed.placement import resolve_placement
from giantmodel.metrics.flops import job_peak_flops
from giantmodel.metrics.logger import MetricsLogger, format_memory, peak_memory
from giantmodel.metrics.profile import StepProfiler
from giantmodel.objectives import build_objective
from giantmodel.parallel.accel import Accelerations, plan_accelerations
from giantmodel.parallel.engine import TrainEngine
from giantmodel.parallel.objective import BaseObjective, check_supported
from giantmodel.train.moe_stats import MoEStepStats
from giantmodel.train.preflight import check_memory
from giantmodel.train.watchdog import HangWatch, last_collectives

log = logging.getLogger("giantmodel")


class TrainerState:
    """Loop counters and the loss scale, checkpointed with everything else."""

    def __init__(self, precision: Precision):
        self.step = 0
        self.tokens_seen = 0
        self.precision = precision

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "precision": self.precision.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.precision.load_state_dict(state["precision"])


def preflight(cfg: JobConfig, world_size: int) -> tuple[ParallelDims, BaseObjective]:
    """Every check on user input, before any process group exists: the
    config's values, the files it names, the layout for ``world_size`` ranks
    (pipeline included), and what the objective's model supports."""
    cfg.validate()
    check_data(cfg.data)
    check_run_paths(cfg)
    dims = ParallelDims.from_config(cfg, world_size)
    objective = build_objective(cfg)
    check_supported(objective, tp=dims.tp, cp=dims.cp, pp=dims.pp)
    return dims, objective


def build_engine(cfg: JobConfig, objective: BaseObjective, dims: ParallelDims, device: torch.device,
                 bucket_mb: float | None = None, accel: Accelerations | None = None) -> TrainEngine:
    """The engine for ``cfg``'s layout (``bucket_mb``: a tuned bucket size,
    else ``parallel.bucket_mb``; ``accel``: fp8 / apex swaps)."""
    return TrainEngine(objective, dims, device, parallel=cfg.parallel, recompute=cfg.recompute,
                       recompute_layers=cfg.recompute_layers, offload=cfg.offload,
                       compile=cfg.train.compile, precision=cfg.precision,
                       bucket_mb=bucket_mb if bucket_mb is not None else cfg.parallel.bucket_mb,
                       accel=accel, weight_cast=cfg.train.weight_cast)


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.info = world_info()
        self.peers, self.placement = [], None
        self.dims, self.objective = preflight(cfg, self.info.world_size)
        self.run_dir = Path(cfg.run.dir)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)

        # ---- from here on, process groups exist
        self.device = pick_device(cfg.train.device, self.info)
        # before the model is built: a job that cannot fit stops in one line
        check_memory(cfg, self.device, self.info.world_size, self.info.local_world_size)
        configure_tf32(self.device.type, cfg.train.tf32)
        # before the model exists: CUDA memory history must see its allocations
        self.profiler = StepProfiler(cfg.profile, self.run_dir, self.info.rank, self.device,
                                     self._print)
        # fp8 / apex against this device and the installed packages: a
        # ConfigError here, before any process group, names the key.
        self.accel = plan_accelerations(cfg, self.device,
                                        fsdp=cfg.parallel.zero == 3 and self.dims.dp > 1)
        if self.device.type == "cpu" and cfg.train.bind_cores:
            bind_cpu_cores(self.info, cfg.train.threads)
        backend, pg_options = backend_for(cfg.comm, self.device.type, self.info.world_size)
        init_distributed(backend, cfg.parallel.timeout_s, self.device, self.info, pg_options)
        # a caller may have created the process group already (tests, notebooks)
        self.backend = backend = (torch.distributed.get_backend()
                                  if torch.distributed.is_initialized() else backend)
        self.run_lock = RunLock(self.run_dir)
        self._take_run_lock()
        if self.info.world_size > 1:
            self.peers = gather_peer_hosts()
            self.placement = resolve_placement(cfg, self.dims, backend, log=self._print)
            self.dims.build_mesh(self.device.type)
        torch.manual_seed(cfg.train.seed)
        self.bucket_mb = self._bucket_mb()
        self.engine = build_engine(cfg, self.objective, self.dims, self.device, self.bucket_mb,
                                   self.accel)
        self.optimizer = self.engine.build_optimizer(cfg.optim)
        self.moe_stats = MoEStepStats(self.engine.parts, self.dims.group_or_none("dp_cp"),
                                      self.dims.group_or_none("pp"))
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.precision = self.accel.precision(cfg.precision, self.device.type)
        self.state = TrainerState(self.precision)
        self.train_loader, self.val_loader = self.objective.build_loaders(
            dp_rank=self.engine.data_rank, dp_size=self.engine.data_world)
        self.microbatches = self.dims.microbatches(cfg.train)
        self.metrics = MetricsLogger.for_job(cfg, self.info.is_rank0)
        self._stop_requested = False
        self.hang = HangWatch(self.run_dir, self.info.rank, self.info.world_size)
        self._skipped_in_row = 0
        self._recent_losses: deque[float] = deque(maxlen=20)  # applied steps, for spike_factor
        self._setup_checkpointing()

    def _take_run_lock(self) -> None:
        """Rank 0 owns run.dir for the whole run; every rank fails with its
        error when another run holds it (before anything is written)."""
        err = ""
        if self.info.is_rank0:
            try:
                self.run_lock.acquire()
            except ConfigError as e:
                err = str(e)
        if self.info.world_size > 1:
            box = [err]
            torch.distributed.broadcast_object_list(box, src=0)
            err = box[0]
        if err:
            shutdown_distributed()
            raise ConfigError(err)

    def _bucket_mb(self) -> float:
        """The gradient bucket size for this run: on the giant backend
        (named, or chosen by ``comm.backend: auto`` on CPU),
        measured (or loaded from the tuning cache) for this machine, model
        and data-parallel group; otherwise ``parallel.bucket_mb``."""
        cfg = self.cfg
        if self.backend != "giant" or self.dims.dp * self.dims.cp == 1:
            return cfg.parallel.bucket_mb
        choice = tune(self.dims.group("dp_cp"), cfg.comm, self.objective.model_name(),
                      self.objective.num_params())
        self._print(f"comm: gradient buckets of {choice.bucket_mb:g} MiB "
                    f"({'cached' if choice.from_cache else 'tuned' if cfg.comm.autotune else 'fixed'})")
        return choice.bucket_mb

    # ------------------------------------------------------------ checkpoints
    def _setup_checkpointing(self) -> None:
        cfg = self.cfg
        if self.info.is_rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.run_dir / "config.yaml")
        self.ckpt = CheckpointManager(cfg.checkpoint, str(self.run_dir),
                                      is_rank0=self.info.is_rank0)
        # An objective may checkpoint only part of the model (LoRA: its
        # adapters); the rest is completed from checkpoint.init_from below.
        keep = self.objective.checkpoint_filter()
        self.ckpt_state = {
            "model": ModelState(self.engine.parts, keep),
            "optim": OptimizerState(self.engine.parts, self.optimizer),
            "lr": SchedulerState(self.scheduler),
            "data": self.train_loader,
            "rng": RNGState(),
            "trainer": self.state,
            **self.objective.state(),
        }
        latest = self.ckpt.latest_step() if cfg.checkpoint.resume else None
        if cfg.checkpoint.init_from and (latest is None or keep is not None):
            self.objective.load_pretrained(self.engine.parts, cfg.checkpoint.init_from)
            self._print(f"initialised weights from {cfg.checkpoint.init_from}")
        if latest is not None:
            self.ckpt.load(self.ckpt_state, latest)
            self._print(f"resumed from {self.run_dir / 'checkpoints'} at step {self.state.step}")

    def _save(self) -> None:
        self.hang.enter(f"step {self.state.step} checkpoint save")
        self.ckpt.save(self.state.step, self.ckpt_state)

    # ------------------------------------------------------------------ loop
    def _print(self, text: str) -> None:
        if self.info.is_rank0:
            print(text, flush=True)

    def _request_stop(self, signum, frame) -> None:
        # Slurm and torchrun send SIGTERM before killing: finish the step,
        # checkpoint, and exit cleanly instead of losing work.
        self._stop_requested = True

    def train_step(self) -> dict:
        """One optimizer step: forward/backward over the micro-batches, clip, update."""
        mbs = [next(self.train_loader) for _ in range(self.microbatches)]
        step = self.state.step + 1
        self.hang.enter(f"step {step} forward_backward")
        loss = self.engine.forward_backward(mbs, self.precision)
        self.hang.enter(f"step {step} gradient checks and norm")
        overflow = self.precision.unscale_and_check(self.engine.parameters(), self.engine.any_rank)
        # the norm is global (all-reduced), so every rank sees the same value
        # and takes the same decision: parameters stay identical across ranks
        grad_norm = self.engine.clip_grad_norm_(self.cfg.optim.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        skipped = self._skip_reason(overflow, loss, grad_norm)
        if not skipped:
            self.hang.enter(f"step {step} optimizer_step")
            self.engine.optimizer_step(self.optimizer)
            self.objective.after_step()
            self._recent_losses.append(loss)
        # MoE layers: loads summed over dp, bias update (applied steps only), metrics
        moe = self.moe_stats.finish_step(update=not skipped)
        moe.update(self.objective.step_metrics())  # e.g. DPO's rewards/*, logps/*
        self.engine.zero_grad(self.optimizer)
        self.scheduler.step()
        self.state.step += 1
        self.state.tokens_seen += self.objective.step_units()[1]
        self._count_skip(skipped)
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": bool(skipped), **moe}

    def _skip_reason(self, overflow: bool, loss: float, grad_norm: float) -> str:
        """Why this step's update must not be applied ("" = apply it); the
        same answer on every rank."""
        if overflow:
            return f"fp16 overflow, loss scale now {self.precision.scale:g}"
        if self.engine.any_rank(not math.isfinite(grad_norm) or not math.isfinite(loss)):
            return f"non-finite values: first in {self._first_nonfinite(loss)}"
        factor, recent = self.cfg.train.spike_factor, self._recent_losses
        if factor and len(recent) >= 5:
            median = statistics.median(recent)
            if self.engine.any_rank(loss > factor * median):
                return (f"loss spike: {loss:.4f} > train.spike_factor {factor:g} x median "
                        f"{median:.4f} of the last {len(recent)} steps")
        return ""

    def _first_nonfinite(self, loss: float) -> str:
        """The first non-finite tensor of each rank that has one (the loss,
        else the first parameter gradient in model order), e.g. "the grad of
        layers.0.attention.wq.weight on rank 1"."""
        local = "" if math.isfinite(loss) else "the loss"
        for part in self.engine.parts:
            for name, p in part.named_parameters():
                if local:
                    break
                g = p.grad
                g = g.to_local() if hasattr(g, "to_local") else g
                if g is not None and not torch.isfinite(g).all():
                    local = f"the grad of {name}"
        found = [local]
        if self.info.world_size > 1:
            found = [None] * self.info.world_size
            torch.distributed.all_gather_object(found, local)
        named = [f"{what} on rank {r}" for r, what in enumerate(found) if what]
        return ", ".join(named[:4]) or "the reduced gradients (not in any rank's parameters)"

    def _count_skip(self, reason: str) -> None:
        self._skipped_in_row = self._skipped_in_row + 1 if reason else 0
        if not reason:
            return
        step, limit = self.state.step, self.cfg.train.max_skipped_steps
        self._print(f"step {step}: skipped the update ({reason})")
        if limit and self._skipped_in_row >= limit:
            raise RunStopped(
                f"step {step}: {self._skipped_in_row} steps in a row skipped (train."
                f"max_skipped_steps={limit}); last: {reason}. Lower the learning rate, check "
                "the data near this step, or resume from an earlier checkpoint")

    def evaluate(self) -> float:
        return self.engine.eval_loss(iter(self.val_loader), self.precision)

    def train(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        unit, units_per_step = self.objective.step_units()
        flops_per_unit = self.objective.flops_per_unit()
        peak = job_peak_flops(self.device, cfg.precision)
        old_handler = signal.signal(signal.SIGTERM, self._request_stop)
        self._print(f"giantmodel: {self.objective.model_name()} "
                    f"({self.objective.num_params() / 1e6:.1f}M params) "
                    f"on {self.info.world_size} x {self.device.type}, {self.dims.summary}, "
                    f"steps {self.state.step}->{t.steps}")
        self.metrics.start(self.state.step)
        peak_memory(self.device)  # each record's peak covers the steps since the one before
        summary: dict = {"first_loss": None, "val_loss": None}
        window_t0, window_steps = time.perf_counter(), 0
        try:
            while self.state.step < t.steps and not self._stop_requested:
                self.profiler.before_step(self.state.step + 1)
                out = self.train_step()
                self.profiler.after_step(self.state.step)
                window_steps += 1
                step = self.state.step
                if summary["first_loss"] is None:
                    summary["first_loss"] = out["loss"]
                last = step == t.steps
                if step % t.log_every == 0 or step == 1 or last:
                    dt = (time.perf_counter() - window_t0) / window_steps
                    tps = units_per_step / dt
                    record = {"step": step, "loss": out["loss"], "lr": out["lr"],
                              "grad_norm": out["grad_norm"], f"{unit}_per_sec": tps,
                              "mfu": flops_per_unit * tps / peak if peak else 0.0,
                              "step_time_s": dt, unit: self.state.tokens_seen,
                              **peak_memory(self.device)}
                    if cfg.precision == "fp16":
                        record["loss_scale"] = self.precision.scale
                    if out["skipped"]:
                        record["skipped"] = True
                    record.update({k: v for k, v in out.items()
                                   if k.startswith("moe_") or "/" in k})
                    self.metrics.log(record)
                    mem = format_memory(record)
                    self.metrics.progress(step, f"loss {out['loss']:.4f} {tps:,.0f} {unit}/s{mem}")
                    if not self.metrics.live:
                        self._print(f"step {step}/{t.steps} loss {out['loss']:.4f} "
                                    f"lr {out['lr']:.2e} gnorm {out['grad_norm']:.3f} "
                                    f"{tps:,.0f} {unit}/s mfu {record['mfu']:.1%}{mem}")
                    window_t0, window_steps = time.perf_counter(), 0
                if t.eval_every and (step % t.eval_every == 0 or last):
                    val = self.evaluate()
                    summary["val_loss"] = val
                    self.metrics.log({"step": step, "val_loss": val})
                    self._print(f"step {step} val_loss {val:.4f}")
                    window_t0, window_steps = time.perf_counter(), 0
                every = cfg.checkpoint.every
                if (every and step % every == 0) or (last and cfg.checkpoint.save_final) \
                        or self._stop_requested:
                    self._save()
                    window_t0, window_steps = time.perf_counter(), 0
            self.ckpt.wait()
        except Exception as e:
            self.profiler.on_error(e)  # a CUDA OOM leaves a memory snapshot
            if isinstance(e, RunStopped):
                # Decided on every rank alike from reduced values: no peer is
                # lost or late, and a hang report would leave every rank a
                # hang-<rank>.txt and the store's hang key set.
                raise
            lost = self._lost_peers(e)
            if lost is None:
                hung = self.hang.report()
                if hung is None:
                    raise
                print(f"error: rank {self.info.rank}: {hung}", file=sys.stderr, flush=True)
                raise RunStopped(hung) from e
            print(f"error: rank {self.info.rank}: {lost}", file=sys.stderr, flush=True)
            raise HostLostError(lost) from e
        finally:
            signal.signal(signal.SIGTERM, old_handler)
        summary["step"] = self.state.step
        return summary

    def _lost_peers(self, e: BaseException) -> str | None:
        """The one line naming the hosts a failed collective lost: from the
        error's text when it names a peer's address (a dead process resets
        its connections), else, for a timeout or a closed pair, from probing
        every peer host (a cut link leaves both processes alive and silent)."""
        if not self.peers:
            return None
        lost = describe_lost_peer(e, self.peers, self.info.rank)
        if lost is not None or not is_collective_failure(e):
            return lost
        verdicts = probe_peer_hosts(self.peers, self.info.rank)
        _, newest = last_collectives(1)
        here = self.hang.entered + (f" ({newest})" if newest else "")
        return describe_silent_peers(e, self.peers, self.info.rank, verdicts,
                                     self._peer_phases(verdicts), here)

    def _peer_phases(self, verdicts: dict[str, str]) -> dict[int, str]:
        """Each rank's newest phase from the hang watch's record in the store,
        read only when the store's host still answers: a store across the
        cut link would block for the whole process-group timeout."""
        master = os.environ.get("MASTER_ADDR", "")
        store_host = next((p.host for p in self.peers
                           if master in (p.host, *p.addresses)), None)
        if store_host is None or verdicts.get(store_host, "answers") != "answers":
            return {}
        try:  # the hang watch's own record: "count|phase" per rank
            return {r: phase for r, (_, phase) in self.hang._read("at").items()}
        except Exception:  # noqa: BLE001 - no store, or it left too: nothing to add
            return {}

    def sample(self) -> str | None:
        """What the objective shows after training (single-process runs only)."""
        model = self.engine.full_model
        return None if model is None else self.objective.sample(model)

    def close(self) -> None:
        self.profiler.close()
        self.hang.close()
        self.ckpt.close()
        self.metrics.close()
        shutdown_distributed()
        self.run_lock.release()


def run_training(cfg: JobConfig) -> dict:
    """Train, print a sample on rank 0, and tear down: what ``giantmodel train`` runs."""
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
        if trainer.info.is_rank0:
            text = trainer.sample()
            if text is not None:
                print("\n----- sample -----\n" + text + "\n------------------", flush=True)
                summary["sample"] = text
                trainer.metrics.log_text("samples", text, trainer.state.step)
    finally:
        trainer.close()
    return summary
