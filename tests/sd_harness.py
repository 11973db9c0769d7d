"""Train a tiny Stable Diffusion a few steps under any layout, and compare.

Used by the SD layout-matrix and resume tests from inside
``giantmodel.testing.run_ranks`` (and in the parent for the single-process
reference). The data path is the real one: generated shapes through the
diffusion objective's loader (dp-sliced), per-sample noise seeded by stream
position, caption dropout on, EMA on.
"""

from __future__ import annotations

import torch

STEPS = 3

TINY_SD = [
    "objective=diffusion", "data.source=shapes", "data.images.resolution=16",
    "data.images.num_shapes=32", "data.val_batches=1",
    "sd.unet.block_out_channels=[16,32]", "sd.unet.norm_num_groups=8",
    "sd.unet.attention_head_dim=2", "sd.unet.cross_attention_dim=16",
    "sd.vae.block_out_channels=[8,16]", "sd.vae.norm_num_groups=8",
    "sd.text_encoder.hidden_size=16", "sd.text_encoder.intermediate_size=32",
    "sd.text_encoder.num_attention_heads=2", "sd.text_encoder.vocab_size=600",
    "sd.text_encoder.max_position_embeddings=12", "sd.caption_dropout=0.25",
    "sd.ema=true", "sd.ema_decay=0.9", "sd.num_samples=0",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=3",
    "optim.lr=0.002", "optim.eps=1e-6", "optim.warmup_steps=0", "optim.schedule=constant",
    "optim.grad_clip=1.0", "precision=fp32", "run.tensorboard=false", "run.progress=false",
]


def make_config(overrides: list[str], cache_dir: str, run_dir: str | None = None):
    from giantmodel.config import load_config

    extra = [f"data.cache_dir={cache_dir}", f"run.dir={run_dir or cache_dir + '/run'}"]
    return load_config(overrides=TINY_SD + extra + list(overrides))


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().float().cpu().clone()


def run_steps(cfg, steps: int = STEPS, device: str = "cpu") -> dict:
    """Train ``steps`` steps under ``cfg`` in this process group (or alone)."""
    import torch.distributed as dist

    from giantmodel.core.precision import Precision
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.models import canonical_name
    from giantmodel.objectives import build_objective
    from giantmodel.train.trainer import build_engine

    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.from_config(cfg, world)
    if world > 1:
        dims.build_mesh(device)
    objective = build_objective(cfg)
    engine = build_engine(cfg, objective, dims, torch.device(device))
    loader, _ = objective.build_loaders(dp_rank=engine.data_rank, dp_size=engine.data_world)
    precision = Precision(cfg.precision, device)
    opt = engine.build_optimizer(cfg.optim)
    micro = dims.microbatches(cfg.train)
    losses, norms = [], []
    for _ in range(steps):
        losses.append(engine.forward_backward([next(loader) for _ in range(micro)], precision))
        skip = precision.unscale_and_check(engine.parameters(), engine.any_rank)
        norms.append(engine.clip_grad_norm_(cfg.optim.grad_clip))
        if not skip:
            engine.optimizer_step(opt)
            objective.after_step()
        engine.zero_grad(opt)
    params = {canonical_name(n): _full(p) for n, p in engine.parts[0].named_parameters()}
    ema = {k: _full(v) for k, v in objective.ema.shadow.items()} if objective.ema else {}
    if world > 1:
        dims.destroy_mesh()
    return {"losses": losses, "norms": norms, "params": params, "ema": ema}


def run_cases(rank: int, world: int, cases: list, cache_dir: str, steps: int = STEPS) -> list:
    out = []
    for overrides in cases:
        result = run_steps(make_config(overrides, cache_dir), steps)
        for key in ("params", "ema"):
            result[key] = {k: v.numpy() for k, v in result[key].items()}
        out.append(result if rank == 0 else None)
    return out


def reference(overrides: list[str], cache_dir: str, steps: int = STEPS) -> dict:
    kept = [o for o in overrides if not o.startswith("parallel.")]
    return run_steps(make_config(kept, cache_dir), steps)


def assert_matches(result: dict, ref: dict, label: str, rtol: float = 1e-5,
                   param_tol: float = 1e-5) -> None:
    for what in ("losses", "norms"):
        for step, (a, b) in enumerate(zip(result[what], ref[what], strict=True)):
            assert abs(a - b) <= rtol * abs(b), f"{label}: step {step} {what} {a!r} vs {b!r}"
    for what in ("params", "ema"):
        assert set(result[what]) == set(ref[what]), f"{label}: {what} names differ"
        for name, r in ref[what].items():
            t = torch.as_tensor(result[what][name])
            err = float(((t - r).abs() - param_tol * r.abs()).max())
            assert err <= param_tol, (f"{label}: {what} {name} differs by "
                                      f"{float((t - r).abs().max()):.3e}")
