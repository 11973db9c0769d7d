"""Stable Diffusion training throughput: giantmodel against a plain diffusers loop.

Both sides train the same tiny SD (same weights, written by giantmodel as a
diffusers directory and loaded by diffusers) on the same pixel batches at the
same resolution and batch size, one process, fp32, AdamW on the UNet, the
VAE and the text encoder frozen and run every step:

- giantmodel: the diffusion objective through giantmodel's engine
  (``TrainEngine.forward_backward`` + ``optimizer_step``), no latent cache;
- diffusers: the training step of diffusers' ``train_text_to_image.py``
  written as a plain PyTorch loop around diffusers' modules
  (``vae.encode(...).latent_dist.sample() * scaling_factor``,
  ``DDPMScheduler.add_noise``, ``text_encoder(ids)[0]``, ``unet(...).sample``,
  MSE, backward, ``AdamW.step``).

Rounds alternate between the two (A B, then B A, ...) to share the machine's
noise; the figure is images/s per side (median over rounds) and their ratio.

    python benchmarks/sd_train_vs_diffusers.py [--steps 20] [--rounds 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from giantmodel.config import load_config  # noqa: E402
from giantmodel.core.precision import Precision  # noqa: E402
from giantmodel.distributed.parallel_dims import ParallelDims  # noqa: E402
from giantmodel.models.sd.diffusers_io import save_diffusers  # noqa: E402
from giantmodel.objectives import build_objective  # noqa: E402
from giantmodel.train.trainer import build_engine  # noqa: E402

TINY = ["objective=diffusion", "data.source=shapes", "data.images.resolution=32",
        "data.images.num_shapes=256", "sd.unet.block_out_channels=[32,64]",
        "sd.unet.norm_num_groups=8", "sd.unet.attention_head_dim=4",
        "sd.unet.cross_attention_dim=32", "sd.vae.block_out_channels=[16,32]",
        "sd.vae.norm_num_groups=8", "sd.text_encoder.hidden_size=32",
        "sd.text_encoder.intermediate_size=64", "sd.text_encoder.num_attention_heads=4",
        "sd.text_encoder.max_position_embeddings=16", "sd.num_samples=0", "sd.ema=false",
        "sd.caption_dropout=0.0", "train.global_batch_size=16", "train.micro_batch_size=16",
        "optim.warmup_steps=0", "optim.schedule=constant", "optim.grad_clip=0",
        "precision=fp32", "run.tensorboard=false", "run.progress=false"]


def giantmodel_side(cfg, device):
    dims = ParallelDims.from_config(cfg, 1)
    objective = build_objective(cfg)
    engine = build_engine(cfg, objective, dims, torch.device(device))
    loader, _ = objective.build_loaders(dp_rank=0, dp_size=1)
    opt = engine.build_optimizer(cfg.optim)
    precision = Precision("fp32", device)

    def step(batch):
        engine.forward_backward([batch], precision)
        engine.optimizer_step(opt)
        engine.zero_grad(opt)

    return engine.parts[0], loader, step


def diffusers_side(model, out: Path, device):
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    save_diffusers({k: v.detach().cpu() for k, v in model.state_dict().items()}, model.unet.cfg,
                   model.vae.cfg, model.text_encoder.cfg, model.noise, out)
    unet = UNet2DConditionModel.from_pretrained(out / "unet").to(device).train()
    vae = AutoencoderKL.from_pretrained(out / "vae").to(device).requires_grad_(False)
    text = CLIPTextModel.from_pretrained(out / "text_encoder").to(device).requires_grad_(False)
    sched = DDPMScheduler.from_pretrained(out / "scheduler")
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01,
                            eps=1e-8)

    def step(batch):
        pixels = batch["pixel_values"].to(device)
        ids = batch["input_ids"].to(device)
        with torch.no_grad():
            latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
            ehs = text(ids)[0]
        noise = torch.randn_like(latents)
        t = torch.randint(0, sched.config.num_train_timesteps, (latents.shape[0],),
                          device=device).long()
        noisy = sched.add_noise(latents, noise, t)
        pred = unet(noisy, t, ehs).sample
        loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(step, batches, device) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round and side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(overrides=TINY + [f"data.cache_dir={tmp}/cache", f"run.dir={tmp}/run"])
        model, loader, gm_step = giantmodel_side(cfg, args.device)
        df_step = diffusers_side(model, Path(tmp) / "pipe", args.device)
        batches = [next(loader) for _ in range(args.warmup + args.steps)]
        bs = batches[0]["pixel_values"].shape[0]
        for b in batches[:args.warmup]:
            gm_step(b)
            df_step({k: v for k, v in b.items()})
        timed_batches = batches[args.warmup:]
        gm, df = [], []
        sides = [(gm_step, gm), (df_step, df)]
        for r in range(args.rounds):
            for step, out in (sides if r % 2 == 0 else sides[::-1]):
                out.append(bs * len(timed_batches) / timed(step, timed_batches, args.device))
    g, d = statistics.median(gm), statistics.median(df)
    res = cfg.data.images.resolution
    print(f"tiny SD, {res} px, batch {bs}, {args.steps} steps x {args.rounds} rounds, "
          f"{args.device}, {args.threads} threads")
    print(f"giantmodel  {g:8.1f} images/s  (rounds: {', '.join(f'{x:.1f}' for x in gm)})")
    print(f"diffusers   {d:8.1f} images/s  (rounds: {', '.join(f'{x:.1f}' for x in df)})")
    # Each round's two sides ran back to back, so their ratio shares that round's load.
    pairs = [a / b for a, b in zip(gm, df)]
    print(f"ratio of medians giantmodel / diffusers: {g / d:.3f}")
    print(f"per-round ratios: {', '.join(f'{x:.3f}' for x in pairs)}; "
          f"median {statistics.median(pairs):.3f}, min {min(pairs):.3f}")


if __name__ == "__main__":
    main()
