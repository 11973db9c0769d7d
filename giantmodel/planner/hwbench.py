"""Measure this machine as a planner hardware profile (``giantmodel bench hw``).

On the chosen device it measures:

* the matmul rate over a range of square sizes, per precision: the *curve*
  the planner interpolates for every GEMM of a layer (small GEMMs are slower);
  on a CPU each call from cold caches, as a training step meets its weights;
* causal attention (``scaled_dot_product_attention``) FLOP/s, as a share of
  the matmul peak;
* memory bandwidth: a large copy (bytes read + written per second), and an
  elementwise add as the share of it that elementwise kernels reach;
* the optimizer: parameters per second the project's AdamW updates (on a
  CPU this is arithmetic-bound, far below what the bandwidth suggests);
* the host time each aten op costs more when its arguments are DTensors
  (tensor and sequence parallelism dispatch every block op on DTensors):
  two blocks, forward and backward, as DTensors and as plain tensors, over
  the number of DTensor ops they run; on a GPU tiny blocks, on a CPU the
  model's own (``--config``) or one of training size, since there the
  figure grows with the kernels run between the ops;
* under ``torchrun`` (WORLD_SIZE > 1): the links, with the placement
  topology probe (giantmodel.distributed.linkprobe: point-to-point latency and
  bandwidth inside a host and between hosts), and the all-reduce bus
  bandwidth of the whole group, stored as the share of the link bandwidth
  that collectives reach (``link_efficiency``).

It writes a profile YAML that ``estimate`` and ``plan`` read with
``--profile FILE`` (or ``--gpu measured``, which reads the default location).
Measured rates are what kernels achieve here, so efficiencies are stored
as 1.0 where the figure itself is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from pathlib import Path

import yaml

from giantmodel.comm import backend_for
from giantmodel.config import load_config
from giantmodel.config.comm import CommConfig
from giantmodel.config.errors import ConfigError
from giantmodel.config.model import ModelConfig
from giantmodel.config.train import OptimConfig
from giantmodel.core.loss import cross_entropy_sum
from giantmodel.core.optim import build_adamw
from giantmodel.distributed.init import bind_cpu_cores, world_info
from giantmodel.distributed.linkprobe import probe_links
from giantmodel.models.registry import build_model, init_weights
from giantmodel.parallel.tensor import (
    apply_tensor_parallel,
    loss_parallel_context,
    vocab_parallel_cross_entropy,
)
from giantmodel.planner.hardware import GB, MEASURED_PROFILE_FILE, NCCL_CHANNELS
from giantmodel.planner.measure import DTensorOpCounter

DTYPES = ("fp32", "bf16", "fp16")


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best_time(fn, device: str, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _busy_time(fn, device: str, repeats: int, min_round_s: float = 0.02) -> float:
    """Seconds per call of ``fn`` as training sees it. Alone: the best call.
    With the host's other ranks measuring at once (:func:`_together`): the
    median over ``repeats`` rounds of each round's mean, a round running
    back-to-back calls for at least ``min_round_s``. The best call would be
    a moment when a drifting peer left the shared caches and memory bus to
    this rank (on the 2-core test host the fp32 GEMM curve read 97 GFLOP/s
    so, 92 with both ranks busy); three back-to-back 1 ms calls, as before,
    once read attention at 0.15 of peak against 0.35-0.40 in other runs.
    A slow phase of the host that lasts the whole measurement still shows."""
    if not _ranks_together():
        return _best_time(fn, device, repeats)
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    calls = max(1, math.ceil(min_round_s / max(time.perf_counter() - t0, 1e-9)))
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        means.append((time.perf_counter() - t0) / calls)
    return statistics.median(means)


def _dtype(name: str):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def last_level_cache_bytes() -> int:
    """Size of this CPU's largest cache (sysfs), 32 MiB where it is not stated."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or 32 * 2 ** 20


def _cold_time(fn, repeats: int, flush) -> float:
    """Seconds per call of ``fn`` (CPU) with the caches emptied before each
    call by ``flush``: the median call with the host's other ranks measuring
    at once, else the best."""
    fn()
    times = []
    for _ in range(max(repeats, 5)):
        flush()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) if _ranks_together() else min(times)


def matmul_flops(device: str, dtype: str, n: int, repeats: int = 3) -> float:
    """Achieved FLOP/s of n x n x n matmuls in the three layouts training runs
    (forward a @ b, input gradient a @ b^T, weight gradient a^T @ b): total
    FLOPs over the sum of each layout's time.

    On a CPU each call starts from cold caches, as in a training step: there
    a layer's weight was last read a whole forward or backward ago, and the
    kernels since have filled the caches with other tensors. Timed back to
    back instead, the operands stay cached: on the 2-core test host the
    check model's GEMMs ran at 87 GFLOP/s inside a step, at 86 with the
    caches emptied first, and at 92-100 back to back (the same flushing as
    Triton's ``do_bench``, which empties the GPU's L2 before each call)."""
    import torch

    a = torch.randn(n, n, device=device).to(_dtype(dtype))
    b = torch.randn(n, n, device=device).to(_dtype(dtype))
    calls = (lambda: a @ b, lambda: a @ b.t(), lambda: a.t() @ b)
    if device.startswith("cuda"):
        t = sum(_busy_time(fn, device, repeats) for fn in calls)
    else:
        junk = torch.empty(2 * last_level_cache_bytes() // 4)
        t = sum(_cold_time(fn, repeats, lambda: junk.fill_(1.0)) for fn in calls)
    return 3 * 2.0 * n ** 3 / t


def adamw_rate(device: str, numel: int, repeats: int = 3) -> float:
    """Parameters per second that the project's AdamW (``optim.impl: auto``: fused
    on CUDA and CPU) updates, over ``numel`` parameters in 8 tensors."""
    import torch

    # imported when measuring (they pull in torch), so the CLI starts fast

    params = [torch.nn.Parameter(torch.randn(numel // 8, device=device)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = build_adamw(params, OptimConfig(), device.split(":")[0])
    return numel / _busy_time(opt.step, device, repeats)


def _together() -> None:
    """Start the next measurement on every rank at once (under torchrun or a
    test's process group): ranks that share a host share its caches and
    memory bandwidth in training, so each figure is taken with all of them
    busy, not in the gaps a drifting peer leaves."""
    import torch.distributed as dist

    if _ranks_together():
        dist.barrier()


def _ranks_together() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1


def matmul_curve(device: str, dtype: str, sizes: list[int], repeats: int = 3,
                 rounds: int | None = None) -> list[list[float]]:
    """[[n, FLOP/s], ...] for each size, made non-decreasing (a larger GEMM
    can always be run as the smaller one's tiles). On a CPU every size is
    measured in ``rounds`` passes over all sizes (default 3) and its median
    kept: a slow phase of a shared host then moves one pass, not the point
    (one cold pass on the 2-core test host read 68 GFLOP/s at 512 where the
    runs around it read 82-89)."""
    rounds = rounds or (1 if device.startswith("cuda") else 3)
    rates: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            _together()
            rates[n].append(matmul_flops(device, dtype, n, repeats))
    out, best = [], 0.0
    for n in sizes:
        best = max(best, statistics.median(rates[n]))
        out.append([float(n), best])
    return out


def attention_flops(device: str, dtype: str, seq: int, heads: int = 8, head_dim: int = 64,
                    repeats: int = 3) -> float:
    """Causal SDPA forward FLOP/s, counted as the planner counts them:
    2 * seq^2 * heads * head_dim (QK^T and AV, each half-masked)."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, heads, seq, head_dim, device=device).to(_dtype(dtype))
               for _ in range(3))
    t = _busy_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device,
                   repeats)
    return 2.0 * seq * seq * heads * head_dim / t


def memory_bandwidth(device: str, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """(copy bandwidth, elementwise-add bandwidth), bytes moved per second."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy = 2.0 * nbytes / _busy_time(lambda: dst.copy_(src), device, repeats)
    add = 3.0 * nbytes / _busy_time(lambda: torch.add(src, src, out=dst), device, repeats)
    return copy, add


def fresh_memory_rate(nbytes: int = 64 * 2 ** 20, repeats: int = 5) -> float:
    """Bytes per second at which this host maps fresh memory and faults it in.

    A CPU buffer above glibc's largest mmap threshold (32 MiB) is unmapped
    when freed, so each use of a new one pays a page fault per page on top
    of the write; this is the write of a freshly allocated ``nbytes`` buffer,
    less the same write into memory already mapped, per byte."""
    import torch

    n = nbytes // 4
    warm = torch.empty(n)
    warm.zero_()
    touched = _busy_time(warm.zero_, "cpu", repeats)
    fresh = _busy_time(lambda: torch.empty(n).zero_(), "cpu", repeats)
    return nbytes / max(fresh - touched, 1e-9)


# The block the DTensor overhead is timed on when no model is given: on a GPU
# tiny, so that the host's dispatch, not the kernels, sets the time; on a CPU
# of training size (see dtensor_op_overhead).
TINY_BLOCK = (ModelConfig(arch="llama", hidden_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, ffn_hidden_size=128, vocab_size=256, max_seq_len=16), 16)
CPU_BLOCK = (ModelConfig(arch="llama", hidden_size=512, num_layers=2, num_heads=8,
                         num_kv_heads=4, ffn_hidden_size=1408, vocab_size=256,
                         max_seq_len=512), 512)


def block_of(model: ModelConfig, tokens: int) -> tuple[ModelConfig, int]:
    """A two-block copy of ``model``'s block with a small vocabulary (the
    head's own ops are not what is timed), and its tokens per micro-batch."""
    small = dataclasses.replace(model, num_layers=2, vocab_size=256,
                                max_seq_len=max(tokens, model.max_seq_len))
    return small, tokens


def dtensor_op_overhead(device: str, repeats: int = 7, calls: int | None = None,
                        block: tuple[ModelConfig, int] | None = None) -> float:
    """Seconds each aten op costs more when its arguments are DTensors
    (sharding propagation, redistribution, unwrapping and rewrapping, in
    Python on the host): forward and backward of a two-block model
    (``block``: its config and tokens per micro-batch), with its
    vocab-parallel loss, sharded by this project's tensor-parallel plan and
    plain, the difference (the median of back-to-back pairs,
    :func:`_paired_extra`) over the DTensor ops it dispatches (counted). The
    mesh is this rank alone, so the shards are whole, the blocks' kernels
    are the same in both, and nothing crosses a link (the planner counts
    the traffic apart).

    On a CPU the figure depends on the block's size: the kernels between two
    ops run on the same core and evict the interpreter's code and data, so
    each op's dispatch starts from colder caches the larger the block. On
    the 2-core test host, two ranks measuring at once read 44-46 us per op
    on a 64-wide block of 16 tokens and 86-113 us on the planner host
    check's 384-wide block of 512 tokens; that check's tp 2 step spent
    0.27 s more on the host than its dp 2 step (cProfile), about 170 us
    for each of its 1,602 DTensor ops, collectives included. So on a CPU it is
    timed at the block of the model being planned where one is given
    (``giantmodel bench hw --config``, the host check), else at a block of
    training size (:data:`CPU_BLOCK`); on a GPU at a tiny one, which
    leaves the host's dispatch as the whole time.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cfg, tokens = TINY_BLOCK if device.startswith("cuda") else (block or CPU_BLOCK)
    calls = calls or (5 if tokens <= TINY_BLOCK[1] else 2)   # a large block's step is long
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = dist.get_world_size()
        kind = device.split(":")[0]
        # every rank makes the 2-D mesh (its groups are collective); each keeps its own row
        mesh = (init_device_mesh(kind, (world, 1), mesh_dim_names=("rest", "tp"))["tp"]
                if world > 1 else init_device_mesh(kind, (1,), mesh_dim_names=("tp",)))
        ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=device)

        def make(tp: bool):
            model = build_model(cfg, device)
            init_weights(model, cfg, 1)
            if tp:
                apply_tensor_parallel(model, mesh, sp=False)

            def step():
                with loss_parallel_context(tp):
                    vocab_parallel_cross_entropy(model(ids), ids)[0].backward()
                for p in model.parameters():
                    p.grad = None
            return step

        plain, dt = make(False), make(True)
        with DTensorOpCounter() as counter:
            dt()
        ops = counter.n
        extra = _paired_extra(dt, plain, device, repeats, calls)
        return max(0.0, extra / calls / max(1, ops))
    finally:
        if own:
            dist.destroy_process_group()


def _paired_extra(fn, base, device: str, pairs: int, calls: int) -> float:
    """Seconds ``calls`` runs of ``fn`` take beyond as many of ``base``: the
    median over ``pairs`` of back-to-back pairs. Timing all of one, then all
    of the other, reads any drift of the host between the two blocks as a
    difference between them: on the 2-core test host the DTensor figure so
    read moved from 4 to 203 us per op between rounds of the same check."""
    def run(f):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        _sync(device)
        return time.perf_counter() - t0
    run(fn), run(base)
    diffs = []
    for i in range(pairs):
        # alternate which goes first, so that neither always runs on the other's warm caches
        first, second = (fn, base) if i % 2 == 0 else (base, fn)
        a, b = run(first), run(second)
        diffs.append(a - b if first is fn else b - a)
    return statistics.median(diffs)


def loss_time_per_logit(device: str, tokens: int, vocab: int, repeats: int = 5) -> float:
    """Seconds per logit of the training loss, forward and backward: cross
    entropy in fp32 over a ``tokens`` x ``vocab`` logits tensor, as
    ``core.loss`` computes it, each call allocating its outputs afresh as a
    step does. On the 2-core test host it reads 2-7 ns per logit, rising with
    the tensor's size (1M to 16M logits) as it outgrows the caches: four to
    ten times a memory-bound estimate of its bytes."""
    import torch

    logits = torch.randn(tokens, vocab, device=device, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device=device)

    def step():
        cross_entropy_sum(logits, labels)[0].backward()
        logits.grad = None
    return _busy_time(step, device, repeats) / (tokens * vocab)


def _init_default_group(device: str) -> None:
    """The process group a training job of this size would get (``comm.backend:
    auto``: NCCL on CUDA, the giant backend on CPU), so the link figures are
    the ones training sees."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend, options = backend_for(CommConfig(), device.split(":")[0], world)
    dist.init_process_group(backend, pg_options=options)


def link_bandwidth(device: str, nbytes: int = 64 * 2 ** 20, repeats: int = 3) -> dict | None:
    """All-reduce bus bandwidth and per-step latency of the default group when
    run under torchrun; None in a single process."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        _init_default_group(device)
    if dist.get_world_size() <= 1:
        return None
    n = dist.get_world_size()
    big = torch.ones(nbytes // 4, device=device)
    small = torch.ones(1, device=device)

    def reduce(t):
        return lambda: dist.all_reduce(t)
    t_big = _best_time(reduce(big), device, repeats)
    t_small = _best_time(reduce(small), device, repeats * 3)
    busbw = 2.0 * (n - 1) / n * nbytes / max(t_big - t_small, 1e-9)
    one_node = int(os.environ.get("LOCAL_WORLD_SIZE", n)) == n
    return {"busbw": busbw, "latency_s": t_small / max(1, 2 * (n - 1)), "one_node": one_node,
            "world": n, "rank": dist.get_rank()}


def measure(device: str = "cpu", sizes: list[int] | None = None, mem_mb: int | None = None,
            attn_seq: int | None = None, model: ModelConfig | None = None,
            tokens: int = 512) -> dict:
    """A profile mapping (fields of HardwareProfile) for ``device``; ``model``
    and ``tokens`` (per micro-batch): the model whose block the DTensor
    overhead is timed on (:func:`dtensor_op_overhead`) and whose loss is
    (:func:`loss_time_per_logit`), on a CPU."""
    import torch
    import torch.distributed as dist

    gpu = device.startswith("cuda")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        # under torchrun: every rank measures at once (_together)
        _init_default_group(device)
    sizes = sizes or ([256, 512, 1024, 2048, 4096, 8192] if gpu else [32, 64, 128, 256, 512, 1024])
    nbytes = (mem_mb or (1024 if gpu else 256)) * 2 ** 20
    curves, peaks = {}, {}
    for dt in DTYPES:
        try:
            curves[dt] = matmul_curve(device, dt, sizes)
        except RuntimeError:  # a dtype the device cannot multiply
            continue
        peaks[dt] = curves[dt][-1][1]
    main = "bf16" if gpu and "bf16" in peaks else "fp32"
    _together()
    attn = attention_flops(device, main, attn_seq or (4096 if gpu else 512))
    _together()
    copy, add = memory_bandwidth(device, nbytes)
    # as many parameters as the copy test's bytes: the states (16 B each) then
    # outgrow the caches, as a model's do
    _together()
    adam = adamw_rate(device, nbytes // 4)
    dtensor_op = dtensor_op_overhead(device, block=None if model is None else block_of(model, tokens))
    _together()
    fresh = loss = None
    if not gpu:
        fresh = fresh_memory_rate()
        _together()
        loss = loss_time_per_logit(device, tokens, model.vocab_size if model else 32000)
    if gpu:
        props = torch.cuda.get_device_properties(device)
        capacity, gpn = float(props.total_memory), torch.cuda.device_count()
        share = NCCL_CHANNELS / props.multi_processor_count
    else:
        capacity = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        gpn = 1
        share = 0.0
    prof = {"peak_flops": peaks, "memory_bytes": capacity, "memory_bw": copy,
            "intra_link": "nvlink4" if gpu else "shm",
            "intra_bw": 100 * GB if gpu else copy / 8,
            "inter_bw": 12.5 * GB if gpu else 1.25 * GB, "gpus_per_node": gpn,
            "matmul_efficiency": 1.0, "matmul_curve": curves,
            "attention_efficiency": min(1.0, attn / peaks[main]),
            "memory_efficiency": min(1.0, add / copy), "stream_efficiency": min(1.0, add / copy),
            "link_efficiency": 0.8, "collective_sm_share": share, "adamw_rate": adam, "dtensor_op_s": dtensor_op,
            "fresh_memory_bw": fresh, "loss_elem_s": loss,
            "reserved_bytes": 2.5 * GB if gpu else 0.5 * GB,
            "host_memory_bytes": capacity}
    links = link_bandwidth(device)
    if links is not None:
        prof.update(probe_link_figures(device))
        slowest = prof["intra_bw"] if links["one_node"] else prof["inter_bw"]
        prof["link_efficiency"] = min(1.0, links["busbw"] / slowest)
        if links["one_node"] and not gpu:
            prof["gpus_per_node"] = links["world"]
    return prof


def probe_link_figures(device: str) -> dict:
    """intra_bw / inter_bw / latency_s from the topology probe: the median
    point-to-point bandwidth of rank pairs inside a host and across hosts."""
    import numpy as np

    # the probe lives in the distributed layer; imported here so that a
    # single-process `bench hw` does not need a process group

    topo = probe_links("hosts")
    host = np.empty(topo.world_size, dtype=np.int64)
    for h, ranks in enumerate(topo.host_ranks):
        host[ranks] = h
    same = host[:, None] == host[None, :]
    off = ~np.eye(topo.world_size, dtype=bool)
    out = {}
    for key, mask in (("intra_bw", same & off), ("inter_bw", ~same)):
        vals = topo.beta[mask]
        vals = vals[np.isfinite(vals) & (vals > 0)]
        if vals.size:
            out[key] = float(np.median(vals))
    alphas = topo.alpha[off]
    alphas = alphas[alphas > 0]
    if alphas.size:
        out["latency_s"] = float(np.median(alphas))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--name", default=None,
                   help="profile name (default: measured; give it to --gpu with --hw-file)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated matmul sizes n (n x n x n) for the efficiency curve")
    p.add_argument("--mem-mb", type=int, default=None, help="bytes copied for the bandwidth test")
    p.add_argument("--attn-seq", type=int, default=None, help="sequence length of the attention test")
    p.add_argument("--config", default=None,
                   help="a training YAML: on a CPU, time the DTensor overhead on its model's "
                        "block and the loss at its vocabulary, at its micro-batch (both figures "
                        "grow with the size)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (match what each training rank will use)")
    p.add_argument("--out", default=None,
                   help=f"profile YAML to write (default: {MEASURED_PROFILE_FILE}, "
                        "which --gpu measured reads)")


def main(args) -> int:

    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise ConfigError(f"--device must be cpu or cuda[:N], got {args.device!r}", "--device")
    import torch
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is visible", "--device")
    try:
        sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else None
    except ValueError:
        raise ConfigError(f"--sizes must be comma-separated integers, got {args.sizes!r}",
                          "--sizes") from None
    if sizes is not None and (not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1):
        raise ConfigError(f"--sizes must increase and be >= 1, got {args.sizes!r}", "--sizes")
    if args.device == "cpu":   # under torchrun: ranks pinned as training pins them
        bind_cpu_cores(world_info(), args.threads)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokens = None, 512
    if args.config:
        cfg = load_config(args.config)
        model, tokens = cfg.model, cfg.train.micro_batch_size * cfg.train.seq_len
    prof = measure(args.device, sizes, args.mem_mb, args.attn_seq, model, tokens)
    name = args.name or "measured"
    out = Path(args.out) if args.out else MEASURED_PROFILE_FILE
    import torch.distributed as dist
    if dist.is_initialized():
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0   # rank 0 writes the profile and reports
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump({name: prof}, sort_keys=False))
    for dt, curve in prof["matmul_curve"].items():
        pts = " ".join(f"{int(n)}:{r / 1e9:.1f}" for n, r in curve)
        print(f"matmul {dt:<5} GFLOP/s by size {pts}")
    print(f"attention {prof['attention_efficiency'] * 100:.0f}% of the matmul peak")
    print(f"memory bandwidth {prof['memory_bw'] / GB:8.1f} GB/s (copy), elementwise "
          f"{prof['memory_efficiency'] * 100:.0f}% of it; AdamW {prof['adamw_rate'] / 1e6:.0f} "
          "M params/s")
    print(f"DTensor dispatch {prof['dtensor_op_s'] * 1e6:.0f} us per op more than a plain tensor's")
    if "latency_s" in prof:
        print(f"links (point to point) {prof['intra_bw'] / GB:.2f} GB/s in a host, "
              f"{prof['inter_bw'] / GB:.2f} GB/s between hosts, latency "
              f"{prof['latency_s'] * 1e6:.0f} us; all-reduce reaches "
              f"{prof['link_efficiency'] * 100:.0f}% of it")
    print(f"wrote profile {name!r} to {out}")
    return 0
