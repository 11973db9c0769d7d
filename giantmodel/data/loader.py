"""Stateful, resumable, data-parallel loaders over a blended sample sequence.

Batch semantics, relied on by the parallelism tests and by resumption:

* the global sample order is fixed by the seed (see :class:`BlendedSamples`);
* optimizer step ``k`` (counted from the loader's start point ``s0``) uses
  global samples ``[s0 + k*G, s0 + (k+1)*G)``, ``G = global_batch_size``;
* data-parallel rank ``r`` of ``dp`` takes the contiguous slice
  ``[.. + r*G/dp, .. + (r+1)*G/dp)`` of that step, as ``G/(dp*B)``
  micro-batches of ``B = micro_batch_size`` samples, in order.

So the micro-batches of one step across all ranks, concatenated in rank order,
are exactly the single-process step's micro-batches. The state is the global
count of consumed samples (the same on every rank), so a loader restored from
it under another dp size, micro-batch size or even global batch size continues
with exactly the next samples.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from giantmodel.config.errors import ConfigError
from giantmodel.data.samples import BlendedSamples

STATE_VERSION = 1


def rows_to_batch(rows, packed: bool) -> dict[str, torch.Tensor]:
    """Loader batch from fine-tuning rows ``[B, 3, T + 1]`` (tokens, labels,
    document ids; :mod:`giantmodel.data.sft`): ``input_ids`` the tokens but
    the last, ``labels`` the labels but the first; packed rows add
    ``document_ids`` and ``position_ids`` restarting at every example."""
    t = torch.as_tensor(rows)
    batch = {"input_ids": t[:, 0, :-1].contiguous(), "labels": t[:, 1, 1:].contiguous()}
    if packed:
        docs = t[:, 2, :-1].contiguous()
        batch["document_ids"] = docs
        batch["position_ids"] = document_positions(docs)
    return batch


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 wherever the document id changes."""
    B, T = docs.shape
    idx = torch.arange(T).expand(B, T)
    start = torch.ones(B, T, dtype=torch.bool)
    start[:, 1:] = docs[:, 1:] != docs[:, :-1]
    run_start = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - run_start


def _to_batch(samples: np.ndarray, packed: bool = False) -> dict[str, torch.Tensor]:
    if samples.ndim == 3:  # fine-tuning rows: tokens, labels, document ids
        return rows_to_batch(samples, packed)
    t = torch.from_numpy(samples)  # [B, T+1] int64
    return {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}


def check_batch_layout(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per rank per step; raises ConfigError when the sizes do not divide."""
    if micro_batch_size < 1 or global_batch_size < 1 or dp_size < 1:
        raise ConfigError(f"batch sizes must be positive (global {global_batch_size}, micro "
                          f"{micro_batch_size}, dp {dp_size})", key="train.global_batch_size")
    if global_batch_size % (micro_batch_size * dp_size):
        raise ConfigError(
            f"{global_batch_size} is not divisible by micro_batch_size x dp = "
            f"{micro_batch_size} x {dp_size}; pick a multiple of {micro_batch_size * dp_size}",
            key="train.global_batch_size")
    return global_batch_size // (micro_batch_size * dp_size)


class TrainLoader:
    """Endless iterator of this rank's training micro-batches.

    Each item is ``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}``
    with ``labels`` the inputs shifted left by one (``IGNORE_INDEX`` where a
    token carries no loss). Packed fine-tuning rows add ``document_ids`` and
    ``position_ids`` [B, T] (see giantmodel.data.sft).
    """

    def __init__(self, samples: BlendedSamples, *, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int):
        self.samples = samples
        self.G, self.B, self.dp, self.rank = global_batch_size, micro_batch_size, dp_size, dp_rank
        self.seed = seed
        self.micro_per_step = check_batch_layout(global_batch_size, micro_batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        self.step_start = 0  # global index of the current step's first sample
        self.micro = 0       # micro-batches this rank has yielded in the current step

    @property
    def seq_len(self) -> int:
        return self.samples.seq_len

    @property
    def consumed_samples(self) -> int:
        """Samples consumed by all ranks together (the same number on every rank)."""
        return self.step_start + self.micro * self.B * self.dp

    def next_indices(self) -> range:
        """Global sample indices of the micro-batch ``next()`` will return."""
        start = self.step_start + self.rank * (self.G // self.dp) + self.micro * self.B
        return range(start, start + self.B)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        idx = self.next_indices()
        batch = _to_batch(self.samples.get_batch(idx.start, self.B), self.samples.packed)
        self.micro += 1
        if self.micro == self.micro_per_step:
            self.micro = 0
            self.step_start += self.G
        return batch

    def state_dict(self) -> dict[str, int]:
        """Plain ints, identical on every data-parallel rank."""
        return {
            "version": STATE_VERSION,
            "consumed_samples": self.consumed_samples,
            "step_start_samples": self.step_start,
            "micro_in_step": self.micro,
            "micro_batch_size": self.B,
            "dp_size": self.dp,
            "global_batch_size": self.G,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "period": len(self.samples),
        }

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("seed", self.seed), ("seq_len", self.seq_len),
                          ("period", len(self.samples))):
            theirs = int(state.get(key, mine))
            if theirs != mine:
                what = {"seed": "train.seed", "seq_len": "train.seq_len", "period": "data"}[key]
                raise ConfigError(
                    f"the checkpoint's data loader was built with {key}={theirs}, this run has "
                    f"{mine}; resuming would not continue the same sample order. Restore the "
                    "original setting or start a new run directory", key=what)
        micro = int(state.get("micro_in_step", 0))
        if micro == 0:
            self.step_start, self.micro = int(state["consumed_samples"]), 0
            return
        same = (int(state["micro_batch_size"]) == self.B and int(state["dp_size"]) == self.dp
                and int(state["global_batch_size"]) == self.G)
        if not same:
            raise ConfigError("the checkpoint was taken in the middle of an optimizer step, so it "
                              "can only resume with the same global batch, micro-batch and dp "
                              "sizes", key="train.micro_batch_size")
        self.step_start, self.micro = int(state["step_start_samples"]), micro


class ValLoader:
    """A fixed, re-iterable sequence of this rank's validation micro-batches.

    Evaluation batch ``j`` covers validation samples
    ``[j*B*dp, (j+1)*B*dp)`` (wrapping around the validation set), rank ``r``
    taking ``[j*B*dp + r*B, j*B*dp + (r+1)*B)``. Iterating yields
    ``num_batches`` micro-batches, the same ones every time.
    """

    def __init__(self, samples: BlendedSamples | None, *, micro_batch_size: int, dp_rank: int,
                 dp_size: int, num_batches: int):
        self.samples = samples
        self.B, self.rank, self.dp = micro_batch_size, dp_rank, dp_size
        self.num_batches = num_batches if samples is not None else 0

    @property
    def num_samples(self) -> int:
        return len(self.samples) if self.samples is not None else 0

    def batches(self, num_batches: int) -> Iterator[dict[str, torch.Tensor]]:
        if self.samples is None:
            return
        n = len(self.samples)
        for j in range(num_batches):
            start = j * self.B * self.dp + self.rank * self.B
            rows = np.stack([self.samples.get((start + i) % n) for i in range(self.B)])
            yield _to_batch(rows.astype(np.int64, copy=False), self.samples.packed)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.batches(self.num_batches)

    def __len__(self) -> int:
        return self.num_batches
