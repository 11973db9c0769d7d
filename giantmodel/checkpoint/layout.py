"""On-disk layout of checkpoints and the file operations that keep it atomic.

::

    run.dir/
      config.yaml                   resolved job config (written by the trainer)
      checkpoints/
        latest                      "step-00000200": the newest committed checkpoint
        step-00000100/              DCP files (.metadata, __*_*.distcp), meta.json,
        step-00000200/                checksums.json, ranks/rank-00000.pt ... (per-rank state)
        step-00000300.tmp/          a save in progress (or one that crashed)

A save writes everything into ``step-N.tmp``, fsyncs it, renames it to
``step-N`` and only then replaces ``latest`` (write a temporary file, fsync,
rename). Replacing ``latest`` is the commit: a resume loads the step it names
and nothing else, so a save killed at any point (even between the rename and
the marker) resumes from the previous checkpoint, and a newer-numbered
directory from an earlier run in the same run.dir is never picked by mistake.
A crashed save leaves only a ``.tmp`` directory, which the next save removes.

Saving a step that already exists moves the old copy to ``step-N.old`` and
renames the new one in; a crash between the two renames leaves ``.old``
alone, and :func:`recover_interrupted` puts it back rather than deleting it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from giantmodel.config.errors import UserInputError

LATEST = "latest"
META = "meta.json"
RANKS = "ranks"
DCP_METADATA = ".metadata"
_STEP_RE = re.compile(r"^step-(\d+)$")
_OLD_SUFFIX = ".old"

log = logging.getLogger(__name__)


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def rank_filename(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def is_complete(path: Path) -> bool:
    """A promoted checkpoint: a ``step-N`` directory holding DCP metadata."""
    return _STEP_RE.match(path.name) is not None and (path / DCP_METADATA).is_file()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path``, then the directories themselves."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(root))


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader sees the old or the new
    content, never a torn file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def complete_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the complete checkpoints under ``ckpt_dir``, ascending."""
    if not ckpt_dir.is_dir():
        return []
    steps = []
    for entry in ckpt_dir.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and is_complete(entry):
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_latest(ckpt_dir: Path) -> int | None:
    """The step ``latest`` names (the last committed save); without a marker
    (a directory copied by hand or written by an older version), the newest
    complete step; None when there is none.

    A step directory newer than the marker is never preferred: it is a save
    killed before its commit, or another run's checkpoint."""
    marker = ckpt_dir / LATEST
    if marker.is_file():
        m = _STEP_RE.match(marker.read_text().strip())
        if m:
            step = int(m.group(1))
            if checkpoint_path(ckpt_dir, step) is not None:
                return step
            older = [s for s in complete_steps(ckpt_dir) if s < step]
            log.warning("%s names %s, which is missing or incomplete; using %s", marker,
                        m.group(0), step_dirname(older[-1]) if older else "no checkpoint")
            return older[-1] if older else None
    steps = complete_steps(ckpt_dir)
    return steps[-1] if steps else None


def checkpoint_path(ckpt_dir: Path, step: int) -> Path | None:
    """Where checkpoint ``step`` is: its directory, or its ``.old`` copy when a
    re-save of that step was interrupted between its two renames; None when
    neither is complete. Read-only: safe while another process is saving."""
    final = ckpt_dir / step_dirname(step)
    if is_complete(final):
        return final
    old = final.with_name(final.name + _OLD_SUFFIX)
    return old if (old / DCP_METADATA).is_file() else None


def promote(tmp: Path, final: Path) -> None:
    """Atomically turn the finished ``tmp`` directory into ``final`` and point
    ``latest`` at it. An existing ``final`` (the same step saved again) is
    moved aside first and deleted only after the new one is in place and
    committed; :func:`recover_interrupted` handles a crash in between."""
    fsync_tree(tmp)
    old = None
    if final.exists():
        old = final.with_name(final.name + _OLD_SUFFIX)
        if old.exists():  # a complete final exists, so this copy is stale
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    write_atomic(final.parent / LATEST, final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def recover_interrupted(ckpt_dir: Path) -> list[str]:
    """Undo what a crash in :func:`promote` can leave: a ``step-N.old`` whose
    ``step-N`` is missing or incomplete goes back to ``step-N``; one whose
    ``step-N`` is complete is a leftover and is deleted. Call from one process
    (rank 0) before saving or resuming. Returns what it did, for the log."""
    done = []
    if not ckpt_dir.is_dir():
        return done
    for old in sorted(ckpt_dir.glob("step-*" + _OLD_SUFFIX)):
        final = old.with_name(old.name[: -len(_OLD_SUFFIX)])
        if not old.is_dir() or not _STEP_RE.match(final.name):
            continue
        if is_complete(final):
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name}")
        elif (old / DCP_METADATA).is_file():
            if final.exists():
                shutil.rmtree(final)
            os.replace(old, final)
            fsync_dir(ckpt_dir)
            done.append(f"restored {final.name} from {old.name}")
    return done


def checkpoint_order(ckpt_dir: Path, step: int) -> tuple[int, int]:
    """Sort key, oldest first: when the checkpoint was saved, then its step."""
    meta = read_meta(ckpt_dir / step_dirname(step))
    return int(meta.get("saved_at_ns", 0)), step


def apply_retention(ckpt_dir: Path, keep: int, run_id: str | None = None) -> list[int]:
    """Delete all but the newest ``keep`` checkpoints of run ``run_id`` (0
    keeps all), newest meaning most recently saved. Checkpoints of other
    runs in the same directory are neither deleted nor counted, so they can
    never push this run's out; the one ``latest`` names is never deleted.
    Returns the deleted steps."""
    if keep <= 0:
        return []
    mine = [s for s in complete_steps(ckpt_dir)
            if run_id is None or read_meta(ckpt_dir / step_dirname(s)).get("run_id") == run_id]
    mine.sort(key=lambda s: checkpoint_order(ckpt_dir, s))
    latest = read_latest(ckpt_dir)
    doomed = [s for s in mine[:-keep] if s != latest]
    for step in doomed:
        shutil.rmtree(ckpt_dir / step_dirname(step), ignore_errors=True)
    return doomed


def remove_stale_tmp(ckpt_dir: Path) -> list[str]:
    """Remove ``.tmp`` directories (saves that crashed or were abandoned)."""
    removed = []
    if ckpt_dir.is_dir():
        for entry in ckpt_dir.iterdir():
            if entry.is_dir() and entry.name.startswith("step-") and entry.name.endswith(".tmp"):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
    return removed


def read_meta(step_dir: Path) -> dict:
    """``meta.json`` of a step directory; {} when it is missing or unreadable."""
    path = step_dir / META
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def resolve_checkpoint_dir(path: str | os.PathLike, step: int | None = None) -> Path:
    """The step directory meant by ``path``: a step directory itself, a
    ``checkpoints`` directory or a run directory (newest complete checkpoint,
    or ``step`` when given)."""
    p = Path(path)
    if is_complete(p) or (p / DCP_METADATA).is_file():
        return p
    ckpt_dir = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not ckpt_dir.is_dir():
        raise UserInputError(f"{p}: no such checkpoint directory; pass a run directory, its "
                             "checkpoints/ directory or a step-N directory")
    if step is None:
        step = read_latest(ckpt_dir)
        if step is None:
            raise UserInputError(f"{ckpt_dir}: holds no complete checkpoint (no step-N directory "
                                 "with DCP .metadata)")
    target = checkpoint_path(ckpt_dir, step)
    if target is None:
        raise UserInputError(f"{ckpt_dir / step_dirname(step)}: not a complete checkpoint; "
                             f"available steps: {complete_steps(ckpt_dir)}")
    return target
