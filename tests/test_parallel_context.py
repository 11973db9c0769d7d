"""Context-parallel attention against one process's causal attention, at
cp 4, so that ranks whose chunks sit in the middle of the sequence (not only
the first and last, as at cp 2) are checked, with GQA, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from giantmodel.testing import run_ranks

B, HQ, HKV, T, D = 2, 4, 2, 32, 8


def _inputs():
    g = torch.Generator().manual_seed(5)
    return [torch.randn(B, h, T, D, generator=g) for h in (HQ, HKV, HKV)] + [
        torch.randn(B, HQ, T, D, generator=g)]


def _cp_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from giantmodel.parallel.context import ContextParallelSDPA, shard_sequence

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q, k, v, dout = _inputs()
    local = [shard_sequence(t.transpose(1, 2), world, rank).transpose(1, 2).clone().requires_grad_()
             for t in (q, k, v)]
    attn = ContextParallelSDPA(torch.nn.Identity(), mesh)
    out = attn(*local)
    out.backward(shard_sequence(dout.transpose(1, 2), world, rank).transpose(1, 2))
    dist.barrier()
    return out.detach(), [t.grad for t in local]


@pytest.mark.timeout(120)
def test_cp4_attention_and_gradients_equal_one_process():
    from giantmodel.parallel.context import shard_sequence

    world = 4
    results = run_ranks(_cp_worker, world, timeout=110)
    q, k, v, dout = (t.clone().requires_grad_() for t in _inputs())
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref.backward(dout)

    def local(t, r):
        return shard_sequence(t.transpose(1, 2), world, r).transpose(1, 2)

    for r, (out, grads) in enumerate(results):
        torch.testing.assert_close(out, local(ref.detach(), r), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[0], local(q.grad, r), rtol=1e-5, atol=1e-5)
    # K and V gradients: every rank's share of the reduce-scatter, summed by position
    for i, full in ((1, k.grad), (2, v.grad)):
        for r, (_, grads) in enumerate(results):
            torch.testing.assert_close(grads[i], local(full, r), rtol=1e-5, atol=1e-5)
