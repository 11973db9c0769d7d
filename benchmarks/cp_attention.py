"""Context-parallel attention, forward and backward: the engine's form (each
local chunk against the keys up to its end) against the earlier form (every
local query against every gathered key under one mask), alternating, in one
run, on gloo ranks of this host.

    PYTHONPATH=. python benchmarks/cp_attention.py --seq 2048,4096 [--cp 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import sys
import time


def whole_rectangle(module, q, k, v):
    """The earlier form: one SDPA call over every gathered key, masked."""
    import torch
    import torch.nn.functional as F

    from giantmodel.parallel.context import all_gather_kv, balanced_positions

    cp, rank = module.cp_mesh.size(), module.cp_mesh.get_local_rank()
    seq = q.shape[2] * cp
    k_all, v_all = all_gather_kv(k, v, module.cp_mesh.get_group())
    q_pos = balanced_positions(seq, cp, rank, q.device)
    k_pos = torch.cat([balanced_positions(seq, cp, r, q.device) for r in range(cp)])
    mask = k_pos[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


def rank_main(rank: int, world: int, seqs: list[int], reps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from giantmodel.parallel.context import ContextParallelSDPA

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    engine = ContextParallelSDPA(torch.nn.Identity(), mesh)
    forms = {"engine": engine, "whole_rectangle": lambda *a: whole_rectangle(engine, *a)}
    out = {}
    for seq in seqs:
        g = torch.Generator().manual_seed(seq)
        t = seq // world   # 8 query heads, 2 key/value heads of 64, as in a small LLaMA
        q, k, v = (torch.randn(1, h, t, 64, generator=g).requires_grad_() for h in (8, 2, 2))

        def timed(fn, q=q, k=k, v=v) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(3):
                fn(q, k, v).sum().backward()
            dist.barrier()
            return (time.perf_counter() - t0) / 3

        for fn in forms.values():
            timed(fn)   # warm-up
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(reps):
            for name, fn in forms.items():
                times[name].append(timed(fn))
        out[seq] = times
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", default="2048,4096", help="comma-separated sequence lengths")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    from giantmodel.testing import run_ranks

    seqs = [int(s) for s in a.seq.split(",")]
    res = run_ranks(rank_main, a.cp, seqs, a.reps, timeout=900)[0]
    print("| cp | seq | engine ms (per rep) | whole rectangle ms | ratio (median) |")
    print("|---|---|---|---|---|")
    for seq, times in res.items():
        ratios = sorted(e / w for e, w in zip(times["engine"], times["whole_rectangle"]))
        fmt = " / ".join
        print(f"| {a.cp} | {seq} | {fmt(f'{x * 1e3:.1f}' for x in times['engine'])} | "
              f"{fmt(f'{x * 1e3:.1f}' for x in times['whole_rectangle'])} | "
              f"**{ratios[len(ratios) // 2]:.2f}x** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
