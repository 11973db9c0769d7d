"""The training loop: config in, trained model, metrics and checkpoints out.

Order matters: every check that can fail on user input (config, layout, data
paths, tokenizer vocabulary) runs before a process group exists, so a bad run
fails in a second with one clear line instead of a hang across ranks.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path

import torch

from giantmodel.config import dump_config
from giantmodel.config.errors import ConfigError
from giantmodel.data.checks import check_data
from giantmodel.distributed.init import (HostLostError, describe_lost_peer, gather_peer_hosts,
                                         init_distributed, pick_device, shutdown_distributed,
                                         world_info)
from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.distributed.placement import resolve_placement
from giantmodel.metrics.flops import flops_per_token, peak_flops
from giantmodel.metrics.logger import MetricsLogger
from giantmodel.core.optim import SchedulerState, build_scheduler
from giantmodel.core.precision import Precision

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


class Trainer:
    def __init__(self, cfg):
        from giantmodel.data import build_loaders, vocab_size_of

        self.cfg = cfg
        self.info = world_info()
        self.peers, self.placement = [], None
        cfg.validate()
        check_data(cfg.data)
        self.dims = ParallelDims.from_config(cfg, self.info.world_size)
        vocab = vocab_size_of(cfg.data)
        if vocab is not None and vocab > cfg.model.vocab_size:
            raise ConfigError(
                f"the tokenizer has {vocab} tokens but model.vocab_size is "
                f"{cfg.model.vocab_size}; set model.vocab_size >= {vocab}", "model.vocab_size")
        self.run_dir = Path(cfg.run.dir)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)

        # ---- from here on, process groups exist
        self.device = pick_device(cfg.train.device, self.info)
        from giantmodel.comm import backend_for
        backend, pg_options = backend_for(cfg.comm, self.device.type)
        init_distributed(backend, cfg.parallel.timeout_s, self.device, self.info, pg_options)
        if self.info.world_size > 1:
            self.peers = gather_peer_hosts()
            self.placement = resolve_placement(cfg, self.dims, backend, log=self._print)
            self.dims.build_mesh(self.device.type)
            self._tune_buckets()
        torch.manual_seed(cfg.train.seed)

        from giantmodel.parallel.engine import build_engine
        self.engine = build_engine(cfg, self.dims, self.device)
        self.optimizer = self.engine.build_optimizer(cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.precision = Precision(cfg.precision, self.device.type)
        self.state = TrainerState(self.precision)
        self.train_loader, self.val_loader = build_loaders(
            cfg.data, seq_len=cfg.train.seq_len, global_batch_size=cfg.train.global_batch_size,
            micro_batch_size=cfg.train.micro_batch_size, dp_rank=self.engine.data_rank,
            dp_size=self.engine.data_world, seed=cfg.train.seed, vocab_size=cfg.model.vocab_size)
        self.microbatches = self.dims.microbatches(cfg.train)
        self.metrics = MetricsLogger(self.run_dir, self.info.is_rank0, cfg.run.tensorboard,
                                     cfg.run.progress, cfg.train.steps)
        self._stop_requested = False
        self._setup_checkpointing()

    def _tune_buckets(self) -> None:
        """On the giant backend, measure (or load the cached) gradient bucket
        size for this machine, model and world, and use it for data parallelism."""
        cfg = self.cfg
        if cfg.comm.backend != "giant" or self.dims.dp == 1:
            return
        from giantmodel.comm.autotune import tune

        choice = tune(self.dims.group("dp"), cfg.comm, cfg.model.name, cfg.model.num_params())
        cfg.parallel.bucket_mb = choice.bucket_mb
        self._print(f"comm: gradient buckets of {choice.bucket_mb:g} MiB "
                    f"({'cached' if choice.from_cache else 'tuned' if cfg.comm.autotune else 'fixed'})")

    # ------------------------------------------------------------ checkpoints
    def _setup_checkpointing(self) -> None:
        from giantmodel.checkpoint import CheckpointManager, ModelState, OptimizerState, RNGState

        cfg = self.cfg
        if self.info.is_rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.run_dir / "config.yaml")
        self.ckpt = CheckpointManager(cfg.checkpoint, str(self.run_dir),
                                      is_rank0=self.info.is_rank0)
        self.ckpt_state = {
            "model": ModelState(self.engine.parts),
            "optim": OptimizerState(self.engine.parts, self.optimizer),
            "lr": SchedulerState(self.scheduler),
            "data": self.train_loader,
            "rng": RNGState(),
            "trainer": self.state,
        }
        latest = self.ckpt.latest_step() if cfg.checkpoint.resume else None
        if latest is not None:
            self.ckpt.load(self.ckpt_state, latest)
            self._print(f"resumed from {self.run_dir / 'checkpoints'} at step {self.state.step}")
        elif cfg.checkpoint.init_from:
            from giantmodel.checkpoint import load_model_weights
            load_model_weights(self.engine.parts, cfg.checkpoint.init_from)
            self._print(f"initialised weights from {cfg.checkpoint.init_from}")

    def _save(self) -> None:
        self.ckpt.save(self.state.step, self.ckpt_state)

    # ------------------------------------------------------------------ loop
    def _print(self, text: str) -> None:
        if self.info.is_rank0:
            print(text, flush=True)

    def _request_stop(self, signum, frame) -> None:  # noqa: ARG002 - signal API
        # Slurm and torchrun send SIGTERM before killing: finish the step,
        # checkpoint, and exit cleanly instead of losing work.
        self._stop_requested = True

    def train_step(self) -> dict:
        """One optimizer step: forward/backward over the micro-batches, clip, update."""
        mbs = [next(self.train_loader) for _ in range(self.microbatches)]
        loss = self.engine.forward_backward(mbs, self.precision)
        skipped = self.precision.unscale_and_check(self.engine.parameters(), self.engine.any_rank)
        grad_norm = self.engine.clip_grad_norm_(self.cfg.optim.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        if not skipped:
            self.engine.optimizer_step(self.optimizer)
        self.engine.zero_grad(self.optimizer)
        self.scheduler.step()
        self.state.step += 1
        self.state.tokens_seen += self.cfg.train.global_batch_size * self.cfg.train.seq_len
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": skipped}

    def evaluate(self) -> float:
        return self.engine.eval_loss(iter(self.val_loader), self.precision)

    def train(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        tokens_per_step = t.global_batch_size * t.seq_len
        flops_tok = flops_per_token(cfg.model, t.seq_len)
        peak = peak_flops(self.device, cfg.precision) * self.info.world_size
        old_handler = signal.signal(signal.SIGTERM, self._request_stop)
        self._print(f"giantmodel: {cfg.model.name} ({cfg.model.num_params() / 1e6:.1f}M params) "
                    f"on {self.info.world_size} x {self.device.type}, {self.dims.summary}, "
                    f"steps {self.state.step}->{t.steps}")
        self.metrics.start(self.state.step)
        summary: dict = {"first_loss": None, "val_loss": None}
        window_t0, window_steps = time.perf_counter(), 0
        try:
            while self.state.step < t.steps and not self._stop_requested:
                out = self.train_step()
                window_steps += 1
                step = self.state.step
                if summary["first_loss"] is None:
                    summary["first_loss"] = out["loss"]
                last = step == t.steps
                if step % t.log_every == 0 or step == 1 or last:
                    dt = (time.perf_counter() - window_t0) / window_steps
                    tps = tokens_per_step / dt
                    record = {"step": step, "loss": out["loss"], "lr": out["lr"],
                              "grad_norm": out["grad_norm"], "tokens_per_sec": tps,
                              "mfu": flops_tok * tps / peak if peak else 0.0,
                              "step_time_s": dt, "tokens": self.state.tokens_seen}
                    if cfg.precision == "fp16":
                        record["loss_scale"] = self.precision.scale
                    self.metrics.log(record)
                    self.metrics.progress(step, f"loss {out['loss']:.4f} {tps:,.0f} tok/s")
                    if not sys.stderr.isatty():
                        self._print(f"step {step}/{t.steps} loss {out['loss']:.4f} "
                                    f"lr {out['lr']:.2e} gnorm {out['grad_norm']:.3f} "
                                    f"{tps:,.0f} tok/s mfu {record['mfu']:.1%}")
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
            lost = describe_lost_peer(e, self.peers, self.info.rank) if self.peers else None
            if lost is None:
                raise
            print(f"error: rank {self.info.rank}: {lost}", file=sys.stderr, flush=True)
            raise HostLostError(lost) from e
        finally:
            signal.signal(signal.SIGTERM, old_handler)
        summary["step"] = self.state.step
        return summary

    def sample(self, prompt: str | None = None, max_new_tokens: int | None = None) -> str | None:
        """Text generated by the trained model (single-process runs only)."""
        model = self.engine.full_model
        n = self.cfg.train.sample_tokens if max_new_tokens is None else max_new_tokens
        if model is None or n == 0:
            return None
        from giantmodel.data import build_tokenizer
        from giantmodel.models.generate import generate_text

        tok = build_tokenizer(self.cfg.data)
        return generate_text(model, tok, prompt if prompt is not None else self.cfg.train.sample_prompt,
                             max_new_tokens=n, seed=self.cfg.train.seed)

    def close(self) -> None:
        self.ckpt.close()
        self.metrics.close()
        shutdown_distributed()


def run_training(cfg) -> dict:
    """Train, print a sample on rank 0, and tear down: what ``giantmodel train`` runs."""
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
        if trainer.info.is_rank0 and cfg.train.sample_tokens:
            text = trainer.sample()
            if text is not None:
                print("\n----- sample -----\n" + text + "\n------------------", flush=True)
                summary["sample"] = text
    finally:
        trainer.close()
    return summary
