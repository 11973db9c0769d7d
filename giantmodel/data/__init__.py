"""Data: tokenizers, Megatron-LM indexed datasets, preprocessing, packing, blending, loaders.

Attributes are imported on first use, so worker processes and the CLI pay
only for what they touch (the loaders import torch; preprocessing does not).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_tokenizer": "giantmodel.data.build",
    "build_loaders": "giantmodel.data.build",
    "build_samples": "giantmodel.data.build",
    "vocab_size_of": "giantmodel.data.build",
    "Tokenizer": "giantmodel.data.tokenizer",
    "load_tokenizer": "giantmodel.data.tokenizer",
    "IndexedDataset": "giantmodel.data.indexed",
    "IndexedDatasetWriter": "giantmodel.data.indexed",
    "TrainLoader": "giantmodel.data.loader",
    "ValLoader": "giantmodel.data.loader",
    "preprocess": "giantmodel.data.preprocess",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'giantmodel.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
