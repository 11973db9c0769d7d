"""Entry points the trainer calls: tokenizer, loaders and vocabulary size from a DataConfig."""

from __future__ import annotations

from giantmodel.config.data import DataConfig
from giantmodel.config.errors import ConfigError
from giantmodel.data.builtin import builtin_from_config
from giantmodel.data.indexed import IndexedDataset
from giantmodel.data.loader import TrainLoader, ValLoader, check_batch_layout
from giantmodel.data.samples import BlendedSamples, PackedTokens, SyntheticSamples, split_documents
from giantmodel.data.sft import build_sft_sources, sft_tokenizer_path
from giantmodel.data.tokenizer import Tokenizer, load_tokenizer

# Separate RNG streams so validation never shares a permutation with training.
_TRAIN_STREAM, _VALID_STREAM = 0, 1


def vocab_size_of(cfg: DataConfig) -> int | None:
    """The tokenizer's vocabulary size; None for synthetic data without ``synthetic_vocab_size``."""
    if cfg.source == "synthetic":
        return cfg.synthetic_vocab_size
    if cfg.source == "builtin":
        return cfg.builtin_vocab_size  # SentencePiece trains exactly this many pieces
    if cfg.source in ("sft", "preference"):
        return load_tokenizer(sft_tokenizer_path(cfg)).vocab_size
    return load_tokenizer(cfg.tokenizer).vocab_size


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The job's tokenizer; for "builtin" this builds the cached corpus first if needed."""
    if cfg.source == "builtin":

        return load_tokenizer(builtin_from_config(cfg).tokenizer)
    if cfg.source == "synthetic":
        raise ConfigError("synthetic data has no tokenizer; text generation needs "
                          "data.source=builtin, indexed or sft", key="data.source")
    if cfg.source in ("sft", "preference"):
        return load_tokenizer(sft_tokenizer_path(cfg))
    return load_tokenizer(cfg.tokenizer)


def _indexed_sources(cfg: DataConfig, seq_len: int) -> tuple[list, list]:
    """Packed train and validation windows for each path (train) and valid path."""
    train, valid = [], []
    for p in cfg.paths:
        ds = IndexedDataset(p)
        n_train = split_documents(ds.num_documents, cfg.valid_fraction if not cfg.valid_paths else 0.0)
        a, b = ds.document_token_range(0, n_train)
        train.append(PackedTokens(ds.tokens[a:b], seq_len, name=p))
        if not cfg.valid_paths and n_train < ds.num_documents:
            a, b = ds.document_token_range(n_train, ds.num_documents)
            valid.append(PackedTokens(ds.tokens[a:b], seq_len, name=p))
    for p in cfg.valid_paths:
        ds = IndexedDataset(p)
        a, b = ds.document_token_range(0, ds.num_documents)
        valid.append(PackedTokens(ds.tokens[a:b], seq_len, name=p))
    return train, valid


def build_samples(cfg: DataConfig, *, seq_len: int, seed: int, vocab_size: int | None = None
                  ) -> tuple[BlendedSamples, BlendedSamples | None]:
    """The endless training sample sequence and the fixed validation set (or None)."""
    weights: list[float] | None = list(cfg.weights) or None
    if cfg.source == "synthetic":
        vocab = cfg.synthetic_vocab_size or vocab_size
        if not vocab:
            raise ConfigError("synthetic data needs a vocabulary size: set "
                              "data.synthetic_vocab_size or model.vocab_size",
                              key="data.synthetic_vocab_size")
        train = [SyntheticSamples(vocab, seq_len, cfg.synthetic_num_samples, seed,
                                  cfg.synthetic_pattern, _TRAIN_STREAM)]
        n_val = max(1, int(cfg.synthetic_num_samples * cfg.valid_fraction)) if cfg.valid_fraction else 0
        valid = [SyntheticSamples(vocab, seq_len, n_val, seed, cfg.synthetic_pattern,
                                  _VALID_STREAM)] if n_val else []
        weights = None
    elif cfg.source == "builtin":

        corpus = builtin_from_config(cfg)
        t, v = IndexedDataset(corpus.train_prefix), IndexedDataset(corpus.valid_prefix)
        train = [PackedTokens(t.tokens, seq_len, name="stdlib-train")]
        valid = [PackedTokens(v.tokens, seq_len, name="stdlib-valid")]
        weights = None
    elif cfg.source == "sft":
        t_rows, v_rows = build_sft_sources(cfg, seq_len=seq_len)
        train, valid = [t_rows], [v_rows] if v_rows is not None else []
        weights = None
    else:
        train, valid = _indexed_sources(cfg, seq_len)
    for s in train:
        if len(s) == 0:
            raise ConfigError(f"training data {s.name} has fewer than seq_len+1 = {seq_len + 1} "
                              "tokens; use more data or a shorter train.seq_len", key="data.paths")
    valid = [s for s in valid if len(s) > 0]
    train_samples = BlendedSamples(train, weights, seed=seed, shuffle=True)
    # Validation keeps the blend weights only when it is split from the same datasets.
    vw = weights if (weights and not cfg.valid_paths and len(valid) == len(train)) else None
    valid_samples = BlendedSamples(valid, vw, seed=seed, shuffle=False) if valid else None
    return train_samples, valid_samples


def build_loaders(cfg: DataConfig, *, seq_len: int, global_batch_size: int, micro_batch_size: int,
                  dp_rank: int, dp_size: int, seed: int, vocab_size: int | None = None
                  ) -> tuple[TrainLoader, ValLoader]:
    """This rank's training loader (endless, resumable) and validation loader (re-iterable).

    ``vocab_size`` (the model's) is used by synthetic data when
    ``data.synthetic_vocab_size`` is unset.
    """
    check_batch_layout(global_batch_size, micro_batch_size, dp_size)
    train, valid = build_samples(cfg, seq_len=seq_len, seed=seed, vocab_size=vocab_size)
    tl = TrainLoader(train, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                     dp_rank=dp_rank, dp_size=dp_size, seed=seed)
    vl = ValLoader(valid, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                   num_batches=cfg.val_batches)
    return tl, vl
