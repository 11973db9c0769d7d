"""Fine-tuning records as conversations: the three record formats of
``data.source: sft`` read from jsonl/json files or Hugging Face datasets
saved with ``save_to_disk``, each turned into ``[{"role", "content"}, ...]``.

* alpaca: ``{"instruction", "input"?, "output", "system"?}``;
* chat messages: ``{"messages": [{"role", "content"}, ...]}`` (OpenAI style);
* ShareGPT: ``{"conversations": [{"from", "value"}, ...]}``.

Malformed input raises :class:`UserInputError` naming the file and line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from giantmodel.config.errors import UserInputError
from giantmodel.data.chat import ROLES

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "model": "assistant", "chatgpt": "assistant", "bing": "assistant",
                   "system": "system", "tool": "tool", "function_call": "assistant",
                   "observation": "tool"}


def read_records(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for every record of a jsonl/json file or a HF dataset
    directory; ``where`` names the file and line (or row) for error messages."""
    p = Path(path).expanduser()
    if p.is_dir():
        yield from _read_hf_dataset(p)
        return
    if not p.is_file():
        raise UserInputError(f"SFT data file {p} does not exist (data.paths); give jsonl/json "
                             "files or Hugging Face dataset directories (save_to_disk)")
    if p.suffix == ".json":
        try:
            rows = json.loads(p.read_text(encoding="utf-8"))
        except ValueError as e:
            raise UserInputError(f"{p}: not valid JSON ({e})") from None
        if not isinstance(rows, list):
            raise UserInputError(f"{p}: a .json SFT file must hold a list of records; "
                                 "use .jsonl for one record per line")
        for i, rec in enumerate(rows):
            yield f"{p} record {i}", rec
        return
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{p}:{lineno}", json.loads(line)
            except ValueError as e:
                raise UserInputError(f"{p}:{lineno}: not valid JSON ({e})") from None


def _read_hf_dataset(p: Path) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise UserInputError(f"{p} is a directory; reading Hugging Face datasets needs the "
                             "`datasets` package: pip install 'giantmodel[hf]'") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except (FileNotFoundError, ValueError) as e:
        raise UserInputError(f"{p}: not a dataset saved with save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserInputError(f"{p} holds splits {sorted(ds)} but no 'train'; save the split "
                                 "to train on by itself")
        ds = ds["train"]
    for i, rec in enumerate(ds):
        yield f"{p} row {i}", rec


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise UserInputError(f"{where}: {what} must be a string, got {type(value).__name__}")
    return value


def record_format(rec: dict, where: str) -> str:
    if not isinstance(rec, dict):
        raise UserInputError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    if "messages" in rec:
        return "messages"
    if "conversations" in rec:
        return "sharegpt"
    if "instruction" in rec:
        return "alpaca"
    raise UserInputError(f"{where}: cannot tell the record's format from its keys "
                         f"{sorted(rec)[:6]}; expected 'messages' (chat), 'conversations' "
                         "(ShareGPT) or 'instruction'/'output' (alpaca)")


def to_messages(rec: dict, fmt: str, where: str) -> list[dict]:
    """The record as ``[{"role", "content"}, ...]``; raises on malformed input."""
    fmt = record_format(rec, where) if fmt == "auto" else fmt
    if fmt == "alpaca":
        for key in ("instruction", "output"):
            if key not in rec:
                raise UserInputError(f"{where}: alpaca record has no {key!r}; alpaca records need "
                                     "instruction and output (input optional)")
        prompt = _text(rec["instruction"], where, "instruction")
        extra = rec.get("input") or ""
        if _text(extra, where, "input"):
            prompt = f"{prompt}\n\n{extra}"
        msgs = [{"role": "user", "content": prompt},
                {"role": "assistant", "content": _text(rec["output"], where, "output")}]
        if rec.get("system"):
            msgs.insert(0, {"role": "system", "content": _text(rec["system"], where, "system")})
        return msgs
    key, role_key, content_key = (("messages", "role", "content") if fmt == "messages"
                                  else ("conversations", "from", "value"))
    if key not in rec:
        raise UserInputError(f"{where}: record has no {key!r} (data.format is {fmt}; "
                             "auto tells the format of each record by its keys)")
    turns = rec[key]
    if not isinstance(turns, list) or not turns:
        raise UserInputError(f"{where}: {key!r} must be a non-empty list of turns")
    out = []
    for j, m in enumerate(turns):
        if not isinstance(m, dict) or role_key not in m:
            raise UserInputError(f"{where}: message {j} has no {role_key!r}; every turn needs "
                                 f"{role_key!r} and {content_key!r}")
        if content_key not in m:
            raise UserInputError(f"{where}: message {j} has no {content_key!r}")
        role = m[role_key]
        if fmt == "sharegpt":
            role = _SHAREGPT_ROLES.get(str(role).lower())
            if role is None:
                raise UserInputError(f"{where}: message {j} has unknown 'from' {m[role_key]!r}; "
                                     f"use one of {', '.join(sorted(_SHAREGPT_ROLES))}")
        elif role not in ROLES:
            raise UserInputError(f"{where}: message {j} has unknown role {role!r}; use one of "
                                 f"{', '.join(ROLES)}")
        out.append({"role": role, "content": _text(m[content_key], where,
                                                   f"message {j} {content_key}")})
    return out


def load_conversations(paths: list[str], fmt: str) -> list[list[dict]]:
    """Every record of ``paths`` as a message list, in file order."""
    return [to_messages(rec, fmt, where) for p in paths for where, rec in read_records(p)]
