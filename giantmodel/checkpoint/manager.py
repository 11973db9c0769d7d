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
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from giantmodel.checkpoint import layout
from giantmodel.checkpoint.state import ModelState, is_per_rank, model_config_of
from giantmodel.config.errors import UserInputError
from giantmodel.config.loader import to_dict
from giantmodel.config.train import CheckpointConfig

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


def _numpy_globals() -> list:
    """What the restricted unpickler needs for numeric and string numpy
    arrays and scalars, which data loader states often hold."""
    import numpy as np
    core = getattr(np, "_core", None) or np.core
    dtype_classes = {type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDGUS"}
    return [np.ndarray, np.dtype, core.multiarray._reconstruct, core.multiarray.scalar,
            *dtype_classes]


def safe_load(fileobj) -> Any:
    """``torch.load`` with ``weights_only=True``, plus numpy arrays/scalars."""
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(fileobj, map_location="cpu", weights_only=True)


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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every call without a process group; single-process use
    is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_load(state: dict[str, Any], path: Path, process_group=None) -> None:
    """Load ``state`` in place from the DCP checkpoint at ``path``."""
    with _quiet_single_process():
        dcp.load(state, storage_reader=FileSystemReader(str(path)), planner=SafeLoadPlanner(),
                 process_group=process_group, no_dist=not _distributed())


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
        """Step of the newest complete checkpoint, or None. Under a process
        group every rank must call it; all get rank 0's answer, so ranks
        never disagree about whether and where to resume."""
        return broadcast_from_rank0(layout.read_latest(self.dir), self.pg)

    def step_dir(self, step: int) -> Path:
        return self.dir / layout.step_dirname(step)

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Save ``state`` as checkpoint ``step``: synchronously, or in the
        background with ``cfg.async_save`` (then promoted when it finishes)."""
        self.wait()
        tmp = self.dir / (layout.step_dirname(step) + ".tmp")
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.is_rank0:
            layout.remove_stale_tmp(self.dir)
        barrier(self.pg)  # nobody writes into a directory rank 0 is clearing
        dcp_state, per_rank = _split(state)
        self._write_per_rank(tmp, step, per_rank)
        writer = FileSystemWriter(str(tmp), sync_files=True)
        meta = self._meta(step, state, dcp_state, per_rank)
        if not self.cfg.async_save:
            try:
                with _quiet_single_process():
                    dcp.save(dcp_state, storage_writer=writer, process_group=self.pg,
                             no_dist=not _distributed())
            except CheckpointException as e:  # a BaseException: make it an ordinary error
                raise RuntimeError(f"saving checkpoint step {step} into {tmp} failed "
                                   f"({dcp_error_message(e)}); step "
                                   f"{layout.read_latest(self.dir)} stays the latest") from None
            if self.is_rank0:
                self._promote(tmp, step, meta)
            barrier(self.pg)
            return
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
                    self._promote(tmp, step, meta)
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                self._pending_error = e
            finally:
                self._finalized.set()

        self._pending = future
        future.add_done_callback(on_done)

    def wait(self) -> None:
        """Block until a background save has finished and been promoted;
        raise if it failed. Call before exiting and before loading."""
        if self._pending is None:
            return
        self._pending = None
        self._finalized.wait()  # set by the done-callback, whatever the outcome
        error, self._pending_error = self._pending_error, None
        barrier(self.pg)
        if error is not None:
            raise RuntimeError(f"background checkpoint save failed ({dcp_error_message(error)}); "
                               f"step {layout.read_latest(self.dir)} stays the latest") from None

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
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "dcp_keys": sorted(dcp_state), "per_rank_keys": sorted(per_rank)}
        models = [v for v in state.values() if isinstance(v, ModelState)]
        cfg = model_config_of(models[0].parts) if models else None
        if cfg is not None:
            meta["model_config"] = to_dict(cfg)
        return meta

    def _promote(self, tmp: Path, step: int, meta: dict) -> None:
        with self._lock:
            (tmp / layout.META).write_text(json.dumps(meta, indent=2))
            layout.promote(tmp, self.step_dir(step))
            deleted = layout.apply_retention(self.dir, self.cfg.keep)
        log.info("saved checkpoint %s%s", self.step_dir(step),
                 f" (removed steps {deleted})" if deleted else "")

    # ------------------------------------------------------------------ load

    def load(self, state: dict[str, Any], step: int | None = None) -> int:
        """Load ``state`` in place from checkpoint ``step`` (default: the
        latest complete one) and return that step."""
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint under {self.dir}")
        path = self.step_dir(step)
        if not layout.is_complete(path):
            raise FileNotFoundError(f"{path} is not a complete checkpoint; complete steps: "
                                    f"{layout.complete_steps(self.dir)}")
        dcp_state, per_rank = _split(state)
        if dcp_state:
            try:
                dcp_load(dcp_state, path, self.pg)
            except (Exception, CheckpointException) as e:
                raise UserInputError(
                    f"cannot load {path} into this run's state ({', '.join(sorted(dcp_state))}): "
                    f"{dcp_error_message(e)}. If the config changed, use a new run.dir or set "
                    "checkpoint.resume=false") from None
        if per_rank:
            self._load_per_rank(path, per_rank)
        log.info("loaded checkpoint %s", path)
        return step

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
    with open(path, "rb") as fh:
        return safe_load(fh)


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(DCP-managed entries, per-rank entries)."""
    dcp_state = {k: v for k, v in state.items() if not is_per_rank(v)}
    per_rank = {k: v for k, v in state.items() if is_per_rank(v)}
    return dcp_state, per_rank
