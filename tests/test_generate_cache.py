"""Generation with a KV cache: the same tokens as re-running the whole
prefix, for fewer tokens through the model; the model's training forward is
untouched by the cache argument."""

from __future__ import annotations

import pytest
import torch

from giantmodel.config.model import ModelConfig
from giantmodel.models.common.layers import KVCache
from giantmodel.models.generate import generate, place_for_generation
from giantmodel.models.registry import build_model, init_weights


def _model(arch: str, max_seq_len: int = 64):
    cfg = ModelConfig(arch=arch, vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2 if arch == "llama" else 4, ffn_hidden_size=64,
                      max_seq_len=max_seq_len)
    return init_weights(build_model(cfg), cfg, seed=1)


class _TokenCounter:
    """Counts the tokens every forward call is given."""

    def __init__(self, model):
        self.n = 0
        self.hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        self.n += args[0].numel()


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_cached_greedy_generation_matches_full_recompute(arch):
    model = _model(arch)
    prompt = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    counter = _TokenCounter(model)
    full = generate(model, prompt, 20, temperature=0, use_cache=False)
    without = counter.n
    counter.n = 0
    cached = generate(model, prompt, 20, temperature=0)
    assert torch.equal(cached, full)
    assert counter.n == 2 * (5 + 19)  # the prompt once, then one token per step
    assert without == 2 * sum(range(5, 25))


def test_cache_past_the_context_window_slides_like_recompute():
    """Past max_seq_len every position shifts: the cache gives way to the
    cropped context, so tokens still match the cache-free run."""
    model = _model("llama", max_seq_len=12)
    prompt = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(2))
    full = generate(model, prompt, 14, temperature=0, use_cache=False)
    assert torch.equal(generate(model, prompt, 14, temperature=0), full)


def test_sampled_generation_same_with_and_without_cache():
    model = _model("llama")
    prompt = torch.randint(0, 97, (1, 3), generator=torch.Generator().manual_seed(4))
    runs = [generate(model, prompt, 12, temperature=0.9, top_k=20,
                     generator=torch.Generator().manual_seed(7), use_cache=c)
            for c in (False, True)]
    assert torch.equal(*runs)


def test_prefill_in_pieces_equals_one_forward():
    """Logits of a sequence fed to the cache in three pieces (the middle one
    several tokens at once: lower-right causal) equal one plain forward."""
    model = _model("llama").eval()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)
        cache = KVCache()
        parts = [model(ids[:, a:b], cache=cache) for a, b in ((0, 4), (4, 9), (9, 11))]
    torch.testing.assert_close(torch.cat(parts, dim=1), ref, rtol=1e-5, atol=1e-5)
    assert cache.length == 11


def test_place_for_generation_casts_weights_not_rope():
    model = place_for_generation(_model("llama"), "cpu", "bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.rope.dtype == torch.float32
    out = generate(model, torch.tensor([[1, 2, 3]]), 4, temperature=0)
    assert out.shape == (1, 7)


def test_place_for_generation_names_a_missing_gpu():
    from giantmodel.config.errors import UserInputError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UserInputError, match="--device cuda"):
        place_for_generation(_model("gpt"), "cuda")
