"""A VAE trained on the training images themselves: the tiny default's
stand-in for a pretrained Stable Diffusion autoencoder.

Latent diffusion needs a frozen autoencoder that already reconstructs the
images; the tiny default has none to download, so before diffusion training
it fits one (reconstruction MSE plus a small KL term, as the SD VAE's
objective without its perceptual and adversarial terms) for
``sd.vae_pretrain_steps`` steps. The result is cached under
``data.cache_dir/sd-vae/`` keyed by everything that determines it, so the
next run loads it in a second. The scaling factor is set to 1 / std of the
latents, as the SD authors chose 0.18215 for theirs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from giantmodel.config.loader import to_dict
from giantmodel.config.sd import VAEConfig
from giantmodel.data.images import preprocess
from giantmodel.models.sd.model import init_sd_weights
from giantmodel.models.sd.vae import AutoencoderKL

KL_WEIGHT = 1e-6
MAX_IMAGES = 1024


def _key(cfg: VAEConfig, source, resolution: int, steps: int, seed: int) -> str:
    parts = {"vae": to_dict(cfg), "data": [source.name, len(source)], "res": resolution,
             "steps": steps, "seed": seed, "kl": KL_WEIGHT, "v": 1}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def fit_vae(cfg: VAEConfig, source, *, resolution: int, steps: int, seed: int,
            batch_size: int = 16, lr: float = 3e-3) -> tuple[dict[str, torch.Tensor], float]:
    """(state dict, scaling factor) of an AutoencoderKL fitted to ``source`` on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    vae = init_sd_weights(AutoencoderKL(cfg), seed)
    n = min(len(source), MAX_IMAGES)
    images = torch.stack([preprocess(source.load(i)[0], resolution, True, False) for i in range(n)])
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=lr * 0.05)
    for _ in range(steps):
        idx = torch.randint(0, n, (batch_size,), generator=gen)
        x = images[idx]
        flip = torch.rand(batch_size, generator=gen) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        post = vae.posterior(x)
        z = post.sample(torch.randn(post.mean.shape, generator=gen))
        loss = (vae.decode(z) - x).pow(2).mean() + KL_WEIGHT * post.kl().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    with torch.no_grad():
        std = torch.cat([vae.encode(images[i:i + 64]) for i in range(0, n, 64)]).std()
    return {k: v.detach().clone() for k, v in vae.state_dict().items()}, float(1.0 / std)


def cached_vae(cfg: VAEConfig, source, *, resolution: int, steps: int, seed: int,
               cache_dir: Path, compute: bool) -> tuple[Path, bool]:
    """The cache file of the fitted VAE and whether it exists; fits and writes
    it first when ``compute`` (one rank per job) and it is missing."""
    path = Path(cache_dir) / "sd-vae" / f"{_key(cfg, source, resolution, steps, seed)}.safetensors"
    if compute and not path.is_file():
        from safetensors.torch import save_file

        state, scale = fit_vae(cfg, source, resolution=resolution, steps=steps, seed=seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        save_file(state, str(tmp), metadata={"scaling_factor": repr(scale)})
        os.replace(tmp, path)
    return path, path.is_file()


def read_cached_vae(path: Path) -> tuple[dict[str, torch.Tensor], float]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not iterable
        scale = float(f.metadata()["scaling_factor"])
    return state, scale
