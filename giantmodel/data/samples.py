"""Sample sources: packed token windows, synthetic token ids, and weighted blends.

A *sample* is ``seq_len + 1`` consecutive token ids; the loader turns it into
``input_ids = sample[:-1]`` and ``labels = sample[1:]``. Every source is a
finite, indexable list of samples; :class:`BlendedSamples` turns one or more
of them into an endless, seed-determined sequence.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class SampleSource(Protocol):
    seq_len: int

    def __len__(self) -> int: ...

    def get(self, i: int) -> np.ndarray: ...


class PackedTokens:
    """Documents laid end to end (each already ends with EOS), cut into windows.

    Window ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``: consecutive
    windows share one token, so every token is predicted exactly once.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str = ""):
        self.tokens = tokens
        self.seq_len = seq_len
        self.name = name
        self._n = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self._n

    def get(self, i: int) -> np.ndarray:
        if not 0 <= i < self._n:
            raise IndexError(i)
        s = i * self.seq_len
        return self.tokens[s:s + self.seq_len + 1]


class SyntheticSamples:
    """Token ids made from ``(seed, index)`` alone: no files, any size.

    ``pattern="random"`` draws uniform ids (nothing to learn: loss stays at
    ln(vocab)); ``pattern="arithmetic"`` is ``(a + b*t) mod vocab`` with ``a``
    and ``b`` drawn per sample, which a model learns quickly.
    """

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, seed: int,
                 pattern: str = "arithmetic", stream: int = 0):
        self.vocab_size, self.seq_len, self.n = vocab_size, seq_len, num_samples
        self.seed, self.pattern, self.stream = seed, pattern, stream
        self.name = f"synthetic-{pattern}"

    def __len__(self) -> int:
        return self.n

    def get(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(i)
        rng = np.random.default_rng([self.seed, self.stream, i])
        if self.pattern == "random":
            return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int64)
        a = int(rng.integers(0, self.vocab_size))
        b = int(rng.integers(1, max(2, min(self.vocab_size, 17))))
        return (a + b * np.arange(self.seq_len + 1, dtype=np.int64)) % self.vocab_size


def blend_counts(weights: Sequence[float], total: int) -> np.ndarray:
    """Split ``total`` slots by ``weights`` (largest remainder), summing to ``total`` exactly."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    raw = w * total
    counts = np.floor(raw).astype(np.int64)
    short = total - int(counts.sum())
    if short:
        order = np.argsort(-(raw - counts), kind="stable")
        counts[order[:short]] += 1
    return counts


def interleave(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Spread each source's slots evenly over one period.

    Returns ``(source_of_slot, draw_of_slot)``: the k-th slot of source ``i``
    sits near position ``(k + 0.5) / counts[i]`` of the period, so any prefix
    of the blend holds each source in close to its weight.
    """
    keys, src, draw = [], [], []
    for i, c in enumerate(counts):
        c = int(c)
        if c == 0:
            continue
        k = np.arange(c, dtype=np.int64)
        keys.append((k + 0.5) / c)
        src.append(np.full(c, i, dtype=np.int32))
        draw.append(k)
    keys_a = np.concatenate(keys)
    order = np.argsort(keys_a, kind="stable")
    return np.concatenate(src)[order], np.concatenate(draw)[order]


class BlendedSamples:
    """An endless sample sequence drawn from weighted sources, fixed by ``seed``.

    One *period* has ``sum(len(source))`` slots, split among the sources by
    weight and interleaved evenly. Global index ``g`` falls in period
    ``g // period`` at slot ``g % period``; the source of that slot hands out
    its draws in order, and draw ``k`` of source ``i`` is sample
    ``perm(seed, i, k // len_i)[k % len_i]`` -- each source is reshuffled on
    every pass over it and wraps independently of the others.
    """

    def __init__(self, sources: Sequence[SampleSource], weights: Sequence[float] | None,
                 seed: int, shuffle: bool = True):
        self.sources = [s for s in sources]
        sizes = [len(s) for s in self.sources]
        if not self.sources or min(sizes) <= 0:
            raise ValueError("every blended source needs at least one sample")
        self.seq_len = self.sources[0].seq_len
        self.period = int(sum(sizes))
        self.weights = list(weights) if weights else [float(n) for n in sizes]
        self.counts = blend_counts(self.weights, self.period)
        self.slot_source, self.slot_draw = interleave(self.counts)
        self.seed, self.shuffle = seed, shuffle
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        """Samples per period (the sequence itself never ends)."""
        return self.period

    def _perm(self, src: int, epoch: int) -> np.ndarray:
        key = (src, epoch)
        perm = self._perms.get(key)
        if perm is None:
            n = len(self.sources[src])
            perm = np.random.default_rng([self.seed, src, epoch]).permutation(n)
            perm = perm.astype(np.int32 if n < 2**31 else np.int64)
            self._perms[key] = perm
            while len(self._perms) > 2 * len(self.sources) + 2:
                self._perms.popitem(last=False)
        return perm

    def locate(self, g: int) -> tuple[int, int]:
        """``(source, sample index in source)`` of global sample ``g``."""
        period, slot = divmod(g, self.period)
        src = int(self.slot_source[slot])
        draw = period * int(self.counts[src]) + int(self.slot_draw[slot])
        n = len(self.sources[src])
        epoch, pos = divmod(draw, n)
        if self.shuffle:
            pos = int(self._perm(src, epoch)[pos])
        return src, pos

    def get(self, g: int) -> np.ndarray:
        if g < 0:
            raise IndexError(g)
        src, pos = self.locate(g)
        return self.sources[src].get(pos)

    @property
    def packed(self) -> bool:
        """Whether samples hold several documents that must not attend to each other."""
        return any(getattr(s, "packed", False) for s in self.sources)

    def get_batch(self, start: int, count: int) -> np.ndarray:
        """Samples ``start .. start+count-1`` stacked as int64 ``[count, seq_len+1]``
        (``[count, 3, seq_len+1]`` for fine-tuning rows, see giantmodel.data.sft)."""
        first = self.get(start)
        out = np.empty((count,) + first.shape, dtype=np.int64)
        out[0] = first
        for j in range(1, count):
            out[j] = self.get(start + j)
        return out


def split_documents(num_docs: int, valid_fraction: float) -> int:
    """Number of leading documents that train; the rest validate."""
    if valid_fraction <= 0 or num_docs < 2:
        return num_docs
    n_valid = min(num_docs - 1, max(1, math.ceil(valid_fraction * num_docs)))
    return num_docs - n_valid
