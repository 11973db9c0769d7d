"""Activation offload bookkeeping (CPU): every block's saved activations go
through host buffers, come back in reverse block order with the configured
prefetch distance, and the gradients are unchanged. The copy engine itself
(pinned memory, side stream) needs CUDA and is not exercised here."""

from __future__ import annotations

import layout_harness as H
import pytest
import torch

from giantmodel.core.loss import cross_entropy_sum
from giantmodel.models import build_model, init_weights
from giantmodel.parallel.offload import ActivationOffload


def _grads(offload_prefetch: int | None):
    cfg = H.make_config("llama", [])
    model = init_weights(build_model(cfg.model, "meta"), cfg.model, seed=5, device="cpu")
    off = None
    if offload_prefetch is not None:
        off = ActivationOffload(list(model.layers.values()), offload_prefetch, force=True)
    ids, labels = H.global_batch(cfg, 0)
    loss, n = cross_entropy_sum(model(ids), labels)
    (loss / n).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}, off


@pytest.mark.timeout(60)
def test_offload_keeps_gradients_and_prefetches_in_reverse():
    ref, _ = _grads(None)
    for prefetch in (0, 2):
        grads, off = _grads(prefetch)
        for k, g in ref.items():
            torch.testing.assert_close(grads[k], g, rtol=0, atol=0)
        L = len(off.blocks)
        assert all(len(s) > 0 for s in off.slots), "a block saved nothing through the hooks"
        assert off.fetch_order == list(range(L - 1, -1, -1))
        # when backward first needs block i, blocks i-1 .. i-prefetch are on their way
        for i in range(L):
            assert off.in_flight_at_use[i] == set(range(max(0, i - prefetch), L)), (i, prefetch)
        # nothing is kept on the "device" once backward is over
        assert all(s.device_copy is None for slots in off.slots for s in slots)


def test_backward_keeps_at_most_prefetch_plus_one_blocks_resident():
    """The residency guarantee of parallel/offload.py: when backward first
    needs block i, the device copies alive are those of blocks i..i-prefetch
    only; earlier-fetched blocks' copies were freed as autograd used them."""
    import weakref

    cfg = H.make_config("llama", [])
    for prefetch in (0, 1, 2):
        model = init_weights(build_model(cfg.model, "meta"), cfg.model, seed=5, device="cpu")
        off = ActivationOffload(list(model.layers.values()), prefetch, force=True)
        alive: list[tuple[int, weakref.ref]] = []
        real_copy_in = off._copy_in

        def tracking_copy_in(slot, real=real_copy_in, alive=alive, off=off):
            real(slot)
            block = next(i for i, s in enumerate(off.slots) if any(x is slot for x in s))
            alive.append((block, weakref.ref(slot.device_copy)))

        off._copy_in = tracking_copy_in
        resident_at_use: dict[int, set[int]] = {}
        real_unpack = off._unpack

        def observing_unpack(i, handle, real=real_unpack, alive=alive, seen=resident_at_use):
            if i not in seen and not isinstance(handle, torch.Tensor):
                out = real(i, handle)
                seen[i] = {b for b, ref in alive if ref() is not None}
                return out
            return real(i, handle)

        off._unpack = observing_unpack
        ids, labels = H.global_batch(cfg, 0)
        loss, n = cross_entropy_sum(model(ids), labels)
        (loss / n).backward()
        L = len(off.blocks)
        for i in range(L):
            assert resident_at_use[i] <= set(range(max(0, i - prefetch), i + 1)), (
                prefetch, i, resident_at_use[i])
        assert not [b for b, ref in alive if ref() is not None], "copies outlived backward"
