"""Where ``train``'s memory preflight finds its estimator.

The planner sits above train in the layers (it predicts what train does), so
train cannot import it; the planner registers its estimator here when it is
imported (:func:`giantmodel.planner.preflight.register`, run by the planner
package, which the CLI imports for every subcommand). Without one, the
preflight is skipped.
"""

from __future__ import annotations

from collections.abc import Callable

MemoryEstimator = Callable[..., "str | None"]
"""(cfg, world_size, device_type, available_bytes, where) -> one line when the
job cannot fit, else None."""

_estimator: MemoryEstimator | None = None


def set_memory_estimator(fn: MemoryEstimator | None) -> None:
    global _estimator
    _estimator = fn


def memory_estimator() -> MemoryEstimator | None:
    return _estimator
