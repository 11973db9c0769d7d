"""A rank that dies or stops answering makes the others fail within
``parallel.timeout_s`` instead of hanging."""

from __future__ import annotations

import time

import layout_harness as H
import pytest

from giantmodel.testing import run_ranks

TIMEOUT_S = 3.0


def _train_until_peer_fails(rank, world, mode):
    import torch.distributed as dist

    from giantmodel.core.precision import Precision
    from giantmodel.distributed.parallel_dims import ParallelDims

    cfg = H.make_config("llama", ["parallel.dp=1", "parallel.tp=2", f"parallel.timeout_s={TIMEOUT_S}"])
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    engine = H.build_engine(cfg, dims)
    precision = Precision("fp32", "cpu")
    mbs = H.local_microbatches(cfg, 0, engine.data_rank, engine.data_world)
    engine.forward_backward(mbs, precision)  # one healthy step together
    if rank == 1:
        if mode == "exit":
            dist.destroy_process_group()  # its sockets close, as when the process is killed
            return {"left": True}
        time.sleep(TIMEOUT_S + 6)  # stuck: alive, silent
        return {"left": True}
    start = time.monotonic()
    try:
        for _ in range(3):
            engine.forward_backward(mbs, precision)
    except Exception as e:  # noqa: BLE001 - the failure is the point
        return {"raised": True, "elapsed": time.monotonic() - start, "error": str(e)[:300]}
    return {"raised": False, "elapsed": time.monotonic() - start}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [pytest.param("stuck", marks=pytest.mark.slow), "exit"])
def test_dead_peer_fails_within_timeout(mode):
    # The default group gets a long timeout: only parallel.timeout_s, applied
    # to the mesh's own groups, can make this fail in time.
    res = run_ranks(_train_until_peer_fails, 2, mode, timeout=100, pg_timeout=60)[0]
    assert res["raised"], f"rank 0 kept training without its peer ({mode})"
    assert res["elapsed"] <= TIMEOUT_S + 6, f"{mode}: failed after {res['elapsed']:.1f}s"
