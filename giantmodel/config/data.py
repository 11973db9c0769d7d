"""The ``data:`` section of a job config.

An empty section trains on the built-in corpus: the Python standard library's
own sources, tokenized with a SentencePiece model trained on them, both built
on first use and cached.

``validate`` checks values only; that the named files exist and are readable
is checked by :func:`giantmodel.data.checks.check_data`, which the trainer
runs with the other pre-flight checks before any process group exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from giantmodel.config.errors import ConfigError
from giantmodel.config.images import ImageDataConfig
from giantmodel.config.modes import refuse_unused

SOURCES = ("builtin", "indexed", "synthetic", "sft", "preference", "images", "shapes")
IMAGE_SOURCES = ("images", "shapes")
SYNTHETIC_PATTERNS = ("arithmetic", "random")
# Which sources read a key; the others refuse it (see config.modes).
_SFT = ("sft",)
_PREF = "preference"  # pairs for objective dpo (giantmodel.data.preference)
_READ_BY = {
    "paths": ("indexed", "sft", "images", _PREF), "weights": ("indexed",),
    "valid_paths": ("indexed", "sft", _PREF), "tokenizer": ("indexed", "sft", _PREF),
    "valid_fraction": ("indexed", "synthetic", "sft", _PREF),
    "synthetic_vocab_size": ("synthetic",), "synthetic_pattern": ("synthetic",),
    "synthetic_num_samples": ("synthetic",), "builtin_vocab_size": ("builtin",),
    "builtin_max_bytes": ("builtin",), "builtin_valid_every": ("builtin",),
    # the corpus, the tiny chat model, the latent caches and the tiny VAE
    "cache_dir": ("builtin", "sft", _PREF, *IMAGE_SOURCES),
    "cache_latents": IMAGE_SOURCES, "images": IMAGE_SOURCES,
    "format": _SFT, "chat_template": (*_SFT, _PREF), "mask_prompt": _SFT, "pack": (*_SFT, _PREF),
    "truncate": _SFT,
}


@dataclass
class DataConfig:
    source: str = "builtin"
    """Where training text comes from: "builtin" (the Python standard library's
    .py sources, tokenized and cached on first use; needs no files), "indexed"
    (Megatron-LM .bin/.idx datasets listed in ``paths``, made by
    ``giantmodel preprocess`` or Megatron-LM's own tools) or "synthetic"
    (token ids generated from the seed; for tests and benchmarks), "sft"
    (supervised fine-tuning conversations from ``paths``; see the sft block),
    "preference" (chosen/rejected pairs for objective dpo, TRL's formats).
    Image sources for the diffusion objective: "images" (an image folder with
    ``metadata.jsonl``, or a Hugging Face dataset saved to disk, in ``paths``)
    and "shapes" (captioned coloured shapes generated from the seed; needs
    no files)."""

    paths: list[str] = field(default_factory=list)
    """Indexed dataset path prefixes (``PREFIX`` for ``PREFIX.bin`` + ``PREFIX.idx``)
    for source "indexed". Several are blended by ``weights``. For source
    "sft": jsonl/json files or Hugging Face dataset directories
    (``save_to_disk``); empty: the bundled tiny instruction set. For source
    "images": one image folder (``metadata.jsonl`` lines of ``{"file_name": ...,
    "text": ...}``) or a directory written by ``datasets.save_to_disk``."""

    weights: list[float] = field(default_factory=list)
    """Blend weights, one per entry of ``paths`` (normalised; need not sum to 1).
    Empty: each dataset is weighted by its size, i.e. plain concatenation."""

    valid_paths: list[str] = field(default_factory=list)
    """Indexed dataset prefixes (source "sft": files) used only for validation.
    Empty: the last ``valid_fraction`` of each training dataset's documents
    (sft: of all examples) is held out."""

    valid_fraction: float = 0.01
    """Fraction of each dataset's documents (its last ones) held out for
    validation when ``valid_paths`` is empty; 0 turns validation off."""

    tokenizer: str | None = None
    """Tokenizer for source "indexed": a SentencePiece .model, a Hugging Face
    tokenizer.json, or a directory holding one. It must be the one the data
    was preprocessed with. Unused by "builtin" (it trains its own). For
    "sft": a Hugging Face tokenizer (its ``chat_template`` is used when
    ``chat_template`` is auto); unset: the one in ``checkpoint.init_from``."""

    val_batches: int = 8
    """Validation micro-batches per data-parallel rank in one evaluation."""

    synthetic_vocab_size: int | None = None
    """Vocabulary of source "synthetic"; unset: the model's ``vocab_size``."""

    synthetic_pattern: str = "arithmetic"
    """Synthetic token ids: "arithmetic" (``(a + b*t) mod vocab``, learnable) or
    "random" (uniform ids, nothing to learn)."""

    synthetic_num_samples: int = 1 << 20
    """Distinct synthetic training samples before the sequence repeats."""

    builtin_vocab_size: int = 4096
    """SentencePiece vocabulary trained for the built-in corpus."""

    builtin_max_bytes: int = 0
    """Cap on the built-in corpus size in bytes of source (0: the whole
    standard library, about 11 MB on CPython 3.11)."""

    builtin_valid_every: int = 20
    """One of every this many standard-library files is held out for validation."""

    cache_latents: bool = False
    """Image sources: encode every image once with the frozen VAE (and the
    frozen text encoder), store the result under ``cache_dir`` and train from
    it; random crops cannot be cached, flips are (both orientations)."""

    images: ImageDataConfig = field(default_factory=ImageDataConfig)
    """Image sources: resolution, cropping, flipping and dataset columns."""

    cache_dir: str | None = None
    """Where the built-in corpus, the latent caches and the tiny default's
    autoencoder are cached; unset: ``$GIANTMODEL_CACHE``, else ``~/.cache/giantmodel``."""

    # ---- source "sft": supervised fine-tuning (giantmodel.data.sft)
    format: Literal["auto", "alpaca", "messages", "sharegpt"] = "auto"
    """Record format of sft files: alpaca (instruction/input/output), messages
    (OpenAI-style role/content list), sharegpt (conversations of from/value),
    or auto (told apart per record by its keys)."""

    chat_template: str = "auto"
    """How conversations become text: auto (the tokenizer's own chat_template,
    else the built-in matching its special tokens, else alpaca), a built-in
    (llama3, chatml, alpaca), a .jinja file, or inline Jinja text."""

    mask_prompt: bool = True
    """Only assistant (response) tokens carry loss; system, user and prompt
    tokens are labelled IGNORE_INDEX. false: every token carries loss."""

    pack: bool = False
    """Pack several examples into each train.seq_len row; attention stays
    within each example (block-diagonal causal) and positions restart."""

    truncate: bool = True
    """Examples longer than train.seq_len + 1 tokens: true cuts them to fit,
    false drops them; the count is reported either way."""

    def validate(self) -> None:
        """Check values (files are checked by ``giantmodel.data.checks``)."""
        if self.source not in SOURCES:
            raise ConfigError(f"unknown data source {self.source!r}; use one of "
                              f"{', '.join(SOURCES)}", key="data.source")
        refuse_unused(self, "data", "source", _READ_BY)
        if not 0.0 <= self.valid_fraction < 1.0:
            raise ConfigError(f"must be in [0, 1), got {self.valid_fraction}",
                              key="data.valid_fraction")
        if self.val_batches < 1:
            raise ConfigError(f"must be at least 1, got {self.val_batches}", key="data.val_batches")
        if self.source in IMAGE_SOURCES:
            self._validate_images()
        elif self.source == "indexed":
            self._validate_indexed()
        elif self.source == "synthetic":
            if self.synthetic_vocab_size is not None and self.synthetic_vocab_size < 2:
                raise ConfigError(f"must be at least 2, got {self.synthetic_vocab_size}",
                                  key="data.synthetic_vocab_size")
            if self.synthetic_pattern not in SYNTHETIC_PATTERNS:
                raise ConfigError(f"unknown pattern {self.synthetic_pattern!r}; use one of "
                                  f"{', '.join(SYNTHETIC_PATTERNS)}", key="data.synthetic_pattern")
            if self.synthetic_num_samples < 1:
                raise ConfigError(f"must be at least 1, got {self.synthetic_num_samples}",
                                  key="data.synthetic_num_samples")
        elif self.source in ("sft", _PREF):
            self._validate_sft()
        else:
            if not 300 <= self.builtin_vocab_size <= 65000:
                raise ConfigError(f"must be in [300, 65000], got {self.builtin_vocab_size}",
                                  key="data.builtin_vocab_size")
            if self.builtin_max_bytes < 0:
                raise ConfigError("must be >= 0 (0 means no cap)", key="data.builtin_max_bytes")
            if self.builtin_valid_every < 2:
                raise ConfigError(f"must be at least 2, got {self.builtin_valid_every}",
                                  key="data.builtin_valid_every")

    def _validate_images(self) -> None:
        self.images.validate()
        if self.source == "images" and len(self.paths) != 1:
            raise ConfigError("source 'images' needs exactly one dataset: set data.paths=[DIR] "
                              "(an image folder with metadata.jsonl, or a saved HF dataset)",
                              key="data.paths")
        if self.cache_latents and not self.images.center_crop:
            raise ConfigError("random crops cannot be cached: set data.images.center_crop=true "
                              "or data.cache_latents=false", key="data.cache_latents")

    def _validate_indexed(self) -> None:
        if not self.paths:
            raise ConfigError("source 'indexed' needs at least one dataset prefix: set "
                              "data.paths=[PREFIX] (PREFIX.bin + PREFIX.idx from "
                              "`giantmodel preprocess`)", key="data.paths")
        if self.weights:
            if len(self.weights) != len(self.paths):
                raise ConfigError(f"has {len(self.weights)} entries but data.paths has "
                                  f"{len(self.paths)}; give one weight per path",
                                  key="data.weights")
            if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
                raise ConfigError("weights must be >= 0 with a positive sum", key="data.weights")
        if not self.tokenizer:
            raise ConfigError("source 'indexed' needs the tokenizer the data was made with: "
                              "set data.tokenizer=PATH (.model, tokenizer.json or a directory)",
                              key="data.tokenizer")

    def _validate_sft(self) -> None:
        if not self.chat_template.strip():
            raise ConfigError("must not be empty; use auto, llama3, chatml, alpaca, a .jinja "
                              "file or inline Jinja", key="data.chat_template")
        if self.weights:
            raise ConfigError("source 'sft' does not blend datasets; remove data.weights",
                              key="data.weights")

    def resolved_cache_dir(self) -> Path:
        base = self.cache_dir or os.environ.get("GIANTMODEL_CACHE") or "~/.cache/giantmodel"
        return Path(base).expanduser()
