"""giantmodel: train GPT and LLaMA models with N-D parallelism from one YAML file."""

from __future__ import annotations

__version__ = "0.1.0"


def from_hf(path: str, device: str = "cpu", dtype=None):
    """Load a Hugging Face LlamaForCausalLM / GPT2LMHeadModel directory as a
    giantmodel model; calling it on token ids [B, T] returns logits [B, T, V]."""
    from giantmodel.models.hf import from_hf as _from_hf
    return _from_hf(path, device=device, dtype=dtype)


def _register_comm_backend() -> None:
    # Makes dist.init_process_group("giant") work after `import giantmodel`.
    try:
        from giantmodel.comm import register_backend
    except ImportError:
        return
    register_backend()


_register_comm_backend()

__all__ = ["__version__", "from_hf"]
