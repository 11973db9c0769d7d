"""CLIP's byte-level BPE tokenizer, read from and written as a diffusers
``tokenizer/`` directory (``vocab.json``, ``merges.txt``,
``tokenizer_config.json``), with no dependency on transformers.

It gives the ids that transformers' ``CLIPTokenizer`` gives for the
pipeline's call (``padding="max_length"``, ``truncation=True``): start
token, BPE pieces, end token, then padding. :func:`build_word_tokenizer`
makes a small one whose every listed word is a single token, for models
trained from scratch on a closed caption vocabulary.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import unicodedata
from pathlib import Path

import torch

from giantmodel.config.errors import UserInputError

BOS, EOS = "<|startoftext|>", "<|endoftext|>"

try:  # the `regex` module knows Unicode classes; `re` needs an approximation
    import regex as _re
    _PATTERN = _re.compile(r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|"""
                           r"""[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""", _re.IGNORECASE)
except ImportError:  # pragma: no cover - regex ships with most Python installs
    import re as _re
    _PATTERN = _re.compile(r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|"""
                           r"""[^\W\d_]+|\d|(?:[^\s\w]|_)+""", _re.IGNORECASE)


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from bytes to printable characters."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


class CLIPTokenizer:
    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], max_length: int = 77,
                 pad_token: str = EOS):
        self.vocab = vocab
        self.merges = merges
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.max_length = max_length
        for tok in (BOS, EOS, pad_token):
            if tok not in vocab:
                raise UserInputError(f"tokenizer vocabulary has no {tok!r} token")
        self.pad_token = pad_token
        self.bos_id, self.eos_id, self.pad_id = vocab[BOS], vocab[EOS], vocab[pad_token]
        self.vocab_size = len(vocab)
        self._byte = bytes_to_unicode()
        self._cache: dict[str, list[str]] = {}
        self._inverse = {v: k for k, v in vocab.items()}

    # ----------------------------------------------------------------- BPE
    def _bpe(self, token: str) -> list[str]:
        if token in self._cache:
            return self._cache[token]
        word = list(token[:-1]) + [token[-1] + "</w>"]
        while len(word) > 1:
            pairs = {(a, b) for a, b in itertools.pairwise(word)}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        self._cache[token] = word
        return word

    def pieces(self, text: str) -> list[str]:
        text = unicodedata.normalize("NFC", text)
        text = _re.sub(r"\s+", " ", text).lower()
        out = []
        for token in _PATTERN.findall(text):
            if token in (BOS, EOS):
                out.append(token)
                continue
            out.extend(self._bpe("".join(self._byte[b] for b in token.encode("utf-8"))))
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without start/end tokens or padding."""
        unk = self.eos_id  # CLIP's unknown token is its end token
        return [self.vocab.get(p, unk) for p in self.pieces(text)]

    def __call__(self, texts: str | list[str]) -> torch.Tensor:
        """[N, max_length] ids: start, pieces (truncated), end, padding."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        rows = []
        for t in texts:
            ids = [self.bos_id] + self.encode(t)[: self.max_length - 2] + [self.eos_id]
            rows.append(ids + [self.pad_id] * (self.max_length - len(ids)))
        return torch.tensor(rows, dtype=torch.long)

    def decode(self, ids) -> str:
        inv_byte = {c: b for b, c in self._byte.items()}
        specials = (self.bos_id, self.eos_id, self.pad_id)
        text = "".join(self._inverse.get(int(i), "") for i in ids if int(i) not in specials)
        out = bytearray()
        for word in text.split("</w>"):
            out += bytes(inv_byte[c] for c in word if c in inv_byte) + b" "
        return out.decode("utf-8", "replace").strip()

    # ------------------------------------------------------------------ io
    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> CLIPTokenizer:
        p = Path(path)
        vocab_f, merges_f = p / "vocab.json", p / "merges.txt"
        for f in (vocab_f, merges_f):
            if not f.is_file():
                raise UserInputError(f"{f} is missing: a CLIP tokenizer directory needs "
                                     "vocab.json and merges.txt")
        try:
            vocab = json.loads(vocab_f.read_text(encoding="utf-8"))
            lines = merges_f.read_text(encoding="utf-8").split("\n")
        except (OSError, ValueError) as e:
            raise UserInputError(f"{p}: cannot read the tokenizer ({e})") from None
        merges = [tuple(ln.split()) for ln in lines
                  if ln.strip() and not ln.startswith("#version")]
        bad = [m for m in merges if len(m) != 2]
        if bad:
            raise UserInputError(f"{merges_f}: line {' '.join(bad[0])!r} is not a pair of symbols")
        conf = {}
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            f = p / name
            if f.is_file():
                try:
                    conf = {**json.loads(f.read_text(encoding="utf-8")), **conf}
                except ValueError as e:
                    raise UserInputError(f"{f}: not valid JSON ({e})") from None
        pad = conf.get("pad_token", EOS)
        pad = pad.get("content", EOS) if isinstance(pad, dict) else pad
        max_len = int(conf.get("model_max_length", 77))
        if max_len > 10**6:  # transformers' "no limit" sentinel
            max_len = 77
        return cls(vocab, merges, max_len, pad)

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        (p / "vocab.json").write_text(json.dumps(self.vocab, ensure_ascii=False), encoding="utf-8")
        (p / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in self.merges),
                                      encoding="utf-8")
        conf = {"tokenizer_class": "CLIPTokenizer", "model_max_length": self.max_length,
                "bos_token": BOS, "eos_token": EOS, "unk_token": EOS,
                "pad_token": self.pad_token, "do_lower_case": True,
                "clean_up_tokenization_spaces": True}
        (p / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
        special = {"bos_token": BOS, "eos_token": EOS, "unk_token": EOS, "pad_token": self.pad_token}
        (p / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
        return p


def build_word_tokenizer(words: list[str], max_length: int) -> CLIPTokenizer:
    """A CLIP tokenizer over the 512 byte symbols plus merges that make each
    of ``words`` a single token (anything else still tokenizes, by bytes)."""
    byte = bytes_to_unicode()
    symbols = list(byte.values())
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols])}
    tok = CLIPTokenizer({**vocab, BOS: len(vocab), EOS: len(vocab) + 1}, [], max_length)
    merges: list[tuple[str, str]] = []
    for word in dict.fromkeys(w.lower() for w in words):
        for piece in _PATTERN.findall(word):
            encoded = "".join(byte[b] for b in piece.encode("utf-8"))
            while True:
                tok._cache.clear()
                parts = tok._bpe(encoded)
                if len(parts) == 1:
                    break
                # merge the first two pieces; repeat until the word is one token
                merges.append((parts[0], parts[1]))
                vocab.setdefault(parts[0] + parts[1], len(vocab))
                tok = CLIPTokenizer({**vocab, BOS: len(vocab), EOS: len(vocab) + 1}, merges,
                                    max_length)
    return CLIPTokenizer({**vocab, BOS: len(vocab), EOS: len(vocab) + 1}, merges, max_length)
