"""Supervised fine-tuning data (``data.source: sft``): conversations in, packed
or padded training rows out.

Inputs are jsonl (or .json list) files, or Hugging Face datasets saved with
``save_to_disk``, holding one of three record formats:

* alpaca: ``{"instruction", "input"?, "output", "system"?}``;
* chat messages: ``{"messages": [{"role", "content"}, ...]}`` (OpenAI style);
* ShareGPT: ``{"conversations": [{"from", "value"}, ...]}``.

Each record becomes a message list, is rendered by the chat template
(:mod:`giantmodel.data.chat`) and tokenized with a loss mask. A *row* is an
int64 array ``[3, seq_len + 1]``: token ids, labels (the token where it
carries loss, else ``IGNORE_INDEX``) and document ids (which example each
token belongs to; -1 for padding). The loader turns rows into
``input_ids = tokens[:-1]``, ``labels = labels[1:]`` and, for packed rows,
``document_ids`` and ``position_ids`` that restart at every example.

An example's first token never carries loss (nothing predicts it), so the
shift never makes one example predict the next across a packing boundary.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from giantmodel.config.errors import ConfigError, UserInputError
from giantmodel.core.loss import IGNORE_INDEX
from giantmodel.data.chat import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    encode_conversation,
    resolve_template,
    template_error,
)
from giantmodel.data.conversations import load_conversations, read_records, to_messages
from giantmodel.data.samples import split_documents
from giantmodel.data.sft_builtin import (
    BUILTIN_PREFIX,
    ensure_tiny_chat_model,
    resolve_model_dir,
    tiny_instructions,
)
from giantmodel.data.tokenizer import load_tokenizer

PAD_DOCUMENT = -1

# --------------------------------------------------------------------------- examples -> rows

@dataclass
class SFTStats:
    """What happened to the examples on their way to rows (reported at start)."""

    examples: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_response: int = 0
    rows: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    seq_len: int = 0
    packed: bool = False
    template: str = ""
    notes: list[str] = field(default_factory=list)

    def summary(self, name: str) -> str:
        cap = self.rows * (self.seq_len + 1)
        parts = [f"sft {name}: {self.kept}/{self.examples} examples ({self.template} template)"]
        if self.truncated:
            parts.append(f"{self.truncated} truncated to {self.seq_len + 1} tokens")
        if self.dropped_too_long:
            parts.append(f"{self.dropped_too_long} dropped as longer than {self.seq_len + 1} "
                         "tokens")
        if self.dropped_no_response:
            parts.append(f"{self.dropped_no_response} dropped with no response tokens")
        parts.append(f"{self.rows} {'packed' if self.packed else 'padded'} rows, "
                     f"{self.tokens / max(cap, 1):.0%} filled, "
                     f"{self.loss_tokens / max(self.tokens, 1):.0%} of tokens carry loss")
        return "; ".join(parts)


def tokenize_examples(conversations: list[list[dict]], tokenizer, template: ChatTemplate,
                      mask_prompt: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    return [encode_conversation(tokenizer, template, c, mask_prompt) for c in conversations]


def fit_examples(examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, truncate: bool,
                 stats: SFTStats) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cut (or drop) examples longer than ``seq_len + 1`` tokens; drop those
    left with no loss token after the first (nothing to learn)."""
    cap = seq_len + 1
    out = []
    for ids, mask in examples:
        stats.examples += 1
        if len(ids) > cap:
            if not truncate:
                stats.dropped_too_long += 1
                continue
            ids, mask = ids[:cap], mask[:cap]
            stats.truncated += 1
        if len(ids) < 2 or not mask[1:].any():
            stats.dropped_no_response += 1
            continue
        out.append((ids, mask))
    stats.kept = len(out)
    return out


def build_rows(examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pack: bool,
               pad_id: int, stats: SFTStats) -> np.ndarray:
    """int64 ``[N, 3, seq_len + 1]`` rows: one example per row, padded; or
    examples laid end to end in order, a new row starting when the next one
    does not fit (every example is at most ``seq_len + 1`` tokens)."""
    cap = seq_len + 1
    groups: list[list[int]] = []
    used = cap
    for i, (ids, _) in enumerate(examples):
        if not pack or used + len(ids) > cap:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += len(ids)
    rows = np.empty((len(groups), 3, cap), dtype=np.int64)
    rows[:, 0] = pad_id
    rows[:, 1] = IGNORE_INDEX
    rows[:, 2] = PAD_DOCUMENT
    for r, group in enumerate(groups):
        pos = 0
        for doc, i in enumerate(group):
            ids, mask = examples[i]
            n = len(ids)
            labels = np.where(mask, ids, IGNORE_INDEX)
            labels[0] = IGNORE_INDEX  # never predicted, and keeps examples apart
            rows[r, 0, pos:pos + n] = ids
            rows[r, 1, pos:pos + n] = labels
            rows[r, 2, pos:pos + n] = doc
            pos += n
    stats.rows, stats.seq_len, stats.packed = len(groups), seq_len, pack
    stats.tokens = int(sum(len(ids) for ids, _ in examples))
    stats.loss_tokens = int((rows[:, 1, 1:] != IGNORE_INDEX).sum())
    return rows


class SFTRows:
    """Fine-tuning rows as a sample source for :class:`BlendedSamples`."""

    def __init__(self, rows: np.ndarray, seq_len: int, packed: bool, name: str = "sft"):
        self.rows, self.seq_len, self.packed, self.name = rows, seq_len, packed, name

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self.rows):
            raise IndexError(i)
        return self.rows[i]


# --------------------------------------------------------------------------- config entry

def sft_tokenizer_path(cfg, init_from: str | None = None) -> str:
    """``data.tokenizer``, else the tokenizer beside the initial weights
    (``checkpoint.init_from``), else the bundled tiny chat tokenizer."""
    if cfg.tokenizer:
        return cfg.tokenizer
    if init_from:
        d = resolve_model_dir(init_from, cfg)
        if (d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file():
            return str(d)
        raise ConfigError(f"checkpoint.init_from {init_from} has no tokenizer.json or "
                          "tokenizer.model; set data.tokenizer", key="data.tokenizer")
    return str(ensure_tiny_chat_model(cfg.resolved_cache_dir()))


def sft_template(cfg, tokenizer, tokenizer_path: str) -> ChatTemplate:
    try:
        return resolve_template(cfg.chat_template, tokenizer, tokenizer_path)
    except UserInputError as e:
        raise ConfigError(str(e), key="data.chat_template") from None


def sft_conversations(cfg) -> tuple[list[list[dict]], list[list[dict]]]:
    """Training and validation conversations: ``data.paths`` (the last
    ``valid_fraction`` held out unless ``data.valid_paths`` is set), or the
    bundled tiny instruction set when ``data.paths`` is empty."""
    if not cfg.paths:
        train, valid = tiny_instructions()
        return ([to_messages(r, "auto", f"bundled record {i}") for i, r in enumerate(train)],
                [to_messages(r, "auto", f"bundled valid {i}") for i, r in enumerate(valid)])
    train = load_conversations(cfg.paths, cfg.format)
    if cfg.valid_paths:
        return train, load_conversations(cfg.valid_paths, cfg.format)
    n = split_documents(len(train), cfg.valid_fraction)
    return train[:n], train[n:]


def build_sft_sources(cfg, *, seq_len: int, init_from: str | None = None,
                      report: bool = True) -> tuple[SFTRows, SFTRows | None]:
    """Training and validation rows for a DataConfig with source "sft"."""
    tok_path = sft_tokenizer_path(cfg, init_from)
    tok = load_tokenizer(tok_path)
    template = sft_template(cfg, tok, tok_path)
    train_conv, valid_conv = sft_conversations(cfg)
    out = []
    for name, convs in (("train", train_conv), ("valid", valid_conv)):
        stats = SFTStats(template=template.name)
        examples = fit_examples(tokenize_examples(convs, tok, template, cfg.mask_prompt),
                                seq_len, cfg.truncate, stats)
        if not examples:
            out.append(None)
            if name == "train":
                raise ConfigError(f"no usable SFT examples ({stats.examples} read; "
                                  f"{stats.dropped_too_long} longer than train.seq_len+1, "
                                  f"{stats.dropped_no_response} with no response tokens)",
                                  key="data.paths")
            continue
        rows = build_rows(examples, seq_len, cfg.pack, tok.eos_id, stats)
        if report and os.environ.get("RANK", "0") == "0":
            print("giantmodel: " + stats.summary(name), file=sys.stderr, flush=True)
        src = SFTRows(rows, seq_len, cfg.pack, name=f"sft-{name}")
        src.stats = stats
        out.append(src)
    return out[0], out[1]


def prepare_sft(job) -> None:
    """Pre-flight for a job: ``checkpoint.init_from: builtin:tiny-chat`` becomes
    the built model's directory and, for source "sft", an unset
    ``data.tokenizer`` becomes the one beside the initial weights, so the
    resolved config (and ``generate`` later) names concrete paths."""
    init = job.checkpoint.init_from
    if init and init.startswith(BUILTIN_PREFIX):
        job.checkpoint.init_from = str(resolve_model_dir(init, job.data))
    if job.data.source == "sft":
        job.data.tokenizer = sft_tokenizer_path(job.data, job.checkpoint.init_from)
        check_sft(job.data)


def check_sft(cfg) -> None:
    """Pre-flight: every record of every file parses into valid messages, and
    the named template exists (no tokenizer needed)."""
    for key, paths in (("data.paths", cfg.paths), ("data.valid_paths", cfg.valid_paths)):
        for p in paths:
            try:
                for where, rec in read_records(p):
                    to_messages(rec, cfg.format, where)
            except UserInputError as e:
                raise ConfigError(str(e), key=key) from None
    t = cfg.chat_template
    named = t == "auto" or t in BUILTIN_TEMPLATES or "{{" in t or "{%" in t
    if not named and not Path(t).expanduser().is_file():
        raise ConfigError(template_error(t), key="data.chat_template")
