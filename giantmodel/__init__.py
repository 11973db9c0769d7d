"""giantmodel: train GPT and LLaMA models with N-D parallelism from one YAML file.

Packages, from the bottom up; each imports only packages below it (the
import-linter contract in pyproject.toml, checked in CI):

=============  ==============================================================
config         typed config sections, strict YAML loading, errors
testing        local gloo ranks and emulated clusters for tests and benchmarks
core           loss, precision, optimizer and LR builders, pipeline stage plans,
               layout validation (the one place a layout is checked)
distributed    ParallelDims (the topology object), process-group start-up
models         plain nn.Modules (no torch.distributed) + HF weight adapters
comm           the "giant" torch.distributed backend (needs only config)
parallel       the engine: model parts + data-parallel strategy + step runner;
               tensor/context parallel plans, recompute, offload, FSDP2, ZeRO
checkpoint,    DCP checkpoints; datasets and loaders; metrics
data, metrics
objectives     what is trained: a model + what trains + how a batch becomes a loss
train          the loop: engine + objective + loaders + checkpoints + metrics
planner        predicts what train will do (imports models/parallel, never train)
cli            subcommands, each calling one function elsewhere
=============  ==============================================================

Where new things go:

* a new model: a package under ``models/`` and an objective under
  ``objectives/`` (one file plus one registry entry; see
  :mod:`giantmodel.parallel.objective` for the contract);
* a new parallel dimension: a data-parallel strategy or a step runner in
  ``parallel/`` (see :mod:`giantmodel.parallel.engine`);
* a new collective: a small function in ``parallel/collectives.py`` that takes
  its group, or an op of the giant backend in ``comm/``.
"""

from __future__ import annotations

from giantmodel.comm import register_backend

__version__ = "0.1.0"


def from_hf(path: str, device: str = "cpu", dtype=None):
    """Load a Hugging Face LlamaForCausalLM / GPT2LMHeadModel directory as a
    giantmodel model; calling it on token ids [B, T] returns logits [B, T, V]."""
    # lazy: `import giantmodel` stays light; the HF adapters load on first use
    from giantmodel.models.hf import from_hf as _from_hf
    return _from_hf(path, device=device, dtype=dtype)


def from_diffusers(path: str, device: str = "cpu", dtype=None):
    """Load a diffusers Stable Diffusion 1.x/2.x pipeline directory. The result
    has ``.unet(sample, timestep, encoder_hidden_states)``, ``.vae.encode(images)``
    (the posterior mean), ``.vae.decode(latents)``, ``.text_encoder(input_ids)``
    (last_hidden_state), the scheduler settings in ``.noise`` and the
    tokenizer in ``.tokenizer``."""
    # lazy, like from_hf
    from giantmodel.models.sd.diffusers_io import from_diffusers as _from_diffusers
    return _from_diffusers(path, device=device, dtype=dtype)


# Makes dist.init_process_group("giant") work after `import giantmodel`.
register_backend()

__all__ = ["__version__", "from_diffusers", "from_hf"]
