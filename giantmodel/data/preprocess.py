"""Raw text -> tokenized Megatron-LM indexed dataset, in several processes.

Inputs: jsonl (one JSON object per line, text under ``json_key``), plain text,
parquet (a string column), or a Hugging Face ``datasets`` directory saved with
``save_to_disk``. The main process reads and batches raw records; worker
processes parse and tokenize them; results come back in input order, so the
output is identical for any worker count. Every document ends with EOS.
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from giantmodel.config.errors import UserInputError
from giantmodel.data.indexed import IndexedDatasetWriter, token_dtype
from giantmodel.data.tokenizer import load_tokenizer

FORMATS = ("auto", "jsonl", "text", "parquet", "hf")
TEXT_UNITS = ("paragraph", "line", "file")
_CHUNK_BYTES = 1 << 20  # raw text per task: big enough to amortise pickling
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass
class PreprocessStats:
    documents: int
    tokens: int
    seconds: float
    skipped: int

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


# --------------------------------------------------------------------------- inputs


def _is_hf_dir(p: Path) -> bool:
    return p.is_dir() and any((p / m).is_file() for m in _HF_MARKERS)


def _format_of(p: Path, forced: str) -> str:
    if forced != "auto":
        return forced
    if _is_hf_dir(p):
        return "hf"
    name = p.name.lower()
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def expand_inputs(inputs: Iterable[str], fmt: str = "auto") -> list[tuple[Path, str]]:
    """Files (or HF dataset directories) with their formats, in a fixed order."""
    out: list[tuple[Path, str]] = []
    for spec in inputs:
        matches = sorted(glob.glob(os.path.expanduser(spec))) if glob.has_magic(spec) else [spec]
        if not matches:
            raise UserInputError(f"input {spec!r} matches no file; check the --input path")
        for m in matches:
            p = Path(m).expanduser()
            if not p.exists():
                raise UserInputError(f"input {p} does not exist; check the --input path")
            if p.is_dir() and not (fmt == "hf" or _is_hf_dir(p)):
                files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
                if not files:
                    raise UserInputError(f"input directory {p} holds no files")
                out.extend((f, _format_of(f, fmt)) for f in files)
            else:
                out.append((p, _format_of(p, fmt)))
    if not out:
        raise UserInputError("no input given: pass --input FILE [FILE ...]")
    return out


def _split_text(text: str, unit: str) -> list[str]:
    if unit == "file":
        return [text]
    if unit == "line":
        return [ln for ln in text.splitlines() if ln.strip()]
    return [p.strip("\n") for p in text.split("\n\n") if p.strip()]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise UserInputError(f"cannot read {path}: {e}") from None


def _parquet_texts(path: Path, key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserInputError(f"{path} is parquet, which needs pyarrow: pip install pyarrow") from None
    pf = pq.ParquetFile(path)
    if key not in pf.schema_arrow.names:
        raise UserInputError(f"{path} has no column {key!r} (columns: "
                             f"{', '.join(pf.schema_arrow.names)}); pass --json-key COLUMN")
    for batch in pf.iter_batches(columns=[key], batch_size=1024):
        yield from (t for t in batch.column(0).to_pylist() if t)


def _hf_texts(path: Path, key: str, split: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise UserInputError(f"{path} is a Hugging Face dataset, which needs the `datasets` "
                             "package: pip install datasets") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserInputError(f"{path} has splits {sorted(ds)}, not {split!r}; pass --split NAME")
        ds = ds[split]
    if key not in ds.column_names:
        raise UserInputError(f"{path} has no column {key!r} (columns: "
                             f"{', '.join(ds.column_names)}); pass --json-key COLUMN")
    col = ds.select_columns([key])
    for start in range(0, len(col), 1024):
        yield from (t for t in col[start:start + 1024][key] if t)


def iter_records(inputs: list[tuple[Path, str]], *, json_key: str, text_unit: str,
                 hf_split: str) -> Iterator[tuple[str, str]]:
    """``(kind, payload)`` per document: kind "json" is a raw line parsed by a worker."""
    for path, fmt in inputs:
        if fmt == "jsonl":
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.strip():
                        yield "json", line
        elif fmt == "parquet":
            yield from (("text", t) for t in _parquet_texts(path, json_key))
        elif fmt == "hf":
            yield from (("text", t) for t in _hf_texts(path, json_key, hf_split))
        elif fmt == "text":
            yield from (("text", t) for t in _split_text(_read_text(path), text_unit))
        else:
            raise UserInputError(f"unknown input format {fmt!r}; use one of {', '.join(FORMATS)}")


def _chunks(records: Iterator[tuple[str, str]], json_key: str) -> Iterator[tuple]:
    buf: list[tuple[str, str]] = []
    size = 0
    for rec in records:
        buf.append(rec)
        size += len(rec[1])
        if size >= _CHUNK_BYTES:
            yield (buf, json_key)
            buf, size = [], 0
    if buf:
        yield (buf, json_key)


# --------------------------------------------------------------------------- workers

_WORKER_TOK = None
_WORKER_THREADS = -1


def _init_worker(tokenizer_path: str, threads: int = -1) -> None:
    global _WORKER_TOK, _WORKER_THREADS  # one tokenizer per worker process, loaded once
    _WORKER_TOK = load_tokenizer(tokenizer_path)
    _WORKER_THREADS = threads


def _encode_chunk(task: tuple) -> tuple[np.ndarray, np.ndarray, int]:
    """Tokenize one chunk; returns (all tokens, per-document lengths, skipped)."""
    records, key = task
    texts: list[str] = []
    skipped = 0
    for kind, payload in records:
        if kind == "json":
            try:
                obj = json.loads(payload)
                text = obj[key]
            except (ValueError, KeyError, TypeError):
                skipped += 1
                continue
            if not isinstance(text, str) or not text:
                skipped += 1
                continue
            texts.append(text)
        else:
            texts.append(payload)
    tok = _WORKER_TOK
    if hasattr(tok, "encode_batch"):
        batch = tok.encode_batch(texts, num_threads=_WORKER_THREADS)
    else:
        batch = [tok.encode(t) for t in texts]
    eos = tok.eos_id
    lengths = np.fromiter((len(ids) + 1 for ids in batch), dtype=np.int64, count=len(batch))
    # the output's own dtype: a quarter of int64's bytes to ship back to the parent
    flat = np.empty(int(lengths.sum()), dtype=token_dtype(tok.vocab_size))
    pos = 0
    for ids in batch:
        flat[pos:pos + len(ids)] = ids
        pos += len(ids)
        flat[pos] = eos
        pos += 1
    return flat, lengths, skipped


# --------------------------------------------------------------------------- progress


class Progress:
    """Documents, tokens and tokens/s on stderr: a live line on a terminal, else a line every 10 s."""

    def __init__(self, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._last = self.t0

    def update(self, docs: int, tokens: int, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self._last < (0.5 if self.tty else 10.0):
            return
        self._last = now
        dt = max(now - self.t0, 1e-9)
        line = (f"preprocess: {docs:,} docs, {tokens:,} tokens, "
                f"{tokens / dt:,.0f} tokens/s, {dt:.1f}s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _pool_context():
    # fork keeps worker start-up at milliseconds; workers only run numpy and
    # the tokenizer, never torch, so inheriting the parent's state is safe.
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


def _ordered_bounded(pool, tasks: Iterator[tuple], window: int) -> Iterator:
    """Like ``pool.imap`` but with at most ``window`` chunks in flight.

    ``Pool.imap`` drains its input eagerly, which would pull a whole corpus
    into memory; this keeps memory flat and results in input order.
    """
    pending: deque = deque()
    for task in tasks:
        pending.append(pool.apply_async(_encode_chunk, (task,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def preprocess(inputs: Iterable[str], output_prefix: str | os.PathLike, tokenizer: str | os.PathLike,
               *, fmt: str = "auto", json_key: str = "text", text_unit: str = "paragraph",
               hf_split: str = "train", workers: int = 1, progress: bool = True) -> PreprocessStats:
    """Tokenize ``inputs`` into ``OUTPUT_PREFIX.bin`` / ``.idx``; returns counts and timing."""
    if fmt not in FORMATS:
        raise UserInputError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if text_unit not in TEXT_UNITS:
        raise UserInputError(f"--text-unit {text_unit!r} is not one of {', '.join(TEXT_UNITS)}")
    if workers < 1:
        raise UserInputError(f"--workers must be at least 1, got {workers}")
    files = expand_inputs(inputs, fmt)
    tok = load_tokenizer(tokenizer)  # fails early on a missing tokenizer
    tok_path = str(tokenizer)
    tasks = _chunks(iter_records(files, json_key=json_key, text_unit=text_unit,
                                 hf_split=hf_split), json_key)
    prog = Progress(progress)
    docs = skipped = 0
    with IndexedDatasetWriter(output_prefix, token_dtype(tok.vocab_size)) as writer:
        if workers == 1:
            _init_worker(tok_path)  # in-process: the tokenizer may use every core itself
            results: Iterable = map(_encode_chunk, tasks)
            pool = None
        else:
            # one thread per worker: the processes already fill the cores
            pool = _pool_context().Pool(workers, initializer=_init_worker, initargs=(tok_path, 1))
            results = _ordered_bounded(pool, tasks, 2 * workers)
        try:
            for flat, lengths, skip in results:
                writer.add_packed(flat, lengths)
                docs += len(lengths)
                skipped += skip
                prog.update(docs, writer.num_tokens)
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
        if docs == 0:
            raise UserInputError(f"no documents found in the input (skipped {skipped} records); "
                                 f"check --format and --json-key {json_key!r}")
    stats = PreprocessStats(docs, writer.num_tokens, time.perf_counter() - prog.t0, skipped)
    prog.update(docs, writer.num_tokens, final=True)
    return stats
