"""Checkpoints: sharded DCP save/load (async, atomic, retention), per-rank
state, weights-only loading, and conversion to and from Hugging Face."""

from giantmodel.checkpoint.layout import resolve_checkpoint_dir
from giantmodel.checkpoint.manager import CheckpointManager
from giantmodel.checkpoint.state import ModelState, OptimizerState, PerRank, RNGState
from giantmodel.checkpoint.weights import load_model_from_checkpoint, load_model_weights, read_model_config

__all__ = [
                                           "CheckpointManager",
                                           "ModelState",
                                           "OptimizerState",
                                           "PerRank",
                                           "RNGState",
                                           "load_model_from_checkpoint",
                                           "load_model_weights",
                                           "read_model_config",
                                           "resolve_checkpoint_dir",
]
