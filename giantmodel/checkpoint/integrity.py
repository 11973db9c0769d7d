"""What makes a checkpoint safe to load: checksums and pickle-free metadata.

Checksums. A save records the size and CRC-32 of every file of the step
directory in ``checksums.json``; a load checks them before reading any state,
so a truncated, corrupted or missing file is reported by name instead of
surfacing as an unpickling error deep inside DCP (or as silently wrong
weights). Under a process group the files are split across ranks, each rank
hashing its share, so the time does not grow with the number of ranks.
Checkpoints without ``checksums.json`` (written before it existed) load
unverified, with a warning.

No code from a checkpoint. DCP's ``FileSystemReader`` reads ``.metadata``
with a plain ``pickle.load``: a crafted file runs any code on resume.
:class:`SafeFileSystemReader` reads it with an unpickler that resolves only
the types DCP's metadata is made of; anything else is refused before it can
be called. Per-rank files and DCP's byte items go through ``torch.load`` with
``weights_only=True`` (plus numpy arrays, see :func:`safe_load`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import pathlib
import pickle
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from giantmodel.config.errors import UserInputError

log = logging.getLogger(__name__)

CHECKSUMS = "checksums.json"
_CHUNK = 8 << 20


class CheckpointIntegrityError(UserInputError):
    """A checkpoint file is missing, truncated, corrupted or refused; names the file."""


# ------------------------------------------------------------------ checksums

def file_checksum(path: Path) -> dict:
    """``{"size": bytes, "crc32": "xxxxxxxx"}`` of one file."""
    crc, size = 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": f"{crc:08x}"}


def checkpoint_files(step_dir: Path) -> list[str]:
    """Every file under ``step_dir`` (relative, sorted) except the checksum list."""
    out = []
    for root, _, files in os.walk(step_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel != CHECKSUMS:
                out.append(rel)
    return sorted(out)


def _share(items: list[str], rank: int, world: int) -> list[str]:
    return items[rank::world]


def _gather(obj: Any, group) -> list[Any]:
    """Every rank's ``obj`` on every rank (just ``[obj]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def compute_checksums(step_dir: Path, group=None, distributed: bool = True) -> dict[str, dict]:
    """Checksums of every file of ``step_dir``. With ``distributed`` and a
    process group this is collective: rank r hashes files r, r+world, ... and
    every rank gets the whole table."""
    files = checkpoint_files(step_dir)
    on = distributed and dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if on else (0, 1)
    mine = {rel: file_checksum(step_dir / rel) for rel in _share(files, rank, world)}
    table: dict[str, dict] = {}
    for part in (_gather(mine, group) if on else [mine]):
        table.update(part)
    return table


def write_checksums(step_dir: Path, table: dict[str, dict]) -> None:
    with open(step_dir / CHECKSUMS, "w") as fh:
        json.dump({"algorithm": "crc32", "files": table}, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def find_problems(step_dir: Path, group=None) -> list[str]:
    """What is wrong with ``step_dir``'s files (empty: it verifies). Collective
    under a process group; every rank gets the same list."""
    listing = step_dir / CHECKSUMS
    if not listing.is_file():
        log.warning("%s has no %s (written before checksums existed): loading it unverified",
                    step_dir, CHECKSUMS)
        return []
    try:
        table = json.loads(listing.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{listing}: unreadable checksum list ({type(e).__name__}: {e})"]
    on = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if on else (0, 1)
    problems = [_check_one(step_dir / rel, want) for rel, want in
                sorted(table.items())[rank::world]]
    problems = [p for p in problems if p]
    merged: list[str] = []
    for part in _gather(problems, group):
        merged.extend(part)
    return sorted(merged)


def _check_one(path: Path, want: dict) -> str | None:
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != want["size"]:
        return f"{path} is truncated or overwritten: {size} bytes, {want['size']} were saved"
    got = file_checksum(path)["crc32"]
    if got != want["crc32"]:
        return f"{path} is corrupted: CRC-32 {got}, {want['crc32']} was saved"
    return None


def storage_problems(step_dir: Path, md: dcp_metadata.Metadata) -> list[str]:
    """Files the DCP metadata points into that are missing or too short for
    the byte ranges it records: a structural check that needs no checksums."""
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    problems = []
    for rel, size in sorted(need.items()):
        path = step_dir / rel
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size < size:
            problems.append(f"{path} is truncated: {path.stat().st_size} bytes, the metadata "
                            f"reads up to byte {size}")
    return problems


# ------------------------------------------------------------ safe unpickling

def _metadata_types() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {}
    for module, names in (
        (dcp_metadata, ("Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata",
                        "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                        "_MEM_FORMAT_ENCODING")),
        (dcp_filesystem, ("_StorageInfo",)),
        (pathlib, ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
    ):
        for name in names:
            if hasattr(module, name):
                allowed[(module.__name__, name)] = getattr(module, name)
    allowed[("torch", "Size")] = torch.Size
    # layouts pickle as a call of this lookup by name (copyreg in torch.serialization)
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    for name in ("OrderedDict",):
        allowed[("collections", name)] = getattr(__import__("collections"), name)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    _allowed: dict[tuple[str, str], Any] | None = None

    def __init__(self, fh, path: Path):
        super().__init__(fh)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _metadata_types()
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise CheckpointIntegrityError(
                f"{self.path}: refused to load: it references {module}.{name}, which DCP "
                "checkpoint metadata never holds (a tampered file?); nothing in it was run") from None


def read_dcp_metadata(path: Path) -> dcp_metadata.Metadata:
    """Unpickle a DCP ``.metadata`` file without resolving any other type."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        md = _MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointIntegrityError:
        raise
    except Exception as e:  # any unpickling failure means a bad file
        raise CheckpointIntegrityError(
            f"{path}: not a readable DCP metadata file ({type(e).__name__}: {e})") from None
    if not isinstance(md, dcp_metadata.Metadata):
        raise CheckpointIntegrityError(f"{path}: holds a {type(md).__name__}, not DCP metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        md = read_dcp_metadata(path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


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


def safe_load_file(path: Path) -> Any:
    """:func:`safe_load` of a file; a file it refuses or cannot parse is
    reported by name."""
    try:
        with open(path, "rb") as fh:
            return safe_load(fh)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointIntegrityError(
            f"{path}: refused to load: it holds more than tensors and plain data ({first}); "
            "nothing in it was run") from None
    except (EOFError, RuntimeError, ValueError) as e:
        raise CheckpointIntegrityError(
            f"{path}: unreadable ({type(e).__name__}: {e or 'truncated'})") from None
