"""Preference data (``data.source: preference``): pairs of a chosen and a
rejected answer to one prompt, in TRL's standard forms, as adjacent rows.

Records (jsonl, json or Hugging Face datasets saved with ``save_to_disk``):

* standard: ``{"prompt": str, "chosen": str, "rejected": str}``; the texts
  are tokenized as they are, EOS closing each answer (TRL applies no
  template to them either);
* conversational: ``chosen`` and ``rejected`` are message lists, with an
  explicit ``prompt`` message list, or none (then the longest common prefix
  of the two lists is the prompt). They are rendered with the chat template
  (:mod:`giantmodel.data.chat`): the prompt with the generation prompt, each
  answer as the rest of the whole conversation's text.

As in TRL's ``DPOTrainer`` (1.x), each prompt + answer is tokenized whole
and only answer tokens are scored (:func:`tokenize_pair`). Truncation
follows TRL: a sequence over ``max_length`` keeps its start (``keep_start``,
TRL's default, cutting the answer's end) or its end (``keep_end``, cutting
the prompt's start); TRL 0.x's ``max_prompt_length`` (the prompt keeps its
last tokens) and ``max_completion_length`` (an answer keeps its first) are
applied first when set. Every cut is counted; an answer left with no token
fails, naming the record (TRL 1.x silently drops such pairs).

A *pair row* is int64 ``[2, 3, seq_len + 1]``: the chosen row and the
rejected row, each holding tokens, labels and document ids as an SFT row
(:mod:`giantmodel.data.sft`). Pair ``d`` of a pair row has document id ``d``
in both rows, so one forward over a micro-batch covers both answers of every
pair, the rows of a pair stay adjacent through pipeline micro-batches, and
packing (``data.pack``) lays several pairs along the same two rows with
attention kept within each one.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

from giantmodel.config.errors import ConfigError, UserInputError
from giantmodel.core.loss import IGNORE_INDEX
from giantmodel.data.chat import ROLES, ChatTemplate, token_string
from giantmodel.data.conversations import read_records
from giantmodel.data.samples import BlendedSamples, split_documents
from giantmodel.data.sft import PAD_DOCUMENT, SFTRows

Text = str | list  # a string, or a list of {"role", "content"} messages


@dataclass
class Truncation:
    """TRL's truncation settings (``dpo.*``), in tokens."""

    max_length: int
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    mode: str = "keep_end"


@dataclass
class PreferenceStats:
    """What happened to the pairs on their way to rows (printed at start)."""

    pairs: int = 0
    prompts_truncated: int = 0
    answers_truncated: int = 0
    sequences_truncated: int = 0
    pair_rows: int = 0
    tokens: int = 0
    packed: bool = False

    def summary(self, name: str) -> str:
        return (f"preference {name}: {self.pairs} pairs in {self.pair_rows} "
                f"{'packed' if self.packed else 'padded'} pair rows; truncated: "
                f"{self.prompts_truncated} prompts (max_prompt_length), "
                f"{self.answers_truncated} answers (max_completion_length), "
                f"{self.sequences_truncated} sequences (max_length)")


# --------------------------------------------------------------------------- records

def _messages(value, where: str, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise UserInputError(f"{where}: {key!r} must be a non-empty list of messages")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserInputError(f"{where}: {key} message {j} needs 'role' and 'content'")
        if m["role"] not in ROLES or not isinstance(m["content"], str):
            raise UserInputError(f"{where}: {key} message {j} has role {m['role']!r} or a "
                                 f"non-string content; roles are {', '.join(ROLES)}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def parse_record(rec, where: str) -> tuple[Text, Text, Text]:
    """(prompt, chosen, rejected) of a record: three strings, or three
    message lists (an implicit prompt split off as the common prefix)."""
    if not isinstance(rec, dict):
        raise UserInputError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    for key in ("chosen", "rejected"):
        if key not in rec:
            raise UserInputError(f"{where}: preference record has no {key!r}; each record needs "
                                 "'chosen' and 'rejected' (and 'prompt', or message lists that "
                                 "share one)")
    chosen, rejected, prompt = rec["chosen"], rec["rejected"], rec.get("prompt")
    if isinstance(chosen, str) or isinstance(rejected, str):
        if not (isinstance(chosen, str) and isinstance(rejected, str)):
            raise UserInputError(f"{where}: 'chosen' and 'rejected' must both be strings or "
                                 "both message lists")
        if not isinstance(prompt, str):
            raise UserInputError(f"{where}: a standard preference record needs a string "
                                 "'prompt' beside string 'chosen' and 'rejected'")
        return prompt, chosen, rejected
    chosen, rejected = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
    if prompt is None:
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise UserInputError(f"{where}: no 'prompt' and 'chosen'/'rejected' share no "
                                 "leading messages; give a 'prompt' message list")
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    else:
        prompt = _messages(prompt, where, "prompt")
    return prompt, chosen, rejected


def read_pairs(paths: list[str]) -> list[tuple[str, tuple[Text, Text, Text]]]:
    """Every record of ``paths`` as ``(where, (prompt, chosen, rejected))``."""
    return [(where, parse_record(rec, where)) for p in paths for where, rec in read_records(p)]


# --------------------------------------------------------------------------- tokens

def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(tokenizer, template: ChatTemplate | None, pair: tuple[Text, Text, Text],
                  where: str) -> tuple[list[int], list[int], list[int]]:
    """Token ids of the prompt, the chosen and the rejected answer, as TRL's
    ``DPOTrainer`` makes them: each whole sequence (prompt + answer) is
    tokenized at once -- a string one with EOS appended to the answer, a
    conversational one rendered by the chat template (whose end-of-turn
    closes the answer) -- and the answer starts where it stops sharing
    tokens with the prompt tokenized alone (with the generation prompt)."""
    prompt, chosen, rejected = pair
    if isinstance(prompt, str):
        eos = token_string(tokenizer, tokenizer.eos_id)
        prompt_ids = list(tokenizer.encode(prompt))
        full = [list(tokenizer.encode(prompt + (a if a.endswith(eos) else a + eos)))
                for a in (chosen, rejected)]
    else:
        if template is None:
            raise UserInputError(f"{where}: a conversational record needs a chat template")
        prompt_ids = list(tokenizer.encode(template.prompt(prompt)))
        full = [list(tokenizer.encode(template.render(prompt + a).text))
                for a in (chosen, rejected)]
    n = min(_common_prefix(prompt_ids, full[0]), _common_prefix(prompt_ids, full[1]))
    return prompt_ids[:n], full[0][n:], full[1][n:]


def truncate_pair(prompt: list[int], chosen: list[int], rejected: list[int], t: Truncation,
                  stats: PreferenceStats, where: str
                  ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((ids, answer mask), ...) of the chosen and the rejected sequence after
    TRL's truncation; raises naming ``where`` when an answer is left empty."""
    if t.max_prompt_length is not None and len(prompt) > t.max_prompt_length:
        prompt = prompt[-t.max_prompt_length:]
        stats.prompts_truncated += 1
    out = []
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if t.max_completion_length is not None and len(answer) > t.max_completion_length:
            answer = answer[:t.max_completion_length]
            stats.answers_truncated += 1
        ids = np.asarray(prompt + answer, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=bool)
        mask[len(prompt):] = True
        if len(ids) > t.max_length:
            stats.sequences_truncated += 1
            keep = slice(-t.max_length, None) if t.mode == "keep_end" else slice(t.max_length)
            ids, mask = ids[keep], mask[keep]
        # The first token is never predicted, so it cannot be scored.
        if not mask[1:].any():
            raise UserInputError(f"{where}: the {name} answer is empty after truncation "
                                 f"(prompt {len(prompt)} tokens, max_length {t.max_length}, "
                                 f"truncation_mode {t.mode}); raise dpo.max_length or lower "
                                 "dpo.max_prompt_length")
        out.append((ids, mask))
    return out[0], out[1]


def build_pair_rows(pairs: list[tuple], seq_len: int, pack: bool, pad_id: int,
                    stats: PreferenceStats) -> np.ndarray:
    """int64 ``[N, 2, 3, seq_len + 1]``: one pair per pair row, padded; or
    pairs laid end to end along both rows, a new pair row starting when the
    next pair's chosen or rejected sequence does not fit."""
    cap = seq_len + 1
    groups: list[list[int]] = []
    used = [cap, cap]
    for i, pair in enumerate(pairs):
        lens = [len(pair[0][0]), len(pair[1][0])]
        if not pack or used[0] + lens[0] > cap or used[1] + lens[1] > cap:
            groups.append([])
            used = [0, 0]
        groups[-1].append(i)
        used = [used[0] + lens[0], used[1] + lens[1]]
    rows = np.empty((len(groups), 2, 3, cap), dtype=np.int64)
    rows[:, :, 0], rows[:, :, 1], rows[:, :, 2] = pad_id, IGNORE_INDEX, PAD_DOCUMENT
    for g, group in enumerate(groups):
        pos = [0, 0]
        for doc, i in enumerate(group):
            for side in (0, 1):
                ids, mask = pairs[i][side]
                n, at = len(ids), pos[side]
                labels = np.where(mask, ids, IGNORE_INDEX)
                labels[0] = IGNORE_INDEX  # never predicted, and keeps pairs apart
                rows[g, side, 0, at:at + n] = ids
                rows[g, side, 1, at:at + n] = labels
                rows[g, side, 2, at:at + n] = doc
                pos[side] += n
    stats.pair_rows, stats.packed = len(groups), pack
    stats.tokens = int(sum(len(p[0][0]) + len(p[1][0]) for p in pairs))
    return rows


class PreferenceRows(SFTRows):
    """Pair rows as a sample source for :class:`BlendedSamples` (each row holds
    a pair's chosen and rejected sides; served like fine-tuning rows)."""

    def __init__(self, rows: np.ndarray, seq_len: int, packed: bool, name: str = "preference"):
        super().__init__(rows, seq_len, packed, name)


class PairSamples:
    """A :class:`BlendedSamples` of pair rows whose batches are plain rows:
    ``get_batch`` gives ``[2 * count, 3, seq_len + 1]``, chosen then rejected
    for each pair row, so the loaders' row-to-batch code serves them as is;
    ``micro_batch_size`` counts pair rows. Document ids always travel
    (``packed``): they say which sequence of a row each token belongs to."""

    packed = True

    def __init__(self, blended: BlendedSamples):
        self.blended = blended
        self.seq_len = blended.seq_len

    def __len__(self) -> int:
        return len(self.blended)

    def get(self, g: int) -> np.ndarray:
        return self.blended.get(g)

    def get_batch(self, start: int, count: int) -> np.ndarray:
        pairs = self.blended.get_batch(start, count)  # [count, 2, 3, T + 1]
        return pairs.reshape((2 * count,) + pairs.shape[2:])


# --------------------------------------------------------------------------- entry

def build_preference_rows(records: list[tuple[str, tuple]], tokenizer,
                          template: ChatTemplate | None, seq_len: int, pack: bool,
                          truncation: Truncation, name: str, report: bool = True
                          ) -> PreferenceRows:
    stats = PreferenceStats(pairs=len(records))
    pairs = [truncate_pair(*tokenize_pair(tokenizer, template, pair, where), truncation,
                           stats, where) for where, pair in records]
    rows = build_pair_rows(pairs, seq_len, pack, tokenizer.eos_id, stats)
    if report and os.environ.get("RANK", "0") == "0":
        print("giantmodel: " + stats.summary(name), file=sys.stderr, flush=True)
    src = PreferenceRows(rows, seq_len, pack, name=f"preference-{name}")
    src.stats = stats
    return src


def preference_records(cfg, bundled) -> tuple[list, list]:
    """Training and validation records: ``data.paths`` (the last
    ``valid_fraction`` held out unless ``data.valid_paths`` is set), or
    ``bundled()`` -- (train, valid) record lists -- when it is empty."""
    try:
        if not cfg.paths:
            train, valid = bundled()
            return ([(f"bundled pair {i}", parse_record(r, f"bundled pair {i}"))
                     for i, r in enumerate(train)],
                    [(f"bundled valid {i}", parse_record(r, f"bundled valid {i}"))
                     for i, r in enumerate(valid)])
        train = read_pairs(cfg.paths)
        if cfg.valid_paths:
            return train, read_pairs(cfg.valid_paths)
    except UserInputError as e:
        raise ConfigError(str(e), key="data.paths") from None
    n = split_documents(len(train), cfg.valid_fraction)
    return train[:n], train[n:]
