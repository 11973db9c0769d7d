"""Rank placement: which global rank takes which position of the mesh.

The mesh is laid out ``[pp, dp_replicate, dp_shard, cp, tp]`` with tp the
fastest-varying dimension. The identity placement therefore puts a tensor-
parallel group on consecutive ranks (one node's fastest links), then context
parallel, then data parallel, with pipeline stages outermost (they exchange the
least data). A placement is a permutation ``perm`` where ``perm[i]`` is the
global rank at mesh position ``i``; bandwidth-aware placement produces one.
"""

from __future__ import annotations

from giantmodel.config.errors import ConfigError


def identity_placement(world_size: int) -> list[int]:
    return list(range(world_size))


def validate_placement(perm: list[int] | None, world_size: int) -> list[int]:
    """Return ``perm`` (identity when None) after checking it is a permutation
    of ``0..world_size-1``; the error names ``parallel.placement``."""
    if perm is None:
        return identity_placement(world_size)
    if len(perm) != world_size:
        raise ConfigError(
            f"has {len(perm)} entries but the world size is {world_size}; give one global "
            "rank per mesh position, or null for the identity", "parallel.placement")
    if sorted(perm) != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(perm))
        raise ConfigError(
            f"must be a permutation of 0..{world_size - 1}; ranks {missing} are missing "
            "(some other rank is listed twice)", "parallel.placement")
    return list(perm)


def mesh_position(perm: list[int], rank: int) -> int:
    """Mesh position (row-major index over pp, dp_replicate, dp_shard, cp, tp) of ``rank``."""
    return perm.index(rank)
