"""Token-level cross-entropy, summed so callers normalise by global token count.

Three ways to get it from the final hidden states (``train.loss_impl``):

* ``plain``: the output head's full [tokens, vocab] logits, then
  :func:`cross_entropy_sum`. At a 128K vocabulary and 4096 tokens the fp32
  logits alone are 2.1 GB, and autograd keeps several tensors that size;
* ``chunked``: :func:`chunked_linear_cross_entropy_sum`, the head's matmul
  and the loss a slice of tokens at a time in one autograd Function, in
  plain PyTorch on any device;
* ``liger``: liger-kernel's fused linear cross-entropy (Triton, CUDA), when
  installed. Never a dependency: imported when chosen.

The model stays plain: :func:`head_computes_loss` makes its output head
return the loss sum for the duration of one forward, so the model's own
forward (and any FSDP2 hooks on the head) run unchanged.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from giantmodel.config.errors import ConfigError

IGNORE_INDEX = -100
# Elements of one chunk's fp32 logits (256 MiB): large enough that the
# chunk's matmuls keep a GPU busy, small beside the full logits at a 128K vocab.
CHUNK_ELEMENTS = 1 << 26

log = logging.getLogger(__name__)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token losses and the number of counted tokens.

    Summing (rather than averaging per micro-batch) lets the caller divide by
    the token count of the whole global batch, so the loss is the same token
    mean however the batch is split across micro-batches and ranks.
    """
    loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (labels != IGNORE_INDEX).sum()


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the plain head's matmul would run in: autocast's when on."""
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return torch.result_type(hidden, weight)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_t CE(hidden[t] @ weight.T, labels[t]) over tokens t, chunk by chunk.

    Forward computes each chunk's logits [n, V], its loss, and at once its
    gradients d(loss sum)/d(hidden) and d(loss sum)/d(weight) (softmax minus
    the one-hot target, zero on ignored tokens); then the chunk's logits are
    freed. Backward only scales the stored gradients by the incoming scalar
    gradient (1/global tokens x the fp16 loss scale). So neither pass holds
    more than one chunk of logits, and the head costs the same three matmuls
    as the plain path. Gradients are kept in fp32 and scaled before the cast
    to the input dtype, as the plain path's fp32 loss gradient is.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, dtype: torch.dtype,
                need_hidden: bool, need_weight: bool):
        n_tokens = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        grad_h = (torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
                  if need_hidden else None)
        grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                  if need_weight else None)
        # Explicit casts instead of autocast: the same dtypes on every device,
        # and the loss math stays in fp32.
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, n_tokens, chunk):
                h = hidden[start:start + chunk].to(dtype)          # [n, H]
                y = labels[start:start + chunk]                     # [n]
                logits = (h @ w.t()).float()                        # [n, V]
                lse = torch.logsumexp(logits, dim=-1)               # [n]
                valid = y != IGNORE_INDEX
                target = torch.where(valid, y, 0)
                picked = logits.gather(1, target[:, None]).squeeze(1)
                total += torch.where(valid, lse - picked, 0.0).sum(dtype=torch.float64)
                if grad_h is None and grad_w is None:
                    continue
                # softmax - onehot, in the logits' buffer (no second [n, V])
                g = logits.sub_(lse[:, None]).exp_()
                g[torch.arange(g.shape[0], device=g.device), target] -= 1.0
                g.mul_(valid[:, None])
                g = g.to(dtype)
                if grad_h is not None:
                    grad_h[start:start + chunk] = g @ w             # [n, H]
                if grad_w is not None:
                    if dtype == torch.float32:
                        grad_w.addmm_(g.t(), h)                     # [V, H]
                    else:  # accumulate the chunks' half-precision products in fp32
                        grad_w += g.t() @ h
        ctx.grads = (grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total.float()

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("the chunked cross-entropy supports one backward per forward")
        (grad_h, grad_w), (h_dtype, w_dtype) = ctx.grads, ctx.dtypes
        ctx.grads = None  # in-place scaling below: a second backward would be wrong
        scale = grad_out.float()
        dh = grad_h.mul_(scale).to(h_dtype) if grad_h is not None else None
        dw = grad_w.mul_(scale).to(w_dtype) if grad_w is not None else None
        return dh, dw, None, None, None, None, None


def default_chunk_tokens(n_tokens: int, vocab: int) -> int:
    return max(1, min(n_tokens, CHUNK_ELEMENTS // max(vocab, 1)))


def chunked_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor,
                                     labels: torch.Tensor, chunk_tokens: int | None = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, counted tokens) of ``hidden [..., H] @ weight[V, H].T``
    against ``labels [...]``, as :func:`cross_entropy_sum` of the full
    logits would give, holding one chunk of ``chunk_tokens`` tokens' logits
    at a time (default: :data:`CHUNK_ELEMENTS` logits)."""
    h2 = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    chunk = chunk_tokens or default_chunk_tokens(h2.shape[0], weight.shape[0])
    grad = torch.is_grad_enabled()
    loss = _ChunkedLinearCrossEntropy.apply(
        h2, weight, y, chunk, _compute_dtype(hidden, weight),
        grad and hidden.requires_grad, grad and weight.requires_grad)
    return loss, (labels != IGNORE_INDEX).sum()


def liger_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor,
                                   labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """liger-kernel's fused linear cross-entropy (CUDA only), summed."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
    # Both operands in the dtype the plain head would use (autocast's), cast
    # here so autograd carries the gradients back to fp32 master weights, and
    # autocast off inside: liger's kernels then see one dtype whatever the
    # release does with autocast.
    dtype = _compute_dtype(hidden, weight)
    with torch.autocast(hidden.device.type, enabled=False):
        out = fn(weight.to(dtype), hidden.reshape(-1, hidden.shape[-1]).to(dtype),
                 labels.reshape(-1))
    # Some releases return (loss, z_loss) or an output object; the loss is first.
    out = out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
    return out.float(), (labels != IGNORE_INDEX).sum()


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def check_loss_impl(requested: str, device_type: str) -> None:
    """Config-time check of ``train.loss_impl`` for a run on ``device_type``."""
    if requested != "liger":
        return
    if device_type != "cuda":
        raise ConfigError(f"liger-kernel's fused cross-entropy runs on CUDA, not {device_type}; "
                          "use chunked", "train.loss_impl")
    if not liger_installed():
        raise ConfigError("liger-kernel is not installed (pip install liger-kernel); "
                          "use chunked", "train.loss_impl")


def resolve_loss_impl(requested: str, head: nn.Module | None, device_type: str, *,
                      vocab_parallel: bool = False) -> tuple[str, str]:
    """(the implementation to run, why it is plain when ``requested`` is not, or "").

    The chunked and fused paths take the head's weight and the final hidden
    states whole. A vocab-sharded head (tensor parallelism) keeps the plain
    path, whose vocab-parallel loss is exact on the shards; so does a head
    that is not a bias-free ``nn.Linear``. (FSDP2 shards the weight too, but
    gathers it for the head's forward, where the loss runs.)"""
    if requested == "plain":
        return "plain", ""
    if vocab_parallel:
        return "plain", "the output head is sharded over tp (vocab-parallel loss)"
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return "plain", "the output head is not a bias-free linear"
    if getattr(head, "softcap", None) is not None:
        # The fused losses take the bare weight, so they would drop the cap;
        # capping inside each chunk would need its own backward, and Gemma 2's
        # vocabulary is where the plain loss's full logits cost the most.
        return "plain", "the output head soft-caps its logits (model.final_softcap)"
    if requested == "auto":
        return ("liger" if device_type == "cuda" and liger_installed() else "chunked"), ""
    return requested, ""


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    if impl == "liger":
        return liger_linear_cross_entropy_sum(hidden, weight, labels)
    if impl == "chunked":
        return chunked_linear_cross_entropy_sum(hidden, weight, labels)
    return cross_entropy_sum(F.linear(hidden, weight), labels)


@contextlib.contextmanager
def head_computes_loss(head: nn.Module, labels: torch.Tensor, impl: str) -> Iterator[None]:
    """While active, ``head(hidden)`` returns the loss sum of ``hidden``
    against ``labels`` instead of logits: the model's forward then returns it.

    The head is still called through ``nn.Module.__call__``, so hooks on it
    (FSDP2 gathering its weight, and resharding it after) run as usual, and
    ``head.weight`` is the gathered weight while its forward runs."""
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        weight = head.weight
        if hasattr(weight, "device_mesh") or hasattr(hidden, "device_mesh"):
            # still a DTensor inside forward: sharded by a plan, not gathered by FSDP2
            raise RuntimeError(f"train.loss_impl={impl} needs the whole head weight, but it is "
                               "sharded over tp; use train.loss_impl=plain")
        return linear_cross_entropy_sum(hidden, weight, labels, impl)[0]

    previous = head.__dict__.get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous
