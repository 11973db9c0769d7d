"""Sampling from a trained model (temperature and top-k)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


@torch.no_grad()
def generate(model: nn.Module, ids: torch.Tensor, max_new_tokens: int,
             temperature: float = 0.8, top_k: int | None = 50,
             generator: torch.Generator | None = None,
             eos_id: int | Sequence[int] | None = None,
             vocab_limit: int | None = None) -> torch.Tensor:
    """Extend ``ids`` [B, T] by up to ``max_new_tokens`` sampled tokens,
    stopping early once every row has produced a token of ``eos_id`` (one id
    or several, e.g. EOS and a chat template's end-of-turn token).

    No KV cache: each step re-runs the (cropped) context. Fine for the short
    samples printed after training; not a serving path.
    """
    was_training = model.training
    model.eval()
    max_len = model.cfg.max_seq_len
    device = next(model.parameters()).device
    ids = ids.to(device)
    stop = torch.tensor([] if eos_id is None else [eos_id] if isinstance(eos_id, int)
                        else list(eos_id), device=device)
    for _ in range(max_new_tokens):
        logits = model(ids[:, -max_len:])[:, -1, :].float()
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

