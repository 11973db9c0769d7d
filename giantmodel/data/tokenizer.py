"""Tokenizers behind one small interface: SentencePiece and Hugging Face ``tokenizer.json``.

:func:`load_tokenizer` picks the kind from the path: a ``.model`` file is
SentencePiece, a ``.json`` file is a Hugging Face ``tokenizers`` file, and a
directory is searched for ``tokenizer.model`` then ``tokenizer.json``.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from giantmodel.config.errors import UserInputError

# Tried in order when a tokenizer.json does not say which token ends a document.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and ``generate`` need from a tokenizer."""

    vocab_size: int
    eos_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class SentencePieceTokenizer:
    """A SentencePiece ``.model``; no BOS/EOS is added by ``encode``."""

    def __init__(self, path: str | os.PathLike | None = None, *, model_proto: bytes | None = None):
        import sentencepiece as spm

        self.path = os.fspath(path) if path is not None else None
        if model_proto is None:
            with open(self.path, "rb") as f:
                model_proto = f.read()
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError on junk
            raise UserInputError(f"{self.path} is not a valid SentencePiece model ({e}); "
                                 "train one with `giantmodel tokenizer train`") from None
        self.vocab_size = int(self._sp.get_piece_size())
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise UserInputError(f"SentencePiece model {self.path} has no EOS piece, which "
                                 "document packing needs; train it with an eos_id")
        self.eos_id = eos
        bos = int(self._sp.bos_id())
        self.bos_id = bos if bos >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
        """Encode many texts; SentencePiece spreads them over ``num_threads`` (-1: all cores)."""
        return self._sp.encode(texts, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_token(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's character range [start, end) in ``text``.

        SentencePiece encodes control pieces such as ``</s>`` as plain text, so
        the BOS/EOS piece strings are split out first and mapped to their ids,
        as chat templates that write ``eos_token`` into the text expect."""
        specials = {self.id_to_token(i): i for i in (self.bos_id, self.eos_id) if i is not None}
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        pattern = "|".join(re.escape(t) for t in specials)
        pos = 0
        for m in (re.finditer(pattern, text) if pattern else ()):
            self._encode_span(text, pos, m.start(), ids, offsets)
            ids.append(specials[m.group()])
            offsets.append((m.start(), m.end()))
            pos = m.end()
        self._encode_span(text, pos, len(text), ids, offsets)
        return ids, offsets

    def _encode_span(self, text: str, start: int, end: int, ids: list, offsets: list) -> None:
        if start >= end:
            return
        chunk = text[start:end]
        # Piece offsets are in UTF-8 bytes of the chunk; map them to characters.
        byte_to_char = np.zeros(len(chunk.encode("utf-8")) + 1, dtype=np.int64)
        b = 0
        for i, ch in enumerate(chunk):
            n = len(ch.encode("utf-8"))
            byte_to_char[b:b + n] = i
            b += n
        byte_to_char[b] = len(chunk)
        for piece in self._sp.encode(chunk, out_type="immutable_proto").pieces:
            ids.append(int(piece.id))
            offsets.append((start + int(byte_to_char[piece.begin]),
                            start + int(byte_to_char[piece.end])))


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package."""

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None):
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError:
            raise UserInputError(f"{path} is a Hugging Face tokenizer.json, which needs the "
                                 "`tokenizers` package: pip install 'giantmodel[hf]'") from None
        self.path = os.fspath(path)
        try:
            self._tok = _HFTok.from_file(self.path)
        except Exception as e:  # tokenizers raises its own Exception type on bad JSON
            raise UserInputError(f"{self.path} is not a valid tokenizer.json ({e})") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        cfg = self._sidecar_config()
        eos_name = eos_token or _token_name(cfg.get("eos_token"))
        bos_name = _token_name(cfg.get("bos_token"))
        eos = self._find(eos_name, _EOS_CANDIDATES)
        if eos is None:
            raise UserInputError(
                f"cannot tell which token of {self.path} ends a document: add eos_token to a "
                "tokenizer_config.json beside it, or give a tokenizer with one of "
                f"{', '.join(_EOS_CANDIDATES)}")
        self.eos_id = eos
        self.bos_id = self._find(bos_name, _BOS_CANDIDATES)

    def _sidecar_config(self) -> dict:
        p = Path(self.path).with_name("tokenizer_config.json")
        try:
            return json.loads(p.read_text()) if p.is_file() else {}
        except (OSError, ValueError):
            return {}

    def _find(self, name: str | None, candidates: tuple[str, ...]) -> int | None:
        for tok in ([name] if name else []) + list(candidates):
            tid = self._tok.token_to_id(tok)
            if tid is not None:
                return int(tid)
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
        # the tokenizers library sizes its own thread pool (RAYON_NUM_THREADS)
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id)) or ""

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's character range [start, end) in ``text``
        (special tokens written in the text become their ids, as in HF)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets


def _token_name(v) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def resolve_tokenizer_path(path: str | os.PathLike) -> Path:
    """The concrete tokenizer file for ``path``, or a UserInputError saying what to give."""
    p = Path(path).expanduser()
    fix = ("give a SentencePiece .model file, a Hugging Face tokenizer.json, or a directory "
           "holding one; train one with `giantmodel tokenizer train --input FILES "
           "--vocab-size N --out PREFIX`")
    if p.is_dir():
        for name in ("tokenizer.model", "tokenizer.json"):
            if (p / name).is_file():
                return p / name
        models = sorted(p.glob("*.model"))
        if len(models) == 1:
            return models[0]
        raise UserInputError(f"tokenizer directory {p} has no tokenizer.model or "
                             f"tokenizer.json; {fix}")
    if not p.is_file():
        raise UserInputError(f"tokenizer {p} does not exist; {fix}")
    return p


def load_tokenizer(path: str | os.PathLike) -> SentencePieceTokenizer | HFTokenizer:
    """Load the tokenizer at ``path`` (file or directory), checking it exists first."""
    p = resolve_tokenizer_path(path)
    if p.suffix == ".json":
        return HFTokenizer(p)
    return SentencePieceTokenizer(p)


def train_sentencepiece(lines: Iterable[str], out_prefix: str | os.PathLike, vocab_size: int,
                        *, model_type: str = "bpe", num_threads: int | None = None,
                        code_friendly: bool = True) -> Path:
    """Train a SentencePiece model on ``lines`` and write ``OUT_PREFIX.model``.

    ``code_friendly`` keeps text exactly as written (no NFKC, no whitespace
    folding), learns runs of spaces as pieces, makes ``\\n`` and ``\\t`` single
    tokens and falls back to bytes, so source code and prose round-trip
    through ``encode``/``decode`` unchanged. Training reads every line it is
    given (no sampling), so the result is deterministic.
    """
    import sentencepiece as spm

    if vocab_size < 300 and code_friendly:
        raise UserInputError(f"--vocab-size {vocab_size} is too small: byte fallback alone "
                             "takes 256 pieces; use at least 300")
    out = Path(f"{os.fspath(out_prefix)}.model")
    out.parent.mkdir(parents=True, exist_ok=True)
    opts = dict(vocab_size=vocab_size, model_type=model_type, unk_id=0, bos_id=1, eos_id=2,
                pad_id=-1, num_threads=num_threads or max(1, os.cpu_count() or 1),
                input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2,
                max_sentence_length=1 << 14, train_extremely_large_corpus=False)
    if code_friendly:
        opts.update(normalization_rule_name="identity", remove_extra_whitespaces=False,
                    byte_fallback=True, user_defined_symbols=["\n", "\t"],
                    allow_whitespace_only_pieces=True, split_digits=True,
                    character_coverage=0.9999)
    model = io.BytesIO()
    it: Iterator[str] = (ln for ln in lines if ln.strip())
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=it, model_writer=model, **opts)
    except RuntimeError as e:
        msg = str(e)
        if "Vocabulary size" in msg or "vocab_size" in msg:
            raise UserInputError(f"cannot train a {vocab_size}-piece tokenizer on this input "
                                 f"({msg.strip()}); lower --vocab-size or give more text") from None
        raise UserInputError(f"SentencePiece training failed: {msg.strip()}") from None
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.write_bytes(model.getvalue())
    os.replace(tmp, out)
    return out
