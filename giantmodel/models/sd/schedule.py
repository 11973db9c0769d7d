"""The forward diffusion process and the DDIM and Euler samplers.

Numbers follow diffusers' DDPM/DDIM/Euler schedulers exactly (the same float32
betas, the same timestep spacings, the same update rules), so a model trained
here samples the same in diffusers and the other way round.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from giantmodel.config.sd import NoiseConfig


def make_betas(cfg: NoiseConfig) -> torch.Tensor:
    """[T] float32 betas of ``cfg.beta_schedule`` (on the CPU even under a meta-device context)."""
    T = cfg.num_train_timesteps
    if cfg.beta_schedule == "linear":
        return torch.linspace(cfg.beta_start, cfg.beta_end, T, dtype=torch.float32, device="cpu")
    if cfg.beta_schedule == "scaled_linear":
        return torch.linspace(cfg.beta_start ** 0.5, cfg.beta_end ** 0.5, T, dtype=torch.float32,
                              device="cpu") ** 2
    if cfg.beta_schedule == "squaredcos_cap_v2":
        def alpha_bar(t: float) -> float:
            return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
        betas = [min(1 - alpha_bar((i + 1) / T) / alpha_bar(i / T), 0.999) for i in range(T)]
        return torch.tensor(betas, dtype=torch.float32, device="cpu")
    raise ValueError(f"unknown beta_schedule {cfg.beta_schedule!r}")


class NoiseSchedule:
    """q(x_t | x_0) = N(sqrt(abar_t) x_0, (1 - abar_t) I), with abar = cumprod(1 - beta)."""

    def __init__(self, cfg: NoiseConfig):
        self.cfg = cfg
        self.betas = make_betas(cfg)
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, dim=0)

    @property
    def num_timesteps(self) -> int:
        return self.cfg.num_train_timesteps

    def _coeffs(self, t: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acp = self.alphas_cumprod.to(like.device, like.dtype)[t.to(like.device)]
        shape = (-1,) + (1,) * (like.dim() - 1)
        return acp.sqrt().view(shape), (1 - acp).sqrt().view(shape)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a, s = self._coeffs(t, x0)
        return a * x0 + s * noise

    def velocity(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The v-prediction target sqrt(abar) eps - sqrt(1 - abar) x0."""
        a, s = self._coeffs(t, x0)
        return a * noise - s * x0

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """What the UNet is trained to predict under ``prediction_type``."""
        return noise if self.cfg.prediction_type == "epsilon" else self.velocity(x0, noise, t)

    def snr(self, t: torch.Tensor) -> torch.Tensor:
        """Signal-to-noise ratio abar / (1 - abar) at integer timesteps ``t``."""
        acp = self.alphas_cumprod.to(t.device)[t]
        return (acp.sqrt() / (1 - acp).sqrt()) ** 2

    # ------------------------------------------------------------ sampling
    def sampling_timesteps(self, steps: int) -> np.ndarray:
        """Integer timesteps, descending, for ``steps`` sampling steps."""
        T, c = self.cfg.num_train_timesteps, self.cfg
        if not 1 <= steps <= T:
            raise ValueError(f"steps must be in [1, {T}], got {steps}")
        if c.timestep_spacing == "linspace":
            return np.linspace(0, T - 1, steps).round()[::-1].copy().astype(np.int64)
        if c.timestep_spacing == "leading":
            ts = (np.arange(0, steps) * (T // steps)).round()[::-1].copy().astype(np.int64)
            return ts + c.steps_offset
        ts = np.round(np.arange(T, 0, -T / steps)).astype(np.int64)
        return ts - 1


ModelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(model input [B, C, h, w], timestep scalar tensor) -> prediction."""


def ddim_sample(schedule: NoiseSchedule, model: ModelFn, noise: torch.Tensor, steps: int,
                eta: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """DDIM from pure noise ``noise`` to x_0 (diffusers' DDIMScheduler with
    clip_sample and set_alpha_to_one off, as SD's scheduler config has them)."""
    T = schedule.num_timesteps
    acp = schedule.alphas_cumprod
    stride = T // steps
    x = noise
    for t in schedule.sampling_timesteps(steps):
        t = int(t)
        out = model(x, torch.tensor(t))
        prev = t - stride
        a_t = acp[t]
        a_prev = acp[prev] if prev >= 0 else acp[0]
        b_t = 1 - a_t
        if schedule.cfg.prediction_type == "epsilon":
            x0 = (x - b_t ** 0.5 * out) / a_t ** 0.5
            eps = out
        else:
            x0 = a_t ** 0.5 * x - b_t ** 0.5 * out
            eps = a_t ** 0.5 * out + b_t ** 0.5 * x
        std = 0.0
        if eta > 0:
            var = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
            std = eta * var ** 0.5
        x = a_prev ** 0.5 * x0 + (1 - a_prev - std ** 2) ** 0.5 * eps
        if eta > 0:
            x = x + std * torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)
    return x


def euler_sigmas(schedule: NoiseSchedule, steps: int) -> tuple[np.ndarray, torch.Tensor]:
    """(float timesteps, sigmas with a trailing 0) of diffusers' EulerDiscreteScheduler."""
    c, T = schedule.cfg, schedule.num_timesteps
    if c.timestep_spacing == "linspace":
        ts = np.linspace(0, T - 1, steps, dtype=np.float32)[::-1].copy()
    elif c.timestep_spacing == "leading":
        ts = (np.arange(0, steps) * (T // steps)).round()[::-1].copy().astype(np.float32)
        ts += c.steps_offset
    else:
        ts = np.arange(T, 0, -T / steps).round().copy().astype(np.float32) - 1
    acp = schedule.alphas_cumprod
    sig = np.array(((1 - acp) / acp) ** 0.5)
    sig = np.interp(ts, np.arange(0, len(sig)), sig)
    sig = np.concatenate([sig, [0.0]]).astype(np.float32)
    return ts, torch.from_numpy(sig)


def euler_sample(schedule: NoiseSchedule, model: ModelFn, noise: torch.Tensor, steps: int
                 ) -> torch.Tensor:
    """Euler (Karras et al. 2022, Algorithm 2 without churn) from unit noise ``noise``."""
    ts, sigmas = euler_sigmas(schedule, steps)
    smax = sigmas.max()
    init = smax if schedule.cfg.timestep_spacing in ("linspace", "trailing") else (smax ** 2 + 1) ** 0.5
    x = noise * init
    for i, t in enumerate(ts):
        sigma = sigmas[i]
        out = model(x / (sigma ** 2 + 1) ** 0.5, torch.tensor(float(t)))
        xf = x.float()
        if schedule.cfg.prediction_type == "epsilon":
            x0 = xf - sigma * out
        else:
            x0 = out * (-sigma / (sigma ** 2 + 1) ** 0.5) + xf / (sigma ** 2 + 1)
        x = (xf + (xf - x0) / sigma * (sigmas[i + 1] - sigma)).to(out.dtype)
    return x


SAMPLERS = {"ddim": ddim_sample, "euler": euler_sample}
