"""On-disk layout of checkpoints and the file operations that keep it atomic.

::

    run.dir/
      config.yaml                   resolved job config (written by the trainer)
      checkpoints/
        latest                      "step-00000200": the newest complete checkpoint
        step-00000100/              DCP files (.metadata, __*_*.distcp), meta.json,
        step-00000200/                ranks/rank-00000.pt ... (per-rank state)
        step-00000300.tmp/          a save in progress (or one that crashed)

A save writes everything into ``step-N.tmp``, fsyncs it, renames it to
``step-N`` and only then replaces ``latest`` (write a temporary file, fsync,
rename). Renames are atomic on POSIX file systems, so ``latest`` always names a
complete checkpoint; a crashed save leaves only a ``.tmp`` directory, which the
next save removes.
"""

from __future__ import annotations

import json
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
    """The step ``latest`` names if it is complete; otherwise the newest
    complete checkpoint (``latest`` may lag after a crash between the rename
    and its update); None when there is none."""
    marker = ckpt_dir / LATEST
    if marker.is_file():
        m = _STEP_RE.match(marker.read_text().strip())
        if m and is_complete(ckpt_dir / m.group(0)):
            newest = complete_steps(ckpt_dir)
            step = int(m.group(1))
            return max([step, *newest])
    steps = complete_steps(ckpt_dir)
    return steps[-1] if steps else None


def promote(tmp: Path, final: Path) -> None:
    """Atomically turn the finished ``tmp`` directory into ``final`` and point
    ``latest`` at it. An existing ``final`` (the same step saved again) is
    moved aside first and deleted only after the new one is in place."""
    fsync_tree(tmp)
    old = None
    if final.exists():
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    write_atomic(final.parent / LATEST, final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def apply_retention(ckpt_dir: Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints (0 keeps all);
    the one ``latest`` names is never deleted. Returns the deleted steps."""
    if keep <= 0:
        return []
    steps = complete_steps(ckpt_dir)
    latest = read_latest(ckpt_dir)
    doomed = [s for s in steps[:-keep] if s != latest]
    for step in doomed:
        shutil.rmtree(ckpt_dir / step_dirname(step), ignore_errors=True)
    return doomed


def remove_stale_tmp(ckpt_dir: Path) -> list[str]:
    """Remove ``.tmp`` (crashed or abandoned) and ``.old`` directories."""
    removed = []
    if ckpt_dir.is_dir():
        for entry in ckpt_dir.iterdir():
            if entry.is_dir() and entry.name.startswith("step-") and \
                    entry.name.endswith((".tmp", ".old")):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
    return removed


def read_meta(step_dir: Path) -> dict:
    path = step_dir / META
    return json.loads(path.read_text()) if path.is_file() else {}


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
    target = ckpt_dir / step_dirname(step)
    if not is_complete(target):
        raise UserInputError(f"{target}: not a complete checkpoint; available steps: "
                             f"{complete_steps(ckpt_dir)}")
    return target
