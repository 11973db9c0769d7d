"""Sampling from a trained model (temperature and top-k), with a KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from giantmodel.config.errors import UserInputError
from giantmodel.models.common.layers import KVCache

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def place_for_generation(model: nn.Module, device: str | torch.device | None = None,
                         dtype: str | torch.dtype = "auto") -> nn.Module:
    """Move ``model`` to ``device`` (default: CUDA when there is one) in
    ``dtype``: "auto" is bf16 on a GPU and fp32 on the CPU. Only parameters
    are cast: the RoPE table is rebuilt in fp32, as training keeps it."""
    device = torch.device(device or default_device())
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserInputError(f"--device {device}: this machine has no CUDA device; use "
                             "--device cpu")
    if dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        dtype = DTYPES[dtype]
    model.to(device=device, dtype=dtype)
    if hasattr(model, "init_buffers"):
        model.init_buffers(device)
    return model


def _next_logits(model: nn.Module, ids: torch.Tensor, cache: KVCache | None,
                 max_len: int) -> tuple[torch.Tensor, KVCache | None]:
    """Logits [B, V] of the token after ``ids``, feeding only the tokens the
    cache has not seen. Past ``max_len`` the window slides and every position
    changes, so the cache is dropped and the cropped context re-run, as
    without one."""
    if cache is None or ids.shape[1] > max_len:
        return model(ids[:, -max_len:])[:, -1, :].float(), None
    return model(ids[:, cache.length:], cache=cache)[:, -1, :].float(), cache


@torch.no_grad()
def generate(model: nn.Module, ids: torch.Tensor, max_new_tokens: int,
             temperature: float = 0.8, top_k: int | None = 50,
             generator: torch.Generator | None = None,
             eos_id: int | Sequence[int] | None = None,
             vocab_limit: int | None = None, use_cache: bool = True) -> torch.Tensor:
    """Extend ``ids`` [B, T] by up to ``max_new_tokens`` sampled tokens,
    stopping early once every row has produced a token of ``eos_id`` (one id
    or several, e.g. EOS and a chat template's end-of-turn token).

    With ``use_cache`` the prompt runs once and each step after it feeds one
    token, reusing every layer's cached keys and values; without, each step
    re-runs the (cropped) context. Runs where the model's parameters are.
    """
    was_training = model.training
    model.eval()
    max_len = model.cfg.max_seq_len
    device = next(model.parameters()).device
    ids = ids.to(device)
    stop = torch.tensor([] if eos_id is None else [eos_id] if isinstance(eos_id, int)
                        else list(eos_id), device=device)
    cache = KVCache() if use_cache else None
    for _ in range(max_new_tokens):
        logits, cache = _next_logits(model, ids, cache, max_len)
        if vocab_limit is not None:
            logits[:, vocab_limit:] = float("-inf")
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
        ids = torch.cat([ids, nxt], dim=1)
        if len(stop) and bool(torch.isin(nxt, stop).all()):
            break
    model.train(was_training)
    return ids


def generate_text(model: nn.Module, tokenizer, prompt: str, max_new_tokens: int,
                  temperature: float = 0.8, top_k: int | None = 50, seed: int = 0) -> str:
    ids = tokenizer.encode(prompt)
    if tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
        ids = [tokenizer.bos_id] + ids
    gen = torch.Generator().manual_seed(seed)
    out = generate(model, torch.tensor([ids]), max_new_tokens, temperature, top_k, gen,
                   eos_id=tokenizer.eos_id, vocab_limit=tokenizer.vocab_size)
    return tokenizer.decode(out[0].tolist())
