"""The diffusion training loss of one micro-batch, with layout-free randomness.

Every random number of a sample (its timestep, the posterior sample, the
noise, offset noise, input perturbation) comes from a generator seeded by
the run seed and the sample's stream position, never from a global RNG: a
sample gets the same noise whichever rank, micro-batch or layout trains it,
which is what makes every layout equal the single-process run and resume
exact.

The loss follows diffusers' ``train_text_to_image.py``: the mean squared
error of the prediction per image, optionally weighted by min-SNR-gamma,
averaged over images; DreamBooth batches add ``prior_loss_weight`` times the
class images' mean. Here it is returned as ``(sum, count)`` so the engine
can average over the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from giantmodel.config.sd import SDConfig
from giantmodel.data.images import sample_generator
from giantmodel.models.sd.schedule import NoiseSchedule

NOISE_STREAM = 2


def draw_noise(positions: torch.Tensor, latent_shape: tuple[int, int, int], num_timesteps: int,
               seed: int, cfg: SDConfig) -> dict[str, torch.Tensor]:
    """Timesteps [B], posterior noise, noise and the UNet's input noise [B, C, h, w]
    for the samples at ``positions`` (CPU tensors)."""
    C = latent_shape[0]
    ts, post, noise, inp = [], [], [], []
    for p in positions.tolist():
        g = sample_generator(seed, int(p), NOISE_STREAM)
        ts.append(torch.randint(0, num_timesteps, (1,), generator=g))
        post.append(torch.randn(latent_shape, generator=g))
        n = torch.randn(latent_shape, generator=g)
        if cfg.noise_offset:
            n = n + cfg.noise_offset * torch.randn((C, 1, 1), generator=g)
        noise.append(n)
        if cfg.input_perturbation:
            inp.append(n + cfg.input_perturbation * torch.randn(latent_shape, generator=g))
    out = {"timesteps": torch.cat(ts), "posterior_noise": torch.stack(post),
           "noise": torch.stack(noise)}
    if inp:
        out["input_noise"] = torch.stack(inp)
    return out


def per_image_loss(pred: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor,
                   schedule: NoiseSchedule, snr_gamma: float) -> torch.Tensor:
    """[B] mean squared error per image, min-SNR-gamma weighted when ``snr_gamma`` > 0."""
    per = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    if snr_gamma > 0:
        snr = schedule.snr(timesteps.to(per.device))
        weight = torch.clamp(snr, max=snr_gamma)
        weight = weight / snr if schedule.cfg.prediction_type == "epsilon" else weight / (snr + 1)
        per = per * weight
    return per


def model_inputs(batch: dict, draws: dict, device: torch.device) -> dict:
    """Keyword arguments of ``StableDiffusion.forward`` for a loader batch."""
    kw = {k: v.to(device, non_blocking=True) for k, v in draws.items()}
    for key in ("pixel_values", "latent_moments", "input_ids", "encoder_hidden_states"):
        if key in batch:
            kw[key] = batch[key].to(device, non_blocking=True)
    return kw


def reduce_loss(per: torch.Tensor, batch: dict, prior_loss_weight: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, images counted): instance images count, class images (DreamBooth
    prior preservation, as many as instances) add ``prior_loss_weight`` times theirs."""
    prior = batch.get("is_prior")
    if prior is None:
        return per.sum(), torch.tensor(per.shape[0], device=per.device)
    prior = prior.to(per.device)
    inst = per[~prior]
    return (inst.sum() + prior_loss_weight * per[prior].sum(),
            torch.tensor(inst.shape[0], device=per.device))


def latent_shape_of(batch: dict, vae_downscale: int, latent_channels: int) -> tuple[int, int, int]:
    if "latent_moments" in batch:
        _, c2, h, w = batch["latent_moments"].shape
        return (c2 // 2, h, w)
    _, _, H, W = batch["pixel_values"].shape
    return (latent_channels, H // vae_downscale, W // vae_downscale)
