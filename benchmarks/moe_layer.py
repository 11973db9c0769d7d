"""The MoE layer against transformers' ``MixtralSparseMoeBlock`` on the CPU.

Mixtral-8x7B's proportions scaled down: hidden 512, expert ffn 1792 (3.5x,
Mixtral's 14336 / 4096), 8 experts, top-2, softmax router with the chosen
weights renormalised; 4,096 tokens (2 x 2,048) in fp32, one process. Both
layers get the same weights (HF's ``gate_up_proj`` [E, 2F, H] and
``down_proj`` [E, H, F] are giantmodel's ``w1``/``w3`` [E, H, F] and ``w2``
[E, F, H] transposed), and their outputs and input gradients are checked
equal before anything is timed: in fp32 within 1e-5 (max |difference|).
In bf16 transformers' router picks experts from bf16 logits and
giantmodel's from fp32 ones, so near-tied tokens go to other experts: there
giantmodel's bf16 layer is checked against its own fp32 forward and backward
on the same (bf16-rounded) weights and input, within 2e-2 relative in norm,
and transformers' within 0.1 of it (a loose check that both run the same
layer).

Each ``--dtype`` is a separate comparison with both layers' weights, input
and gradients in it: fp32, and bf16 (the precision MoE models train in;
on a CPU with AMX its GEMMs run 5-8x fp32's rate, so the work around the
GEMMs weighs more). The process keeps freed heap memory between steps as
giantmodel's training does (``core.hostmem``), which every layer in the
process gets alike.

A rep is one forward + backward of each layer in train mode, from the same
input and output gradient; the layers alternate within every rep (and swap
order each rep) so that both see the same host load, and the table reports
the median time per layer, its tokens/s, and giantmodel's ratio.

transformers 5.x picks the experts' code by ``config._experts_implementation``:
``eager`` (the class's own loop, what a standalone block runs) and
``grouped_mm`` (the default when a whole model is loaded, ``torch._grouped_mm``
which runs on the CPU too) are both measured; the headline ratio is against
the faster of the two. (``batched_mm`` gathers a weight matrix per token,
[N*k, 2F, H], 60 GB here: not run.)

    PYTHONPATH=. python benchmarks/moe_layer.py [--reps 7] [--threads 1] [--dtype fp32,bf16]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch
from moe_reps import DTYPES as DTYPE_NAMES
from moe_reps import alternating_reps, difference, print_table

from giantmodel.core.hostmem import keep_freed_host_memory

SHAPE = dict(hidden=512, ffn=1792, experts=8, top_k=2, batch=2, seq=2048)
HF_IMPLS = ("eager", "grouped_mm")


DTYPES = {name: getattr(torch, t) for name, t in DTYPE_NAMES.items()}
# fp32: max |difference|; bf16: relative difference in norm (see the docstring)
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-1}
TOLERANCE_OWN_FP32 = 2e-2


def build(shape: dict, seed: int = 0):
    """giantmodel's MoE and transformers' Mixtral block, holding the same weights."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from giantmodel.config.moe import MoEConfig
    from giantmodel.models.common.moe import MoE

    h, f, e = shape["hidden"], shape["ffn"], shape["experts"]
    ours = MoE(h, f, MoEConfig(num_experts=e, top_k=shape["top_k"], router="softmax",
                               norm_topk_prob=True))
    hf_cfg = MixtralConfig(hidden_size=h, intermediate_size=f, num_local_experts=e,
                           num_experts_per_tok=shape["top_k"], router_jitter_noise=0.0)
    hf = MixtralSparseMoeBlock(hf_cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # experts at std 0.02 like HF's init; router logits of std ~1
        gate = torch.randn(e, h, generator=g) * h ** -0.5
        gate_up = torch.randn(e, 2 * f, h, generator=g) * 0.02
        down = torch.randn(e, h, f, generator=g) * 0.02
        hf.gate.weight.copy_(gate)
        hf.experts.gate_up_proj.copy_(gate_up)
        hf.experts.down_proj.copy_(down)
        ours.router.gate.weight.copy_(gate)
        ours.experts.w1.copy_(gate_up[:, :f].transpose(1, 2))
        ours.experts.w3.copy_(gate_up[:, f:].transpose(1, 2))
        ours.experts.w2.copy_(down.transpose(1, 2))
    ours.init_buffers()
    return ours.train(), hf.train()


def step(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """One forward + backward; the input gradient."""
    x = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    layer(x).backward(grad)
    if hasattr(layer, "take_aux_loss"):
        layer.take_aux_loss()
    return x.grad


def check_equal(ours, hf, x: torch.Tensor, grad: torch.Tensor, impls) -> dict:
    """Differences of outputs, input and weight gradients, per HF
    implementation (:func:`moe_reps.difference`)."""
    out = {}
    with torch.no_grad():
        y_ours = ours(x)
    gx_ours = step(ours, x, grad)
    gw1 = ours.experts.w1.grad
    if x.dtype != torch.float32:
        ref = copy.deepcopy(ours).float()
        ref.init_buffers()
        with torch.no_grad():
            y_ref = ref(x.float())
        gx_ref = step(ref, x.float(), grad.float())
        out["giantmodel_fp32"] = dict(out=difference(y_ours, y_ref), grad_x=difference(gx_ours, gx_ref),
                                      grad_w1=difference(gw1, ref.experts.w1.grad))
    for impl in impls:
        hf.experts.config._experts_implementation = impl
        with torch.no_grad():
            y_hf = hf(x)
        gx_hf = step(hf, x, grad)
        f = gw1.shape[-1]
        gw1_hf = hf.experts.gate_up_proj.grad[:, :f].transpose(1, 2)
        out[impl] = dict(out=difference(y_ours, y_hf), grad_x=difference(gx_ours, gx_hf),
                         grad_w1=difference(gw1, gw1_hf))
    ours.init_buffers()
    return out


def measure(shape: dict, reps: int, warmup: int, impls, dtype: str = "fp32") -> dict:
    ours, hf = build(shape)
    ours.to(DTYPES[dtype])
    hf.to(DTYPES[dtype])
    ours.init_buffers()   # the router's bias and statistics stay fp32
    n = shape["batch"] * shape["seq"]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape["batch"], shape["seq"], shape["hidden"], generator=g)
    grad = torch.randn(x.shape, generator=g) / n ** 0.5
    x, grad = x.to(DTYPES[dtype]), grad.to(DTYPES[dtype])
    diffs = check_equal(ours, hf, x, grad, impls)
    worst = max(v for name, d in diffs.items() for v in d.values() if name in impls)
    own = max(diffs.get("giantmodel_fp32", {}).values(), default=0.0)
    if worst > TOLERANCE[dtype] or own > TOLERANCE_OWN_FP32:
        raise SystemExit(f"outputs differ ({dtype}): {diffs}")
    names = ["giantmodel", *(f"hf_{i}" for i in impls)]

    def run(name: str) -> float:
        layer = ours if name == "giantmodel" else hf
        if layer is hf:
            hf.experts.config._experts_implementation = name[3:]
        t0 = time.perf_counter()
        step(layer, x, grad)
        return time.perf_counter() - t0

    times = alternating_reps(names, reps, warmup, run)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    best_hf = min((m, name) for name, m in median.items() if name != "giantmodel")
    return dict(shape=shape, dtype=dtype, tokens=n, reps=reps, threads=torch.get_num_threads(),
                torch=torch.__version__, machine=platform.processor() or platform.machine(),
                max_abs_diff=diffs, times_s=times, median_s=median,
                tokens_per_s={k: n / v for k, v in median.items()},
                ratio_vs={k: v / median["giantmodel"] for k, v in median.items() if k != "giantmodel"},
                ratio=best_hf[0] / median["giantmodel"], ratio_against=best_hf[1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--tokens", type=int, default=SHAPE["batch"] * SHAPE["seq"],
                   help="tokens per step (2 sequences of half as many)")
    p.add_argument("--hf-impls", default=",".join(HF_IMPLS),
                   help="transformers experts implementations to measure")
    p.add_argument("--dtype", default="fp32,bf16",
                   help="comma-separated precisions, each a separate comparison: fp32, bf16")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default); 1 gives steadier ratios on a "
                        "loaded host, where threads that wait for each other stall")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    keep_freed_host_memory()
    shape = dict(SHAPE, seq=a.tokens // SHAPE["batch"])
    results = {}
    for dtype in a.dtype.split(","):
        res = measure(shape, a.reps, a.warmup, [i for i in a.hf_impls.split(",") if i], dtype)
        print(f"MoE layer fwd+bwd, {dtype}, hidden {shape['hidden']} ffn {shape['ffn']} "
              f"{shape['experts']} experts top-{shape['top_k']}, {res['tokens']} tokens, "
              f"{res['threads']} threads, median of {a.reps}")
        kind = "max |diff|" if dtype == "fp32" else "relative diff"
        print(f"{kind} vs transformers: {res['max_abs_diff']}")
        print_table(res)
        print(f"ratio vs the faster transformers path ({res['ratio_against']}): "
              f"{res['ratio']:.2f}x\n")
        results[dtype] = res
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
