"""Memory per rank and images/s of a Stable Diffusion job, before launch.

The three models are built on the meta device and run once there, which
costs no memory and no time worth mentioning, and gives exact figures for
the shapes in the config:

* FLOPs per image of the UNet forward and backward, the text encoder and
  the VAE encoder (``torch.utils.flop_counter``);
* the bytes autograd saves per image for backward, per UNet block and in
  total, with attention counted as a fused (flash) kernel saves it (inputs,
  output and log-sum-exp, not the score matrix), and the inputs of each
  block, which is all full recompute keeps.

Memory per rank follows the ZeRO paper's accounting for the trainable
parameters (fp32 weights, gradients and two Adam moments: 16 bytes each,
sharded by stage over the shard group), plus the frozen VAE and text
encoder (fp32, sharded under ZeRO-3), the EMA copy (4 bytes per UNet
weight, sharded like the weights), activations for one micro-batch and the
hardware's reserved memory. Time per step is the training FLOPs at
``SD_EFFICIENCY`` of the device's peak, plus the exposed part of the
gradient reduction (and ZeRO-3's parameter gathers) on the slowest link.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from giantmodel.config.errors import ConfigError
from giantmodel.models.sd import build_sd
from giantmodel.models.sd.diffusers_io import read_pipeline_configs

# Share of peak FLOP/s an SD training step reaches on a GPU. Calibrated on the
# one published anchor: MosaicML's SD2-base UNet run with precomputed latents,
# about 36 images/s per A100 (bf16, 512 px): 36 x 2.41 TFLOP per image / 312 TFLOP/s.
# Convolutions with few channels, GroupNorm and small attention heads keep
# diffusion UNets far below the matmul efficiency of large transformers.
SD_EFFICIENCY = 0.28
# Share of the data-parallel gradient reduction hidden behind backward.
COMM_OVERLAP = 0.7
GB = 1e9


class _FlashAttention(TorchFunctionMode):
    """Route SDPA to the fused CPU kernel, which has a meta implementation
    and saves what flash attention saves (not the score matrix)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, is_causal=kwargs.get("is_causal", False))[0]
        return func(*args, **kwargs)


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


@dataclass
class SDCosts:
    """Per-image figures of one model shape at one resolution."""

    unet_params: int
    vae_params: int
    text_params: int
    unet_fwd_flops: float
    unet_bwd_flops: float
    text_flops: float
    vae_encode_flops: float
    saved_bytes: float          # activations autograd keeps, no recompute (UNet + text if trained)
    block_saved_bytes: list[float]
    block_input_bytes: list[float]
    largest_block_params: int


def measure_sd(unet_cfg, vae_cfg, text_cfg, resolution: int, precision: str,
               train_text_encoder: bool) -> SDCosts:
    """Run the models once on the meta device for one image at ``resolution``."""

    model = build_sd(unet_cfg, vae_cfg, text_cfg)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model.to(dtype)
    unet, f = model.unet, vae_cfg.downscale
    names = unet.block_names()
    blocks = [unet.get_submodule(n) for n in names]
    saved = {"total": 0.0}
    per_block = [0.0] * len(blocks)
    inputs = [0.0] * len(blocks)
    current: list[int] = []
    hooks = []
    for i, b in enumerate(blocks):
        def pre(_m, args, kwargs, i=i):
            inputs[i] = _nbytes(list(args) + list(kwargs.values()))
            current.append(i)

        def post(_m, _args, _out):
            current.pop()
        hooks += [b.register_forward_pre_hook(pre, with_kwargs=True), b.register_forward_hook(post)]

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and t.device.type == "meta":
            n = t.numel() * t.element_size()
            saved["total"] += n
            if current:
                per_block[current[-1]] += n
        return t

    with torch.device("meta"), _FlashAttention():
        ids = torch.zeros(1, text_cfg.max_position_embeddings, dtype=torch.long)
        with FlopCounterMode(display=False) as fc_text, \
                (contextlib.nullcontext() if train_text_encoder else torch.no_grad()):
            if train_text_encoder:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    ctx = model.text_encoder(ids)
            else:
                ctx = model.text_encoder(ids)
        x = torch.randn(1, unet_cfg.in_channels, resolution // f, resolution // f, dtype=dtype)
        with FlopCounterMode(display=False) as fc_fwd, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = unet(x, torch.tensor([1]), ctx.detach().requires_grad_(train_text_encoder))
        with FlopCounterMode(display=False) as fc_bwd:
            out.float().sum().backward()
        img = torch.randn(1, vae_cfg.in_channels, resolution, resolution, dtype=dtype)
        with FlopCounterMode(display=False) as fc_vae, torch.no_grad():
            model.vae.moments(img)
    for h in hooks:
        h.remove()
    def count(m: torch.nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    return SDCosts(
        unet_params=count(unet), vae_params=count(model.vae), text_params=count(model.text_encoder),
        unet_fwd_flops=float(fc_fwd.get_total_flops()), unet_bwd_flops=float(fc_bwd.get_total_flops()),
        text_flops=float(fc_text.get_total_flops()), vae_encode_flops=float(fc_vae.get_total_flops()),
        saved_bytes=saved["total"], block_saved_bytes=per_block, block_input_bytes=inputs,
        largest_block_params=max(count(b) for b in blocks))


@dataclass(frozen=True)
class SDLayout:
    dp: int
    zero: int
    shard: int          # ranks each parameter is sharded over (dp, or the HSDP group)
    micro_batch: int
    n_micro: int
    recompute: str
    precision: str

    def describe(self) -> str:
        z = f"zero{self.zero}" + (f"/hsdp{self.shard}" if self.zero and self.shard < self.dp else "")
        return f"dp{self.dp} {z} mb{self.micro_batch}x{self.n_micro} rc:{self.recompute} {self.precision}"


def sd_memory(c: SDCosts, lay: SDLayout, hw, *, train_text: bool, ema: bool) -> dict:
    """Bytes per rank by kind (the worst rank: all ranks are alike here)."""
    trained = c.unet_params + (c.text_params if train_text else 0)
    frozen = c.vae_params + (0 if train_text else c.text_params)
    s = lay.shard if lay.zero else 1
    weights = 4 * trained / (s if lay.zero >= 3 else 1)
    grads = 4 * trained / (s if lay.zero >= 2 else 1)
    optim = 8 * trained / (s if lay.zero >= 1 else 1)
    frozen_b = 4 * frozen / (s if lay.zero >= 3 else 1)
    ema_b = 4 * c.unet_params / (s if lay.zero >= 3 else 1) if ema else 0.0
    if lay.recompute == "full":
        act = (c.saved_bytes - sum(c.block_saved_bytes) + sum(c.block_input_bytes)
               + max(c.block_saved_bytes)) * lay.micro_batch
    else:
        act = c.saved_bytes * lay.micro_batch
    # ZeRO-3 gathers a block's full weights (this one and the next, prefetched)
    gathered = 2 * 2 * c.largest_block_params if lay.zero >= 3 else 0.0
    if lay.precision != "fp32" and lay.zero < 3:
        gathered = 2 * trained  # low-precision weight copies autocast keeps per step
    parts = {"weights (trained)": weights, "gradients": grads, "optimizer states": optim,
             "frozen VAE/text encoder": frozen_b, "EMA": ema_b, "activations": act,
             "gathered / cast weights": gathered, "reserved": hw.reserved_bytes}
    return {"breakdown": parts, "required_bytes_per_rank": sum(parts.values()),
            "capacity_bytes": hw.memory_bytes, "fits": sum(parts.values()) <= hw.memory_bytes}


def sd_time(c: SDCosts, lay: SDLayout, hw, cluster, *, train_text: bool, cached: bool,
            global_batch: int) -> dict:
    per_image = c.unet_fwd_flops + c.unet_bwd_flops
    if lay.recompute == "full":
        per_image += c.unet_fwd_flops
    per_image += c.text_flops * (3 if train_text else 1) + (0 if cached else c.vae_encode_flops)
    images_per_rank = global_batch / lay.dp
    compute = images_per_rank * per_image / (hw.flops(lay.precision) * SD_EFFICIENCY)
    trained = c.unet_params + (c.text_params if train_text else 0)
    bw = (hw.intra_bw if cluster.nodes == 1 else hw.inter_bw) * hw.link_efficiency
    volume = 0.0
    if lay.dp > 1:
        ring = 2 * (lay.dp - 1) / lay.dp
        volume = ring * 4 * trained          # fp32 gradient reduction
        if lay.zero >= 3:
            volume += (lay.shard - 1) / lay.shard * 2 * 2 * trained * lay.n_micro  # gathers fwd+bwd
    comm = volume / bw
    step = compute + comm * (1 - COMM_OVERLAP)
    flops = global_batch * per_image / step / cluster.world
    return {"step_s": step, "compute_s": compute, "comm_s": comm,
            "images_per_sec": global_batch / step,
            "images_per_sec_per_gpu": global_batch / step / cluster.world,
            "tflops_per_gpu": flops / 1e12, "mfu": flops / hw.flops(lay.precision),
            "train_flops_per_image": per_image}


def sd_layout(cfg, cluster) -> SDLayout:
    """The config's own layout on ``cluster`` (data parallelism and sharding only)."""
    p, t = cfg.parallel, cfg.train
    for dim in ("tp", "pp", "cp"):
        if getattr(p, dim) > 1:
            raise ConfigError(f"the diffusion objective does not support {dim} > 1; set "
                              f"parallel.{dim}=1", f"parallel.{dim}")
    dp = cluster.world if p.dp == -1 else p.dp
    if dp != cluster.world:
        raise ConfigError(f"parallel.dp={p.dp} but the cluster has {cluster.world} ranks",
                          "parallel.dp")
    shard = p.shard_group_size or dp
    if dp % shard:
        raise ConfigError(f"{shard} does not divide dp {dp}", "parallel.shard_group_size")
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"{t.global_batch_size} is not divisible by micro_batch_size x dp = "
                          f"{t.micro_batch_size} x {dp}", "train.global_batch_size")
    return SDLayout(dp, p.zero, shard, t.micro_batch_size,
                    t.global_batch_size // (t.micro_batch_size * dp), cfg.recompute, cfg.precision)


def sd_shapes(cfg):
    """(unet, vae, text) configs: from sd.pretrained when set, else the sd section."""
    sd = cfg.sd
    if sd.pretrained:
        from pathlib import Path

        unet, vae, text, _ = read_pipeline_configs(Path(sd.pretrained))
        return unet, vae, text
    return sd.unet, sd.vae, sd.text_encoder


def estimate_sd(cfg, hw, cluster, layout: SDLayout | None = None, costs: SDCosts | None = None
                ) -> dict:
    lay = layout or sd_layout(cfg, cluster)
    sd = cfg.sd
    c = costs or measure_sd(*sd_shapes(cfg), cfg.data.images.resolution, lay.precision,
                            sd.train_text_encoder)
    mem = sd_memory(c, lay, hw, train_text=sd.train_text_encoder, ema=sd.ema)
    perf = sd_time(c, lay, hw, cluster, train_text=sd.train_text_encoder,
                   cached=cfg.data.cache_latents, global_batch=cfg.train.global_batch_size)
    return {"model": {"name": sd.name, "unet_params": c.unet_params, "vae_params": c.vae_params,
                      "text_encoder_params": c.text_params,
                      "resolution": cfg.data.images.resolution},
            "gpu": hw.name, "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node},
            "layout": lay.describe(), "memory": mem, "time": perf}


def plan_sd(cfg, hw, cluster, top: int = 5) -> list[dict]:
    """Layouts (ZeRO stage, HSDP group, micro-batch, recompute) that fit, fastest first."""
    t = cfg.train
    dp = cluster.world
    costs = {}
    rows = []
    shards = sorted({dp, cluster.gpus_per_node} & set(range(1, dp + 1)))
    for zero in (0, 1, 2, 3):
        for shard in (shards if zero else [dp]):
            if dp % shard:
                continue
            for mb in (1, 2, 4, 8, 16, 32, 64):
                if t.global_batch_size % (mb * dp):
                    continue
                for rc in ("none", "full"):
                    lay = SDLayout(dp, zero, shard, mb, t.global_batch_size // (mb * dp), rc,
                                   cfg.precision)
                    if lay.precision not in costs:
                        costs[lay.precision] = measure_sd(*sd_shapes(cfg), cfg.data.images.resolution,
                                                          lay.precision, cfg.sd.train_text_encoder)
                    est = estimate_sd(cfg, hw, cluster, lay, costs[lay.precision])
                    if est["memory"]["fits"]:
                        rows.append((est["time"]["step_s"], lay, est))
    rows.sort(key=lambda r: (r[0], r[1].zero, r[1].recompute != "none"))
    return [dict(r[2], _layout=r[1]) for r in rows[:top]]


def format_sd_estimate(d: dict) -> str:
    m, mem, t = d["model"], d["memory"], d["time"]
    lines = [(f"{m['name']} (UNet {m['unet_params'] / 1e6:.0f}M, VAE {m['vae_params'] / 1e6:.0f}M, "
             f"text encoder {m['text_encoder_params'] / 1e6:.0f}M params, {m['resolution']} px) on "
             f"{d['cluster']['nodes']} x {d['cluster']['gpus_per_node']} {d['gpu']}: {d['layout']}"),
             (f"memory per rank: {mem['required_bytes_per_rank'] / GB:.2f} GB of "
             f"{mem['capacity_bytes'] / GB:.0f} GB -> {'fits' if mem['fits'] else 'DOES NOT FIT'}")]
    for k, v in mem["breakdown"].items():
        lines.append(f"  {k:<26} {v / GB:>9.3f} GB")
    lines.append(f"step {t['step_s']:.3f} s | {t['images_per_sec']:,.2f} images/s "
                 f"({t['images_per_sec_per_gpu']:,.2f}/GPU) | {t['tflops_per_gpu']:.1f} TFLOP/s/GPU | "
                 f"MFU {t['mfu'] * 100:.1f}% | {t['train_flops_per_image'] / 1e12:.3f} TFLOP/image")
    return "\n".join(lines)
