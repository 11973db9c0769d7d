"""Pre-flight checks of the files a ``data:`` section names.

Run before any process group exists (the trainer's pre-flight), so a missing
or malformed file fails the job in a second with one line naming the key and
the file, instead of a hang across ranks.
"""

from __future__ import annotations

import os

from giantmodel.config.data import DataConfig
from giantmodel.config.errors import ConfigError, UserInputError
from giantmodel.data.indexed import check_token_ids, read_index_header
from giantmodel.data.sft import check_sft
from giantmodel.data.tokenizer import load_tokenizer, resolve_tokenizer_path


def check_data(cfg: DataConfig) -> None:
    """Values first (``cfg.validate``), then every named file."""
    cfg.validate()
    if cfg.source == "indexed":
        _check_indexed(cfg)
    elif cfg.source == "builtin":
        _check_cache_dir(cfg)
    elif cfg.source == "sft":
        check_sft(cfg)


def _check_indexed(cfg: DataConfig) -> None:
    """Every dataset's index, the length of its .bin, the tokenizer, then the
    token ids against the tokenizer's vocabulary (which the trainer checks
    against model.vocab_size): bad data fails here, before the first step."""
    for key, prefixes in (("data.paths", cfg.paths), ("data.valid_paths", cfg.valid_paths)):
        for p in prefixes:
            try:
                read_index_header(p)
            except UserInputError as e:
                raise ConfigError(str(e), key=key) from None
    try:
        path = resolve_tokenizer_path(cfg.tokenizer)
    except UserInputError as e:
        raise ConfigError(str(e), key="data.tokenizer") from None
    try:
        vocab = load_tokenizer(path).vocab_size
    except Exception as e:  # any parse failure of the user's file
        raise ConfigError(f"cannot read the tokenizer {path} ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else 'empty'})",
                          key="data.tokenizer") from None
    for key, prefixes in (("data.paths", cfg.paths), ("data.valid_paths", cfg.valid_paths)):
        for p in prefixes:
            try:
                check_token_ids(p, vocab)
            except UserInputError as e:
                raise ConfigError(str(e), key=key) from None


def _check_cache_dir(cfg: DataConfig) -> None:
    cache = cfg.resolved_cache_dir()
    probe = cache
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"the built-in corpus cache {cache} cannot be created or written "
                          f"({probe} is not a writable directory); set data.cache_dir or "
                          "GIANTMODEL_CACHE to a writable directory", key="data.cache_dir")
