"""Helpers shared by the Hugging Face parity tests of every model family."""

from __future__ import annotations

import torch


def perturb(model: torch.nn.Module, scale: float = 0.05, seed: int = 1) -> torch.nn.Module:
    """Add seeded noise to every tensor: HF inits norms to ones and biases to
    zeros, which would let a swapped or untransposed weight hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """A model's logits without autograd, from a HF output or a plain tensor."""
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


def lora_run_dir(root, base, targets: list[str]) -> None:
    """A LoRA run directory (config.yaml + one checkpoint) over the HF model
    at ``base``, written the way the trainer writes one, with every adapter
    random (B too, so each part's update shows)."""
    import yaml

    from giantmodel.checkpoint import CheckpointManager, ModelState
    from giantmodel.config.loader import to_dict
    from giantmodel.config.train import CheckpointConfig
    from giantmodel.models.hf import from_hf
    from giantmodel.models.lora import apply_lora, is_lora_param

    model = from_hf(base)
    apply_lora(model, targets, 4, 8.0, 0.0, model.cfg.arch)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_lora_param(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    root.mkdir()
    (root / "config.yaml").write_text(yaml.safe_dump({
        "objective": "lora", "model": to_dict(model.cfg),
        "lora": {"rank": 4, "alpha": 8.0, "targets": targets, "save_adapter_only": False},
        "checkpoint": {"init_from": str(base)}}, sort_keys=False))
    manager = CheckpointManager(CheckpointConfig(keep=0), root, is_rank0=True)
    manager.save(1, {"model": ModelState([model])})
    manager.close()
