"""The built-in corpus: this Python's own standard library sources.

Every host that runs giantmodel has them, so the default job trains on real
text without downloading anything. On first use we train a SentencePiece
tokenizer on the training files and preprocess train and validation files into
indexed datasets, under ``CACHE/stdlib-KEY/``.

Several ranks may ask at once, with no process group yet: an exclusive
``fcntl`` lock on ``CACHE/stdlib-KEY.lock`` lets one build while the others
wait, and the build happens in a temporary directory that is renamed into
place only when complete, so an interrupted build never leaves a half cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from giantmodel.config.data import DataConfig
from giantmodel.config.errors import UserInputError
from giantmodel.data.preprocess import preprocess
from giantmodel.data.tokenizer import train_sentencepiece

# Bump when the build recipe changes, so old caches are not reused.
RECIPE_VERSION = 1
# SentencePiece's result depends on its thread count; fixing it makes the
# corpus identical on every host with the same Python.
_TRAIN_THREADS = 2
# Directories of the stdlib that are tests, bundled wheels or third-party code.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo",
              "__pycache__", "lib2to3", "ensurepip"}


@dataclass(frozen=True)
class BuiltinCorpus:
    """Paths of a finished built-in corpus."""

    root: Path
    tokenizer: Path
    train_prefix: Path
    valid_prefix: Path
    meta: dict


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The stdlib's ``.py`` files (no tests), sorted by relative path for a fixed order."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise UserInputError(f"the Python standard library was not found at {base}; set "
                             "data.source=indexed with your own data instead")
    files: list[Path] = []
    for d, dirs, names in os.walk(base):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("config-"))
        files.extend(Path(d) / n for n in names if n.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def select_files(files: list[Path], max_bytes: int, valid_every: int) -> tuple[list[Path], list[Path]]:
    """Cap the corpus at ``max_bytes`` (0: no cap) and hold out evenly spaced files."""
    chosen: list[Path] = []
    total = 0
    for f in files:
        size = f.stat().st_size
        if size == 0:
            continue
        if max_bytes and total + size > max_bytes and chosen:
            continue  # skip files that overflow the cap; smaller later ones may fit
        chosen.append(f)
        total += size
    if len(chosen) < 2:
        raise UserInputError(f"the built-in corpus needs at least 2 files; raise "
                             f"data.builtin_max_bytes (now {max_bytes})")
    n_valid = max(1, len(chosen) // valid_every)
    valid_idx = {min(len(chosen) - 1, int((j + 0.5) * len(chosen) / n_valid)) for j in range(n_valid)}
    train = [f for i, f in enumerate(chosen) if i not in valid_idx]
    valid = [f for i, f in enumerate(chosen) if i in valid_idx]
    return train, valid


def corpus_key(vocab_size: int, max_bytes: int, valid_every: int, stdlib_root: str) -> str:
    desc = json.dumps([RECIPE_VERSION, sys.version_info[:3], stdlib_root, vocab_size, max_bytes,
                       valid_every])
    return hashlib.sha256(desc.encode()).hexdigest()[:12]


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock held for the ``with`` body; released if the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _load_finished(root: Path) -> BuiltinCorpus | None:
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    return BuiltinCorpus(root, root / "tokenizer.model", root / "train", root / "valid", meta)


def _lines(files: list[Path]) -> Iterator[str]:
    for f in files:
        yield from f.read_text(encoding="utf-8", errors="replace").split("\n")


def _build(tmp: Path, train: list[Path], valid: list[Path], vocab_size: int,
           workers: int, progress: bool) -> dict:

    t0 = time.perf_counter()
    tok = train_sentencepiece(_lines(train), tmp / "tokenizer", vocab_size,
                              num_threads=_TRAIN_THREADS)
    t_tok = time.perf_counter() - t0
    common = dict(fmt="text", text_unit="file", workers=workers, progress=progress)
    s_train = preprocess([str(f) for f in train], tmp / "train", tok, **common)
    s_valid = preprocess([str(f) for f in valid], tmp / "valid", tok, **common)
    return {
        "recipe": RECIPE_VERSION, "python": sys.version.split()[0], "vocab_size": vocab_size,
        "train_files": len(train), "valid_files": len(valid),
        "train_bytes": sum(f.stat().st_size for f in train),
        "train_tokens": s_train.tokens, "valid_tokens": s_valid.tokens,
        "tokenizer_seconds": round(t_tok, 2),
        "preprocess_seconds": round(s_train.seconds + s_valid.seconds, 2),
        "preprocess_tokens_per_sec": round(s_train.tokens_per_sec, 1),
        "build_seconds": round(time.perf_counter() - t0, 2),
        "valid_file_names": [f.name for f in valid],
    }


def ensure_builtin_corpus(cache_dir: str | os.PathLike, *, vocab_size: int = 4096,
                          max_bytes: int = 0, valid_every: int = 20, workers: int | None = None,
                          progress: bool = True, stdlib_root: str | None = None) -> BuiltinCorpus:
    """Return the cached built-in corpus, building it first if needed (safe across processes)."""
    cache = Path(cache_dir).expanduser()
    root_src = str(stdlib_root or sysconfig.get_paths()["stdlib"])
    key = corpus_key(vocab_size, max_bytes, valid_every, root_src)
    final = cache / f"stdlib-{key}"
    done = _load_finished(final)
    if done is not None:
        return done
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserInputError(f"cannot create the data cache {cache} ({e}); set "
                             "GIANTMODEL_CACHE or data.cache_dir to a writable directory") from None
    with file_lock(cache / f"stdlib-{key}.lock"):
        done = _load_finished(final)  # another process may have built it while we waited
        if done is not None:
            return done
        # Holding the lock, any temp dir for this key is left over from a dead build.
        for stale in cache.glob(f".stdlib-{key}.tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        train, valid = select_files(stdlib_files(root_src), max_bytes, valid_every)
        tmp = cache / f".stdlib-{key}.tmp{os.getpid()}"
        tmp.mkdir()
        try:
            if progress:
                print(f"giantmodel: building the built-in corpus ({len(train)} + {len(valid)} "
                      f"stdlib files) in {final}", file=sys.stderr, flush=True)
            # One process: SentencePiece threads over the cores itself, and a
            # trainer rank calling this should not fork.
            w = workers or 1
            meta = _build(tmp, train, valid, vocab_size, w, progress)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    done = _load_finished(final)
    assert done is not None
    return done


def builtin_from_config(cfg: DataConfig, *, progress: bool = True) -> BuiltinCorpus:
    """The built-in corpus described by a :class:`DataConfig`."""
    return ensure_builtin_corpus(cfg.resolved_cache_dir(), vocab_size=cfg.builtin_vocab_size,
                                 max_bytes=cfg.builtin_max_bytes,
                                 valid_every=cfg.builtin_valid_every, progress=progress)
