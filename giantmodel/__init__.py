"""giantmodel: train GPT and LLaMA models with N-D parallelism from one YAML file."""

from __future__ import annotations

__version__ = "0.1.0"


def from_hf(path: str, device: str = "cpu", dtype=None):
    """Load a Hugging Face LlamaForCausalLM / GPT2LMHeadModel directory as a
    giantmodel model; calling it on token ids [B, T] returns logits [B, T, V]."""
    from giantmodel.models.hf import from_hf as _from_hf
    return _from_hf(path, device=device, dtype=dtype)


def from_diffusers(path: str, device: str = "cpu", dtype=None):
    """Load a diffusers Stable Diffusion 1.x/2.x pipeline directory. The result
    has ``.unet(sample, timestep, encoder_hidden_states)``, ``.vae.encode(images)``
    (the posterior mean), ``.vae.decode(latents)``, ``.text_encoder(input_ids)``
    (last_hidden_state), the scheduler settings in ``.noise`` and the
    tokenizer in ``.tokenizer``."""
    from giantmodel.models.sd.diffusers_io import from_diffusers as _from_diffusers
    return _from_diffusers(path, device=device, dtype=dtype)


def _register_comm_backend() -> None:
    # Makes dist.init_process_group("giant") work after `import giantmodel`.
    try:
        from giantmodel.comm import register_backend
    except ImportError:
        return
    register_backend()


_register_comm_backend()

__all__ = ["__version__", "from_diffusers", "from_hf"]
