"""Helpers for tests and benchmarks: local gloo ranks (and emulated clusters)."""

from giantmodel.testing.ranks import RankFailure, free_port, run_ranks, scratch_dir

__all__ = ["RankFailure", "free_port", "run_ranks", "scratch_dir"]
