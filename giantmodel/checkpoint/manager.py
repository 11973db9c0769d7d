"""CheckpointManager: sharded DCP save/load with atomic promotion, retention
and an asynchronous option.

Works in one process without a process group and under any process group
(FSDP2, tensor, pipeline parallel): every rank calls ``save`` and ``load``
with its own share of the state. See :mod:`giantmodel.checkpoint.layout` for
the directory layout and why a crash never corrupts ``latest``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from giantmodel.checkpoint import integrity, layout
from giantmodel.checkpoint.integrity import CheckpointIntegrityError, SafeFileSystemReader, safe_load
from giantmodel.checkpoint.state import ModelState, is_per_rank, model_config_of
from giantmodel.config.errors import UserInputError
from giantmodel.config.loader import to_dict
from giantmodel.config.train import CheckpointConfig

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor values with
    ``weights_only=False``; checkpoints here hold only plain data, so read
    them with the restricted unpickler."""

    def load_bytes(self, read_item, value) -> None:
        obj = safe_load(value)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def barrier(group) -> None:
    """Wait for every rank of ``group`` (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def broadcast_from_rank0(value: Any, group) -> Any:
    """Rank 0's ``value`` on every rank of ``group`` (identity without one)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def dcp_error_message(e: BaseException) -> str:
    """The underlying errors of a DCP failure, without DCP's tracebacks."""
    if isinstance(e, CheckpointException):
        causes = {f"{type(exc).__name__}: {exc}" for exc, _ in e.failures.values()}
        return "; ".join(sorted(causes))
    return f"{type(e).__name__}: {e}"


def _load_advice(cause: str) -> str:
    """What to do about a DCP load failure: a state that does not match the
    checkpoint is a config change; anything else is a damaged file."""
    if any(k in cause for k in ("mismatch", "Missing key", "Unexpected key", "KeyError", "size")):
        return ("If the config changed, use a new run.dir or set checkpoint.resume=false")
    return ("A file of the checkpoint looks damaged; set checkpoint.fallback=true to resume "
            "from the newest older checkpoint that verifies")


def _free_space(path: Path) -> str:
    """"12.3 MB free on that file system", or why it cannot be told: a full
    disk often surfaces as an obscure writer error, so the save error says it."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError as e:
        return f"free space unknown ({e.strerror})"
    return f"{free / 1e6:.1f} MB free on that file system"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every call without a process group; single-process use
    is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class CheckpointSaveError(UserInputError, RuntimeError):
    """A save failed (disk full, quota, I/O error); the previous checkpoint
    stays the latest. The CLI prints it as one ``error:`` line."""


def dcp_load(state: dict[str, Any], path: Path, process_group=None) -> None:
    """Load ``state`` in place from the DCP checkpoint at ``path``, running no
    pickled code (see :mod:`giantmodel.checkpoint.integrity`)."""
    with _quiet_single_process():
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
                 process_group=process_group, no_dist=not _distributed())


def verify_checkpoint(path: Path, process_group=None) -> list[str]:
    """What is wrong with the checkpoint at ``path``: files against their
    saved checksums, and its DCP metadata against the restricted unpickler.
    Empty when it is fit to load. Collective under a process group."""
    problems = integrity.find_problems(path, process_group)
    if not problems:
        try:
            md = integrity.read_dcp_metadata(path / layout.DCP_METADATA)
        except CheckpointIntegrityError as e:
            return [str(e)]
        # Also holds for checkpoints saved before checksums existed.
        problems = integrity.storage_problems(path, md)
    return problems


def _errors_on_any_rank(error: BaseException | str | None, group) -> list[str]:
    """Every rank's error message (rank-tagged), on every rank: so that a
    failure on one rank stops all of them at the same point instead of
    leaving the others waiting in the next collective."""
    text = error if error is None or isinstance(error, str) else f"{type(error).__name__}: {error}"
    if not _distributed():
        return [text] if text else []
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, text, group=group)
    return [f"rank {r}: {t}" if len(out) > 1 else t for r, t in enumerate(out) if t]


class CheckpointManager:
    """Save and restore training state under ``run_dir/checkpoints``.

    ``state`` maps names to Stateful objects (state_dict/load_state_dict) or
    plain dicts. Objects marked per-rank (:class:`RNGState`,
    :class:`PerRank`) go to ``ranks/rank-N.pt``; everything else goes through
    DCP, keyed by layout-independent names, so a checkpoint loads under a
    different parallel layout. Every rank of ``process_group`` must call
    ``save``/``load``/``wait``/``close``; ``is_rank0`` names the one rank that
    promotes checkpoints and applies retention.
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, *, is_rank0: bool,
                 process_group=None):
        self.cfg = cfg
        self.dir = Path(run_dir) / "checkpoints"
        self.is_rank0 = is_rank0
        self.pg = process_group
        dist_on = _distributed()
        self.rank = dist.get_rank(process_group) if dist_on else 0
        self.world_size = dist.get_world_size(process_group) if dist_on else 1
        # Which run the checkpoints written here belong to: new for a fresh
        # start, inherited on resume. Retention counts only this run's.
        self.run_id = uuid.uuid4().hex
        self._warned_foreign = False
        # A background save must not interleave its collectives with the
        # training step's on the same group, so it gets a gloo group of its own.
        self._async_pg = None
        if cfg.async_save and dist_on:
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            self._async_pg = dist.new_group(ranks=ranks, backend="gloo")
        self._pending: Future | None = None
        self._pending_error: BaseException | None = None
        self._finalized = threading.Event()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ queries

    def latest_step(self) -> int | None:
        """Step of the last committed checkpoint (the one ``latest`` names), or
        None. Under a process group every rank must call it; all get rank 0's
        answer, so ranks never disagree about whether and where to resume.
        Rank 0 first repairs a re-save that a crash interrupted."""
        step = None
        if self.is_rank0:
            self._recover()
        if self.is_rank0 or not _distributed():  # a reader (generate) repairs nothing
            step = layout.read_latest(self.dir)
        return broadcast_from_rank0(step, self.pg)

    def step_dir(self, step: int) -> Path:
        return self.dir / layout.step_dirname(step)

    def _recover(self) -> None:
        for what in layout.recover_interrupted(self.dir):
            log.warning("checkpoint directory %s: %s (a save of that step was interrupted)",
                        self.dir, what)

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Save ``state`` as checkpoint ``step``: synchronously, or in the
        background with ``cfg.async_save`` (then promoted when it finishes).
        A failure on any rank raises :class:`CheckpointSaveError` on every
        rank, removes the partial ``.tmp`` directory and leaves ``latest``
        where it was."""
        self.wait()
        tmp = self.dir / (layout.step_dirname(step) + ".tmp")
        error = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self.is_rank0:
                self._recover()
                layout.remove_stale_tmp(self.dir)
                self._warn_foreign_checkpoints()
        except OSError as e:
            error = e
        self._raise_if_failed(error, step, tmp)  # also: nobody writes into what rank 0 clears
        dcp_state, per_rank = _split(state)
        error = None
        try:
            self._write_per_rank(tmp, step, per_rank)
        except Exception as e:  # torch.save reports a full disk as RuntimeError
            error = e
        self._raise_if_failed(error, step, tmp)
        writer = FileSystemWriter(str(tmp), sync_files=True)
        meta = self._meta(step, state, dcp_state, per_rank)
        if self.cfg.async_save:
            self._save_in_background(step, tmp, dcp_state, writer, meta)
            return
        error = None
        try:
            with _quiet_single_process():
                dcp.save(dcp_state, storage_writer=writer, process_group=self.pg,
                         no_dist=not _distributed())
        except (Exception, CheckpointException) as e:  # DCP raises its
            # CheckpointException (a BaseException) under a process group, the cause without
            error = dcp_error_message(e)
        self._raise_if_failed(error, step, tmp)
        error = None
        try:
            # every rank hashes its share of the files; rank 0 commits
            table = integrity.compute_checksums(tmp, self.pg)
            if self.is_rank0:
                self._promote(tmp, step, meta, table)
        except Exception as e:  # reported on every rank below
            error = e
        self._raise_if_failed(error, step, tmp)

    def _save_in_background(self, step: int, tmp: Path, dcp_state: dict, writer, meta: dict) -> None:
        self._finalized.clear()
        self._pending_error = None
        started = time.perf_counter()
        future = dcp.async_save(dcp_state, storage_writer=writer, process_group=self._async_pg,
                                no_dist=not _distributed())
        future = getattr(future, "upload_completion", future)
        log.info("checkpoint step %d staged in %.2fs; writing in the background",
                 step, time.perf_counter() - started)

        def on_done(f: Future) -> None:
            try:
                f.result()
                if self.is_rank0:
                    # no collectives from this thread: rank 0 hashes every file
                    self._promote(tmp, step, meta, integrity.compute_checksums(tmp, distributed=False))
            except BaseException as e:  # surfaced by wait()
                self._pending_error = e
                if self.is_rank0:
                    shutil.rmtree(tmp, ignore_errors=True)
            finally:
                self._finalized.set()

        self._pending = future
        future.add_done_callback(on_done)

    def _raise_if_failed(self, error: BaseException | None, step: int, tmp: Path) -> None:
        """Collective: if any rank failed, every rank raises the same error and
        rank 0 removes the partial save."""
        errors = _errors_on_any_rank(error, self.pg)
        if not errors:
            return
        if self.is_rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier(self.pg)  # rank 0's answer below sees the cleaned directory
        latest = layout.read_latest(self.dir) if self.dir.is_dir() else None
        raise CheckpointSaveError(
            f"saving checkpoint step {step} into {self.dir} failed ({'; '.join(errors)}); "
            f"{f'step {latest}' if latest is not None else 'no checkpoint'} stays the latest. "
            f"{_free_space(self.dir)}; free space or fix permissions there "
            "(checkpoint.keep bounds how many checkpoints are kept)")

    def wait(self) -> None:
        """Block until a background save has finished and been promoted;
        raise if it failed. Call before exiting and before loading."""
        if self._pending is None:
            return
        self._pending = None
        self._finalized.wait()  # set by the done-callback, whatever the outcome
        error, self._pending_error = self._pending_error, None
        errors = _errors_on_any_rank(error, self.pg)
        if errors:
            raise CheckpointSaveError(
                f"background checkpoint save failed ({'; '.join(errors)}); "
                f"step {layout.read_latest(self.dir)} stays the latest")

    def close(self) -> None:
        self.wait()
        if self._async_pg is not None:
            dist.destroy_process_group(self._async_pg)
            self._async_pg = None

    def _write_per_rank(self, tmp: Path, step: int, per_rank: dict[str, Any]) -> None:
        (tmp / layout.RANKS).mkdir(parents=True, exist_ok=True)
        payload = {"rank": self.rank, "world_size": self.world_size, "step": step,
                   "state": {k: v.state_dict() for k, v in per_rank.items()}}
        path = tmp / layout.RANKS / layout.rank_filename(self.rank)
        with open(path, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())

    def _meta(self, step: int, state: dict[str, Any], dcp_state: dict, per_rank: dict) -> dict:

        meta = {"format": FORMAT_VERSION, "step": step, "world_size": self.world_size,
                "run_id": self.run_id,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "dcp_keys": sorted(dcp_state), "per_rank_keys": sorted(per_rank)}
        models = [v for v in state.values() if isinstance(v, ModelState)]
        cfg = model_config_of(models[0].parts) if models else None
        if cfg is not None:
            meta["model_config"] = to_dict(cfg)
        return meta

    def _promote(self, tmp: Path, step: int, meta: dict, checksums: dict) -> None:
        with self._lock:
            meta = {**meta, "saved_at_ns": time.time_ns()}
            meta_path = tmp / layout.META
            meta_path.write_text(json.dumps(meta, indent=2))
            checksums[layout.META] = integrity.file_checksum(meta_path)
            integrity.write_checksums(tmp, checksums)
            layout.promote(tmp, self.step_dir(step))
            deleted = layout.apply_retention(self.dir, self.cfg.keep, self.run_id)
        log.info("saved checkpoint %s%s", self.step_dir(step),
                 f" (removed steps {deleted})" if deleted else "")

    def _warn_foreign_checkpoints(self) -> None:
        """Say once that run.dir holds another run's checkpoints (a fresh start
        with checkpoint.resume=false, or a copied directory): they are kept."""
        if self._warned_foreign:
            return
        self._warned_foreign = True
        foreign = [s for s in layout.complete_steps(self.dir)
                   if layout.read_meta(self.step_dir(s)).get("run_id") != self.run_id]
        if foreign:
            log.warning("%s also holds checkpoints of another run (steps %s); they are kept, "
                        "never count toward checkpoint.keep, and `latest` now follows this run",
                        self.dir, foreign)

    # ------------------------------------------------------------------ load

    def load(self, state: dict[str, Any], step: int | None = None) -> int:
        """Load ``state`` in place from checkpoint ``step`` (default: the
        latest) and return the step loaded. Files are verified against their
        checksums first; when the latest fails and ``cfg.fallback`` is set,
        the newest older checkpoint that verifies is loaded instead (a step
        asked for explicitly, other than the latest, never falls back)."""
        self.wait()
        latest = self.latest_step()
        if step is None:
            step = latest
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint under {self.dir}")
        step = self._pick_verified(step, fallback=self.cfg.fallback and step == latest)
        path = self.step_dir(step)
        dcp_state, per_rank = _split(state)
        if dcp_state:
            try:
                dcp_load(dcp_state, path, self.pg)
            except (Exception, CheckpointException) as e:
                cause = dcp_error_message(e)
                raise UserInputError(
                    f"cannot load {path} into this run's state ({', '.join(sorted(dcp_state))}): "
                    f"{cause}. {_load_advice(cause)}") from None
        if per_rank:
            self._load_per_rank(path, per_rank)
        self.run_id = layout.read_meta(path).get("run_id", self.run_id)
        log.info("loaded checkpoint %s", path)
        return step

    def _pick_verified(self, step: int, fallback: bool) -> int:
        """``step`` if it verifies; else, with ``fallback``, the newest older
        complete checkpoint that does. Collective; raises naming the bad file."""
        candidates = [step]
        if fallback:
            older = [s for s in layout.complete_steps(self.dir) if s < step] if self.is_rank0 else []
            candidates += sorted(broadcast_from_rank0(older, self.pg), reverse=True)
        for i, candidate in enumerate(candidates):
            path = self.step_dir(candidate)
            if not layout.is_complete(path):
                problems = [f"{path} is not a complete checkpoint"]
            else:
                problems = verify_checkpoint(path, self.pg)
            if not problems:
                return candidate
            what = f"checkpoint step {candidate} failed verification: {problems[0]}" + (
                f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            if i + 1 < len(candidates):
                log.warning("%s; checkpoint.fallback=true: trying step %d", what, candidates[i + 1])
                continue
            hint = ("no older checkpoint verifies either" if fallback else
                    "set checkpoint.fallback=true to resume from the newest good checkpoint instead")
            raise CheckpointIntegrityError(f"{what}; {hint}")
        raise AssertionError("unreachable")

    def _load_per_rank(self, path: Path, per_rank: dict[str, Any]) -> None:
        saved_world = layout.read_meta(path).get("world_size", self.world_size)
        if saved_world != self.world_size:
            log.warning("checkpoint %s was saved by %d ranks and is loaded by %d: rank %d takes "
                        "its own per-rank state (%s) where one was saved, else falls back",
                        path, saved_world, self.world_size, self.rank, ", ".join(sorted(per_rank)))
        ranks_dir = path / layout.RANKS
        own_path = ranks_dir / layout.rank_filename(self.rank)
        own = _read_rank_file(own_path) if own_path.is_file() else {"state": {}}
        rank0 = None
        for key, obj in per_rank.items():
            if key in own["state"]:
                obj.load_state_dict(own["state"][key])
                continue
            if getattr(obj, "fallback", "rank0") == "skip":
                log.warning("rank %d keeps its current %r state: none was saved for it",
                            self.rank, key)
                continue
            if rank0 is None:
                first = ranks_dir / layout.rank_filename(0)
                rank0 = _read_rank_file(first) if first.is_file() else {"state": {}}
            if key not in rank0["state"]:
                raise FileNotFoundError(f"{path}: no saved per-rank state {key!r}")
            log.warning("rank %d loads rank 0's %r state", self.rank, key)
            obj.load_state_dict(rank0["state"][key])


def _read_rank_file(path: Path) -> dict:
    return integrity.safe_load_file(path)


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(DCP-managed entries, per-rank entries)."""
    dcp_state = {k: v for k, v in state.items() if not is_per_rank(v)}
    per_rank = {k: v for k, v in state.items() if is_per_rank(v)}
    return dcp_state, per_rank
