"""CPU-Reduce for CUDA tensors: two processes sharing one GPU.

Skips without CUDA. CPU-Reduce needs no peer access and no NCCL, so two
ranks on the same device exercise the whole path: D2H on a side stream, host
reduction in shared memory, H2D back, pipelined by chunk.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from giantmodel.comm import GiantOptions, _lib, register_backend
from giantmodel.testing import run_ranks

register_backend()
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or _lib.load() is None,
                                reason="needs CUDA and the C++ comm core")


def _worker(rank: int, world: int) -> dict:
    giant = dist.new_group(backend="giant", pg_options=GiantOptions(cuda_cpu_reduce=True,
                                                                    chunk_bytes=1 << 20))
    dev = torch.device("cuda", 0)
    for dtype in (torch.float32, torch.bfloat16):
        for n in (0, 1, 1001, 10_000_000):
            g = torch.Generator().manual_seed(n + 7 * rank)
            mine = torch.randn(n, generator=g).to(dtype)
            parts = [torch.randn(n, generator=torch.Generator().manual_seed(n + 7 * r)).to(dtype)
                     for r in range(world)]
            t = mine.to(dev)
            dist.all_reduce(t, group=giant)
            want = torch.stack([p.float() for p in parts]).sum(0).to(dtype)
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            assert torch.allclose(t.cpu().float(), want.float(), rtol=tol, atol=tol), (dtype, n)
            t = mine.to(dev)
            dist.all_reduce(t, op=dist.ReduceOp.AVG, group=giant)
            assert torch.allclose(t.cpu().float(), want.float() / world, rtol=tol, atol=tol)
    t = torch.full((1000,), float(rank + 1), device=dev)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), group=giant)
    assert torch.all(t.cpu() == 0.5 * sum(range(1, world + 1)))
    big = torch.ones(16 << 20, device=dev)  # 64 MB
    dist.all_reduce(big, group=giant)
    torch.cuda.synchronize()
    dist.barrier(group=giant)
    t0 = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(big, group=giant)
    torch.cuda.synchronize()
    secs = (time.perf_counter() - t0) / 5
    assert torch.all(big == world ** 6)
    return {"busbw_GBps": 2 * (world - 1) / world * big.numel() * 4 / secs / 1e9}


@pytest.mark.timeout(180)
def test_cpu_reduce_two_ranks_one_gpu():
    res = run_ranks(_worker, 2, timeout=170)
    print(f"CPU-Reduce 64 MB fp32, 2 ranks on one GPU: busbw {res[0]['busbw_GBps']:.2f} GB/s")
