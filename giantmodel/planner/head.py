"""The output head and the LM loss, as ``train.loss_impl`` runs them
(giantmodel.core.loss, giantmodel.objectives.lm): what the last stage holds
from the head's forward to its backward, and the transient around the loss.

* ``plain``: the [tokens, vocab] logits, the fp32 log-softmax output kept for
  backward, the head's input (and under autocast its weight's cast copy), and
  a backward transient of fp32 gradients the size of the logits.
* ``chunked``: one autograd Function computes the loss and, at once, the
  gradients of the head's input (fp32 [tokens, hidden]) and weight (fp32
  [vocab, hidden]), one chunk of :func:`default_chunk_tokens` tokens at a
  time; it keeps those two gradients to backward and nothing else.
* ``liger``: liger-kernel's fused linear cross-entropy, the same idea in the
  compute dtype, with its own chunk rule (tokens / ceil(vocab / hidden),
  rounded up to a power of two).

Tensor parallelism (a vocab-parallel head) and pipeline stages keep the plain
loss, whatever ``train.loss_impl`` says.
"""

from __future__ import annotations

import math

from giantmodel.core.loss import default_chunk_tokens, liger_installed
from giantmodel.planner.terms import DTYPE_BYTES


def head_loss_impl(layout, hw) -> str:
    """The loss implementation a run of ``layout`` on ``hw`` takes
    (giantmodel.core.loss.resolve_loss_impl: both families' heads are
    bias-free linears). ``hw`` None is the planner's default GPU; auto takes
    liger on an accelerator when liger-kernel is installed here."""
    requested = layout.loss_impl
    if requested == "plain" or layout.tp > 1 or layout.pp > 1:
        return "plain"
    if requested == "auto":
        accelerator = hw is None or hw.intra_link != "shm"
        return "liger" if accelerator and liger_installed() else "chunked"
    return requested


def _compute_bytes(precision: str) -> int:
    return DTYPE_BYTES[precision]


def head_edge_bytes(m, precision: str, tokens: float, tp: int, frozen: bool,
                    impl: str) -> dict[str, float]:
    """What the head and the loss keep from forward to backward for one
    micro-batch of ``tokens`` local tokens (the final norm aside)."""
    c = _compute_bytes(precision)
    h, v = m.hidden_size, m.vocab_size
    if impl == "plain":
        out = {}
        if not frozen:
            out["head.input"] = tokens * (c * h if c < 4 else 4 * h)
        # the fp32 log-softmax output (NLL reads the same tensor). The step
        # holds no reference to the logits (objective.loss passes them straight
        # to the loss) and their fp32 copy is not saved, so both are freed in
        # forward, below the backward transient that follows.
        out["logits"] = tokens * 4 * v / tp
        return out
    # the gradients computed in forward: fp32 (chunked) or the compute dtype (liger)
    g = 4 if impl == "chunked" else c
    out = {"loss.grad_hidden": tokens * g * h}
    if not frozen:
        out["loss.grad_weight"] = float(g * v * h)
    return out


def head_transient_bytes(m, precision: str, tokens: float, tp: int, frozen: bool,
                         impl: str) -> float:
    """Extra bytes while the loss runs. Plain: its backward's fp32 gradients
    of the log-softmax output and input (and the cast back under autocast).
    Chunked, in forward: a chunk's fp32 logits and, under autocast, their
    cast softmax gradient; from the second chunk on the previous chunk's pair
    is still referenced while the next is made (two of each); plus the
    weight's cast copy and, for the weight gradient, the cast product. Liger:
    a chunk of logits in the compute dtype and the cast weight and input."""
    c = _compute_bytes(precision)
    h, v = m.hidden_size, m.vocab_size
    if impl == "plain":
        return tokens * v / tp * (8 + (c if c < 4 else 0))
    cast = c < 4
    if impl == "chunked":
        n = default_chunk_tokens(int(tokens), v)
        pairs = 2 if n < tokens else 1
        logits = pairs * n * v * (4 + (c if cast else 0))
        weight = (v * h * c) * ((1 if frozen else 2) if cast else 0)
        return logits + weight
    n = 2 ** math.ceil(math.log2(max(1.0, math.ceil(tokens / math.ceil(v / h)))))
    return min(n, tokens) * v * c + (v * h * c + tokens * h * c if cast else 0)


def head_weight_copy(impl: str) -> bool:
    """Whether autocast's cast copy of the head weight is kept to backward
    (the plain head's linear saves it; the fused losses cast inside forward)."""
    return impl == "plain"
