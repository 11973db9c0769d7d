"""The MoE layer at ep2 against DeepSpeed-MoE at ep_size 2, on 2 gloo CPU ranks.

Same shapes as benchmarks/moe_layer.py (hidden 512, expert ffn 1792, 8
SwiGLU experts, top-2, softmax router renormalised), 2,048 tokens per rank,
fp32, one thread per rank. giantmodel's ``MoE`` gets
:func:`giantmodel.parallel.expert.apply_expert_parallel` over a 1-D ``ep``
mesh (4 experts per rank, the real count + row all-to-alls);
DeepSpeed's ``deepspeed.moe.layer.MoE(hidden, expert=<SwiGLU MLP>,
num_experts=8, ep_size=2, k=2)`` gets the same weights (rank r holds global
experts 4r..4r+3 in both). giantmodel runs twice: its ep group on the
same gloo group as DeepSpeed (``giantmodel``, the like-for-like ratio) and
on the ``giant`` backend (``giantmodel_giant``: what giantmodel picks by
default for several CPU ranks on one host, ``comm.backend: auto``; its
shared-memory all-to-all; outputs bit-equal to the gloo run). Two DeepSpeed
settings are run:

* ``deepspeed``: ``drop_tokens=False`` and no Gumbel sampling of the 2nd
  expert, the same routing as giantmodel (dropless, deterministic top-2),
  so outputs are compared before timing; the headline ratio;
* ``deepspeed_cf1``: DeepSpeed's defaults (capacity factor 1.0, tokens past
  capacity dropped, Gumbel-sampled 2nd expert): less work, other results.

Both systems run in the same two processes (DeepSpeed's environment,
benchmarks/peers/venvs.py, which reuses the system torch), so a rep runs
each layer once, alternating the order every rep; a rep's time is the
slowest rank's; the table gives medians and tokens/s over both ranks.

Each ``--dtype`` (fp32, bf16: every layer's weights, input and gradients
in it) is its own comparison, run in the same two processes one after the
other. In bf16 the routers see bf16 inputs; DeepSpeed's gate runs in bf16
and giantmodel's in fp32, so near-tied tokens may pick other experts and
the outputs are compared relative to their norm (within 0.1; fp32: max
|difference|). Both processes keep freed heap memory between steps as
giantmodel's training does (``core.hostmem``), for every layer alike.

    PYTHONPATH=. python benchmarks/moe_ep_deepspeed.py [--reps 7] [--dtype fp32,bf16]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHAPE = dict(hidden=512, ffn=1792, experts=8, top_k=2, tokens=2048, ep=2)


def _weights(shape: dict):
    """Router and stacked expert weights, identical on every rank (seeded)."""
    import torch

    h, f, e = shape["hidden"], shape["ffn"], shape["experts"]
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(e, h, generator=g) * h ** -0.5
    w1, w3 = (torch.randn(e, h, f, generator=g) * 0.02 for _ in range(2))
    w2 = torch.randn(e, f, h, generator=g) * 0.02
    return gate, w1, w3, w2


def build_giantmodel(shape: dict, weights, group=None):
    """giantmodel's layer over an ep mesh on ``group`` (None: the default gloo group)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from giantmodel.config.moe import MoEConfig
    from giantmodel.models.common.moe import MoE
    from giantmodel.parallel.expert import apply_expert_parallel

    gate, w1, w3, w2 = weights
    moe = MoE(shape["hidden"], shape["ffn"], MoEConfig(num_experts=shape["experts"],
                                                       top_k=shape["top_k"], router="softmax",
                                                       norm_topk_prob=True))
    with torch.no_grad():
        moe.router.gate.weight.copy_(gate)
        moe.experts.w1.copy_(w1)
        moe.experts.w3.copy_(w3)
        moe.experts.w2.copy_(w2)
    moe.init_buffers()
    mesh = (init_device_mesh("cpu", (shape["ep"],), mesh_dim_names=("ep",)) if group is None
            else DeviceMesh.from_group(group, "cpu", mesh_dim_names=("ep",)))
    apply_expert_parallel(moe, mesh)
    return moe.train()


def build_deepspeed(shape: dict, weights, rank: int, dropless: bool):
    import torch
    from deepspeed.moe.layer import MoE
    from torch import nn

    class SwiGLU(nn.Module):
        """The expert DeepSpeed copies E/ep times: w2(silu(x w1) * x w3)."""

        def __init__(self, h: int, f: int):
            super().__init__()
            self.w1 = nn.Linear(h, f, bias=False)
            self.w3 = nn.Linear(h, f, bias=False)
            self.w2 = nn.Linear(f, h, bias=False)

        def forward(self, x):
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    gate, w1, w3, w2 = weights
    kw = dict(drop_tokens=False, top2_2nd_expert_sampling=False) if dropless else {}
    moe = MoE(shape["hidden"], SwiGLU(shape["hidden"], shape["ffn"]),
              num_experts=shape["experts"], ep_size=shape["ep"], k=shape["top_k"], **kw)
    moe.set_deepspeed_parallelism()
    local = shape["experts"] // shape["ep"]
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(gate)
        for j, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            e = rank * local + j  # DeepSpeed's rank r holds global experts r*E/ep + j
            expert.w1.weight.copy_(w1[e].t())
            expert.w3.weight.copy_(w3[e].t())
            expert.w2.weight.copy_(w2[e].t())
    return moe.train()


def _step(name: str, layer, x, grad):
    x = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    y = out[0] if isinstance(out, tuple) else out  # DeepSpeed: (out, l_aux, exp_counts)
    y.backward(grad)
    if hasattr(layer, "take_aux_loss"):
        layer.take_aux_loss()
    return y.detach(), x.grad


def rank_main(rank: int, world: int, shape: dict, reps: int, warmup: int,
              dtypes: list[str]) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist

    from giantmodel import comm
    from giantmodel.core.hostmem import keep_freed_host_memory

    sys.path.insert(0, str(HERE))
    from moe_reps import DTYPES

    torch.set_num_threads(1)
    keep_freed_host_memory()
    deepspeed.init_distributed(dist_backend="gloo")  # reuses the gloo group run_ranks made
    comm.register_backend()
    giant = dist.new_group(backend="giant")
    return {dtype: _compare(rank, world, shape, reps, warmup, getattr(torch, DTYPES[dtype]), giant)
            for dtype in dtypes}


def _compare(rank: int, world: int, shape: dict, reps: int, warmup: int, dtype,
             giant) -> dict:
    """One dtype's comparison: build the layers, check, time."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from moe_reps import alternating_reps, difference

    weights = _weights(shape)
    layers = {"giantmodel": build_giantmodel(shape, weights),
              "giantmodel_giant": build_giantmodel(shape, weights, giant),
              "deepspeed": build_deepspeed(shape, weights, rank, dropless=True),
              "deepspeed_cf1": build_deepspeed(shape, weights, rank, dropless=False)}
    for layer in layers.values():
        layer.to(dtype)
    for name in ("giantmodel", "giantmodel_giant"):
        layers[name].init_buffers()   # the router's bias and statistics stay fp32
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    x = torch.randn(1, shape["tokens"], shape["hidden"], generator=g)
    grad = torch.randn(x.shape, generator=g) / (world * shape["tokens"]) ** 0.5
    x, grad = x.to(dtype), grad.to(dtype)
    ref = _step("giantmodel", layers["giantmodel"], x, grad)
    got = _step("deepspeed", layers["deepspeed"], x, grad)
    diff = {"out": difference(ref[0], got[0]), "grad_x": difference(ref[1], got[1])}
    same = _step("giantmodel_giant", layers["giantmodel_giant"], x, grad)
    if not (torch.equal(same[0], ref[0]) and torch.equal(same[1], ref[1])):
        raise RuntimeError("giantmodel on the giant backend differs from giantmodel on gloo")
    if max(diff.values()) > (1e-5 if dtype == torch.float32 else 1e-1):
        raise RuntimeError(f"giantmodel and dropless DeepSpeed differ ({dtype}): {diff}")

    def run(name: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        _step(name, layers[name], x, grad)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a rep lasts as long as its slowest rank
        return dt.item()

    times = alternating_reps(list(layers), reps, warmup, run)
    return {"times_s": times, "max_abs_diff": diff, "deepspeed": deepspeed.__version__,
            "torch": torch.__version__}


def worker(a) -> None:
    """Inside DeepSpeed's environment: the 2 ranks, then the JSON."""
    from giantmodel.testing import run_ranks

    shape = dict(SHAPE, tokens=a.tokens)
    every = run_ranks(rank_main, shape["ep"], shape, a.reps, a.warmup, a.dtype.split(","),
                      timeout=1800, pg_timeout=600)[0]
    n = shape["tokens"] * shape["ep"]
    for dtype, res in every.items():
        median = {k: statistics.median(v) for k, v in res["times_s"].items()}
        res.update(shape=shape, dtype=dtype, reps=a.reps, warmup=a.warmup, threads_per_rank=1,
                   ranks=shape["ep"], backend="gloo",
                   machine=platform.processor() or platform.machine(),
                   median_s=median, tokens_per_s={k: n / v for k, v in median.items()},
                   ratio_vs={k: v / median["giantmodel"] for k, v in median.items()
                             if k != "giantmodel"})
        res["ratio"] = res["ratio_vs"]["deepspeed"]
        res["ratio_giant_backend"] = median["deepspeed"] / median["giantmodel_giant"]
    Path(a.worker_out).write_text(json.dumps(every, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--tokens", type=int, default=SHAPE["tokens"], help="tokens per rank")
    p.add_argument("--dtype", default="fp32,bf16",
                   help="comma-separated precisions, each a separate comparison: fp32, bf16")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker_out:
        worker(a)
        return 0
    sys.path.insert(0, str(HERE / "peers"))
    import tempfile

    import venvs

    ds_python = venvs.ensure(venvs.DEEPSPEED)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(venvs.torch_extensions_dir()),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "res.json"
        cmd = [str(ds_python), __file__, "--reps", str(a.reps), "--warmup", str(a.warmup),
               "--tokens", str(a.tokens), "--dtype", a.dtype, "--worker-out", str(out)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            print(f"DeepSpeed-MoE side failed ({run.returncode}):\n{run.stdout[-4000:]}"
                  f"{run.stderr[-6000:]}")
            return 1
        every = json.loads(out.read_text())
    sys.path.insert(0, str(HERE))
    from moe_reps import print_table

    for dtype, res in every.items():
        s = res["shape"]
        print(f"MoE layer fwd+bwd at ep{s['ep']} on {s['ep']} gloo ranks, {dtype}, hidden "
              f"{s['hidden']} ffn {s['ffn']} {s['experts']} experts top-{s['top_k']}, "
              f"{s['tokens']} tokens/rank, 1 thread/rank, median of {res['reps']} "
              f"(DeepSpeed {res['deepspeed']})")
        kind = "max |diff|" if dtype == "fp32" else "relative diff"
        print(f"{kind} giantmodel vs dropless DeepSpeed (rank 0): {res['max_abs_diff']}")
        print_table(res)
        print(f"dropless DeepSpeed (gloo) / giantmodel: {res['ratio']:.2f}x on gloo, "
              f"{res['ratio_giant_backend']:.2f}x on the giant backend\n")
    if a.json:
        Path(a.json).write_text(json.dumps(every, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
