"""Megatron-LM's memory-mapped indexed dataset: a ``.bin`` of tokens plus an ``.idx``.

The layout is written from the format's public description so that corpora
preprocessed by Megatron-LM (``tools/preprocess_data.py``) load unchanged, and
ours load in Megatron-LM.

``PREFIX.idx`` (all integers little-endian)::

    offset  size              field
    0       9                 magic  b"MMIDIDX\\x00\\x00"
    9       8  uint64         version (1)
    17      1  uint8          dtype code of the tokens in .bin (see DTYPE_CODES)
    18      8  uint64         S = sequence count
    26      8  uint64         D = document-index count (documents + 1)
    34      4*S int32         sequence lengths, in tokens
    ..      8*S int64         sequence pointers, byte offsets into .bin
    ..      8*D int64         document indices: document d spans sequences
                              [doc[d], doc[d+1]); doc[0] == 0, doc[-1] == S

``PREFIX.bin`` is the token arrays back to back. Megatron-LM stores one
sequence per document unless sentences were split; we always write one.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from giantmodel.config.errors import UserInputError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest token dtype Megatron-LM would pick for this vocabulary."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def _missing_fix(prefix: str) -> str:
    return (f"give the path prefix without the extension (PREFIX for PREFIX.bin and "
            f"PREFIX.idx), or create it with `giantmodel preprocess --output-prefix {prefix}`")


class IndexedDatasetWriter:
    """Streams documents into ``PREFIX.bin`` and writes ``PREFIX.idx`` on close.

    Both files are written under temporary names and renamed at the end, so an
    interrupted run never leaves a pair that looks complete.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.uint16):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = Path(f"{self.prefix}.bin.tmp{os.getpid()}")
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self.num_tokens = 0
        self._closed = False

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.append(int(arr.size))
        self.num_tokens += int(arr.size)

    def add_packed(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many documents at once: ``tokens`` is their concatenation."""
        arr = np.ascontiguousarray(tokens, dtype=self.dtype)
        if int(np.sum(lengths)) != arr.size:
            raise ValueError("document lengths do not add up to the token count")
        self._bin.write(arr.tobytes())
        self._lengths.extend(int(n) for n in lengths)
        self.num_tokens += int(arr.size)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_index = np.arange(len(lengths) + 1, dtype=np.int64)
        idx_tmp = Path(f"{self.prefix}.idx.tmp{os.getpid()}")
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", _CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(doc_index)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_index.tobytes())
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        """Drop the partial output (used when the producer fails)."""
        self._closed = True
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def read_index_header(prefix: str | os.PathLike) -> dict:
    """Parse and check ``PREFIX.idx`` against its own length and ``PREFIX.bin``.

    Raises :class:`UserInputError` naming the file when anything is missing,
    truncated or inconsistent; a training run must never start on such a file.
    """
    prefix = os.fspath(prefix)
    ip, bp = idx_path(prefix), bin_path(prefix)
    for p in (ip, bp):
        if not p.is_file():
            raise UserInputError(f"indexed dataset file {p} does not exist; {_missing_fix(prefix)}")
    size = ip.stat().st_size
    redo = f"; re-create it with `giantmodel preprocess --output-prefix {prefix}`"
    with open(ip, "rb") as f:
        head = f.read(HEADER_SIZE)
    if len(head) < HEADER_SIZE:
        raise UserInputError(f"{ip} is truncated: {size} bytes, shorter than the "
                             f"{HEADER_SIZE}-byte header{redo}")
    if head[:9] != MAGIC:
        raise UserInputError(f"{ip} is not a Megatron-LM indexed dataset index (magic "
                             f"{head[:9]!r}, expected {MAGIC!r}){redo}")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != VERSION:
        raise UserInputError(f"{ip} has index version {version}; only version {VERSION} is supported")
    if code not in DTYPE_CODES:
        raise UserInputError(f"{ip} has unknown token dtype code {code}{redo}")
    expected = HEADER_SIZE + n_seq * (4 + 8) + n_doc * 8
    if size < expected:
        raise UserInputError(f"{ip} is truncated: {size} bytes, but its header announces "
                             f"{n_seq} sequences and {n_doc} document indices "
                             f"({expected} bytes){redo}")
    return {"dtype": DTYPE_CODES[code], "num_sequences": n_seq, "num_doc_indices": n_doc,
            "index_bytes": expected, "index_file_bytes": size}


class IndexedDataset:
    """Read-only, memory-mapped view of a Megatron-LM indexed dataset.

    ``ds[i]`` is sequence ``i`` as a numpy array (a view into the mapping).
    ``tokens`` is the whole ``.bin`` as one flat array, which packing uses when
    the sequences are stored back to back (always true for files written by
    Megatron-LM's tools and by us).
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        hdr = read_index_header(self.prefix)
        self.dtype: np.dtype = hdr["dtype"]
        n_seq, n_doc = hdr["num_sequences"], hdr["num_doc_indices"]
        idx = np.memmap(idx_path(self.prefix), dtype=np.uint8, mode="r")
        off = HEADER_SIZE
        self.lengths = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=off)
        off += 4 * n_seq
        self.pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=off)
        off += 8 * n_seq
        self.doc_index = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=off)
        self._idx = idx
        bsize = bin_path(self.prefix).stat().st_size
        self._check(bsize)
        if bsize == 0:
            self.tokens = np.zeros(0, dtype=self.dtype)
        else:
            self.tokens = np.memmap(bin_path(self.prefix), dtype=self.dtype, mode="r",
                                    shape=(bsize // self.dtype.itemsize,))

    def _check(self, bin_bytes: int) -> None:
        ip = idx_path(self.prefix)
        redo = f"; re-create it with `giantmodel preprocess --output-prefix {self.prefix}`"
        n = len(self.lengths)
        if len(self.doc_index) == 0 or self.doc_index[0] != 0 or self.doc_index[-1] != n:
            raise UserInputError(f"{ip} is corrupt: its document indices do not run from 0 "
                                 f"to the sequence count {n}{redo}")
        if n and (self.lengths.min() < 0 or self.pointers.min() < 0):
            raise UserInputError(f"{ip} is corrupt: negative sequence lengths or pointers{redo}")
        end = int(self.pointers[-1]) + int(self.lengths[-1]) * self.dtype.itemsize if n else 0
        if end > bin_bytes:
            raise UserInputError(f"{bin_path(self.prefix)} is truncated: {bin_bytes} bytes, but "
                                 f"{ip} points up to byte {end}{redo}")

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.lengths[i])]

    @property
    def num_documents(self) -> int:
        return len(self.doc_index) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def document_token_range(self, first_doc: int, last_doc: int) -> tuple[int, int]:
        """Token offsets ``[start, end)`` in ``tokens`` of documents ``[first, last)``.

        Requires the sequences of that range to be stored contiguously, which
        is checked, because packing reads the range as one slice.
        """
        s0, s1 = int(self.doc_index[first_doc]), int(self.doc_index[last_doc])
        if s1 <= s0:
            return 0, 0
        item = self.dtype.itemsize
        ptr = self.pointers[s0:s1]
        lens = self.lengths[s0:s1].astype(np.int64)
        if np.any(ptr[1:] != ptr[:-1] + lens[:-1] * item):
            raise UserInputError(
                f"{idx_path(self.prefix)}: sequences are not stored back to back in "
                f"{bin_path(self.prefix)}, which packing requires; re-create the dataset with "
                "`giantmodel preprocess`")
        start = int(ptr[0]) // item
        return start, start + int(lens.sum())


# A full pass over a .bin this size or smaller finds every out-of-range token
# id before training starts; larger ones are sampled here (their head, tail
# and evenly spaced windows) and checked completely as samples are read.
FULL_SCAN_TOKENS = 1 << 30
_SCAN_CHUNK = 1 << 24


def _scan_windows(n: int) -> list[tuple[int, int]]:
    if n <= FULL_SCAN_TOKENS:
        return [(s, min(n, s + _SCAN_CHUNK)) for s in range(0, n, _SCAN_CHUNK)]
    head = [(0, _SCAN_CHUNK * 8), (n - _SCAN_CHUNK * 8, n)]
    step = n // 64
    return head + [(i * step, min(n, i * step + _SCAN_CHUNK)) for i in range(64)]


def check_token_ids(prefix: str | os.PathLike, vocab_size: int) -> None:
    """Raise :class:`UserInputError` naming ``PREFIX.bin`` if it stores a
    token id outside ``[0, vocab_size)``, or tokens of a non-integer dtype."""
    ds = IndexedDataset(prefix)  # also checks the .idx and the .bin's length
    bp = bin_path(ds.prefix)
    if ds.dtype.kind not in "iu":
        raise UserInputError(f"{idx_path(ds.prefix)} declares {ds.dtype} tokens (dtype code "
                             f"{_CODE_OF[ds.dtype]}); token ids must be integers: the file was "
                             "written by another tool or is corrupt")
    for start, end in _scan_windows(len(ds.tokens)):
        chunk = np.asarray(ds.tokens[start:end])
        if chunk.size == 0:
            continue
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo < 0 or hi >= vocab_size:
            bad = int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
            raise UserInputError(
                f"{bp} holds token id {int(chunk[bad])} at token {start + bad}, outside the "
                f"tokenizer's vocabulary [0, {vocab_size}): the data was made with another "
                "tokenizer than data.tokenizer, or is corrupt")
