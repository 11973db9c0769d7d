"""``dpo.precompute_ref``: every pair's reference log-probs in one pass.

Before the first loss, the reference policy (the LoRA base with adapters off,
or the frozen copy) scores every pair row of the training and validation
data once. Data-parallel rank r scores its own contiguous share of the pair
rows (tensor-parallel peers share a dp rank, so they run the same batches
through the same sharded forward as training does); the shares are then
all-gathered so every rank holds the whole table, and training runs no
reference forward at all.

The table maps a digest of each pair row's tokens and labels to its
``[2, D]`` summed log-probs (chosen, rejected; one column per packed pair of
the row, zeros past the row's last pair). Rank 0 writes it to
``run.dir/ref_logps.pt`` (plain tensors, read back with
``weights_only=True``), and a resumed run that finds every pair row in it
skips the pass.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from giantmodel.data.loader import rows_to_batch
from giantmodel.parallel.collectives import any_true

TABLE_FILE = "ref_logps.pt"
KEY_BYTES = 16


def pair_keys(batch: dict) -> list[bytes]:
    """One key per pair row (rows 2j, 2j+1): a digest of its tokens and
    labels, as int64 whatever dtype the loader served them in."""
    ids, labels = batch["input_ids"], batch["labels"]
    keys = []
    for j in range(ids.shape[0] // 2):
        h = hashlib.blake2b(digest_size=KEY_BYTES)
        h.update(ids[2 * j:2 * j + 2].to(torch.int64).cpu().numpy().tobytes())
        h.update(labels[2 * j:2 * j + 2].to(torch.int64).cpu().numpy().tobytes())
        keys.append(h.digest())
    return keys


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """``[n, ...]`` from each rank of ``group`` -> ``[size * n, ...]`` in rank order."""
    size = dist.get_world_size(group)
    out = t.new_empty((size * t.shape[0],) + tuple(t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


class RefTable:
    """Pair-row key -> reference log-probs ``[2, D_max]`` (fp32, on the host)."""

    def __init__(self, keys: list[bytes], logps: torch.Tensor):
        self.index = {k: i for i, k in enumerate(keys)}
        self.keys, self.logps = keys, logps

    def lookup(self, batch: dict, device: torch.device) -> torch.Tensor:
        """``[2, pair rows * D]`` in :func:`sequence_logps`' slot order, D the
        batch's own pair count per row (the table's columns past it are zeros)."""
        docs = batch["document_ids"]
        D = int(docs.max()) + 1 if docs.numel() else 1
        try:
            rows = [self.index[k] for k in pair_keys(batch)]
        except KeyError:
            raise RuntimeError("dpo.precompute_ref: a pair row missing from the reference "
                               "table (the data changed after the table was built)") from None
        picked = self.logps[rows, :, :D]  # [pair rows, 2, D]
        return picked.transpose(0, 1).reshape(2, -1).to(device)

    def covers(self, keys: list[bytes], width: int) -> bool:
        return self.logps.shape[2] == width and all(k in self.index for k in keys)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        keys = torch.from_numpy(np.frombuffer(b"".join(self.keys), dtype=np.uint8).copy())
        tmp = path.with_suffix(".tmp")
        torch.save({"keys": keys.view(-1, KEY_BYTES), "logps": self.logps.contiguous()}, tmp)
        os.replace(tmp, path)  # a reader never sees half a file

    @classmethod
    def load(cls, path: Path) -> RefTable | None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            keys = [bytes(r) for r in state["keys"].numpy()]
            return cls(keys, state["logps"].float())
        except (OSError, KeyError, RuntimeError, AttributeError, TypeError):
            return None  # absent or unreadable: the pass runs again


def all_pair_rows(sources: list[np.ndarray]) -> np.ndarray:
    """``[N, 2, 3, T + 1]``: every pair row of the given sources."""
    return np.concatenate([s for s in sources if len(s)])


def _pairs_per_row(rows: np.ndarray) -> int:
    return int(rows[:, :, 2].max()) + 1 if rows.size else 1


def _batch(rows: np.ndarray) -> dict:
    return rows_to_batch(rows.reshape((-1,) + rows.shape[2:]).astype(np.int64), packed=True)


@torch.no_grad()
def build_table(score: Callable[[dict], torch.Tensor | None], rows: np.ndarray, micro_batch: int,
                dp_rank: int, dp_size: int, device: torch.device) -> RefTable:
    """Score every pair row once: dp rank r takes rows ``[r*n, (r+1)*n)``
    (wrapping, so every rank runs the same number of equal-sized forwards:
    FSDP, tensor and pipeline parallelism hold collectives in them), then
    the shares are all-gathered. ``score(batch)`` is the reference forward's
    :func:`sequence_logps` sums ``[2, pair rows * D]``, or None on a rank
    that does not hold them (a pipeline stage before the last): only the
    ranks that do contribute to the table."""
    N, width = rows.shape[0], _pairs_per_row(rows)
    share = -(-N // dp_size)
    mine = [(dp_rank * share + i) % N for i in range(share)]
    out = torch.zeros(share, 2, width, dtype=torch.float32, device=device)
    held = True
    for start in range(0, share, micro_batch):
        idx = mine[start:start + micro_batch]
        batch = _batch(rows[idx])
        D = int(batch["document_ids"].max()) + 1
        sums = score(batch)
        if sums is None:
            held = False
            continue
        out[start:start + len(idx), :, :D] = sums.float().reshape(2, len(idx), D).transpose(0, 1)
    index = torch.tensor(mine, dtype=torch.int64, device=device)
    # which of the gathered rows hold log-probs: [share], all of this rank's or none
    has = torch.full((share,), int(held), dtype=torch.int64, device=device)  # gloo has no bool
    if _world() > 1:
        # Over every rank: tp peers (and dp ranks wrapping onto the same rows)
        # contribute identical values, harmlessly.
        out, index, has = (all_gather_rows(t, dist.group.WORLD) for t in (out, index, has))
    table = torch.zeros(N, 2, width, dtype=torch.float32)
    has = has.cpu().bool()
    table[index.cpu()[has]] = out.cpu()[has]
    return RefTable(pair_keys(_batch(rows)), table)


def load_or_build(score: Callable[[dict], torch.Tensor | None], rows: np.ndarray, micro_batch: int,
                  dp_rank: int, dp_size: int, device: torch.device,
                  run_dir: str | None) -> tuple[RefTable, bool]:
    """The table from ``run_dir`` when it covers every pair row on every
    rank, else built (and saved by rank 0). Returns (table, built)."""
    keys, width = pair_keys(_batch(rows)), _pairs_per_row(rows)
    path = Path(run_dir) / TABLE_FILE if run_dir else None
    table = RefTable.load(path) if path is not None and path.exists() else None
    missing = table is None or not table.covers(keys, width)
    if _world() > 1:
        # One verdict for all: the pass holds collectives.
        missing = any_true(missing, dist.group.WORLD, device)
    if not missing:
        return table, False
    table = build_table(score, rows, micro_batch, dp_rank, dp_size, device)
    if path is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        table.save(path)
    return table, True
