"""Latents (and text embeddings) of an image set, computed once and trained from.

The cache holds, per image, the VAE posterior's moments (mean and
log-variance, so training still samples a fresh latent per step) for the
unflipped and, with random flips, the flipped image; and, when the text
encoder is frozen, the caption's hidden states plus those of the empty
caption (for caption dropout). Files live under
``<cache_dir>/latents/<key>/``, the key hashing everything that determines
the contents, so a changed dataset, resolution or VAE makes a new cache.

Building is collective: every rank encodes a strided share of the images in
the same number of batches (sharded encoders run in lockstep), the results
are gathered, and every host writes the whole cache (atomically, so hosts
that share a filesystem do not clash).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from giantmodel.data.images import preprocess

Gather = Callable[[torch.Tensor], torch.Tensor]
"""[n, ...] on this rank -> [world * n, ...] in rank order."""


def cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _write_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


class LatentCache:
    def __init__(self, folder: Path):
        self.folder = folder
        self.moments = np.load(folder / "moments.npy", mmap_mode="r")  # [N, F, 2C, h, w]
        text = folder / "text.npy"
        self.text = np.load(text, mmap_mode="r") if text.is_file() else None  # [N, L, H]
        self.uncond = np.load(folder / "uncond.npy") if self.text is not None else None

    @staticmethod
    def ready(folder: Path) -> bool:
        return (folder / "done").is_file()

    def batch(self, rows: list[tuple[int, bool]], dropped: list[bool]) -> dict[str, torch.Tensor]:
        """The cached entries for (image index, flipped) rows; ``dropped``
        rows take the empty caption's hidden states."""
        flips = self.moments.shape[1]
        m = np.stack([self.moments[i, 1 if (f and flips > 1) else 0] for i, f in rows])
        out = {"latent_moments": torch.from_numpy(m.astype(np.float32, copy=False))}
        if self.text is not None:
            t = np.stack([self.uncond if d else self.text[i] for (i, _), d in zip(rows, dropped)])
            out["encoder_hidden_states"] = torch.from_numpy(t.astype(np.float32, copy=False))
        return out

    @classmethod
    def build(cls, folder: Path, source, *, resolution: int, center_crop: bool,
              random_flip: bool, encode_images: Callable[[torch.Tensor], torch.Tensor],
              encode_text: Callable[[list[str]], torch.Tensor] | None, rank: int, world: int,
              gather: Gather, barrier: Callable[[], None], batch_size: int,
              writer: bool) -> LatentCache:
        """Encode ``source`` (collectively over ``world`` ranks) into ``folder``.
        ``writer``: this rank writes the files (one rank per host)."""
        n = len(source)
        flips = (False, True) if random_flip else (False,)
        per_rank = -(-n // world)
        steps = -(-per_rank // batch_size)
        mine = [min(rank + world * k, n - 1) for k in range(per_rank)]  # padded by repeats
        moments: np.ndarray | None = None
        text: np.ndarray | None = None
        for s in range(steps):
            idx = mine[s * batch_size:(s + 1) * batch_size]
            idx = idx + [idx[-1]] * (batch_size - len(idx))  # equal batches on every rank
            loaded = [source.load(i) for i in idx]
            views = [encode_images(torch.stack([preprocess(img, resolution, center_crop, f)
                                                for img, _ in loaded])) for f in flips]
            got = gather(torch.stack(views, dim=1).float())  # [world*b, F, 2C, h, w]
            ids = gather(torch.tensor(idx))
            if moments is None:
                moments = np.zeros((n, *got.shape[1:]), dtype=np.float32)
            moments[ids.numpy()] = got.cpu().numpy()
            if encode_text is not None:
                hidden = gather(encode_text([c for _, c in loaded]).float())
                if text is None:
                    text = np.zeros((n, *hidden.shape[1:]), dtype=np.float32)
                text[ids.numpy()] = hidden.cpu().numpy()
        uncond = encode_text([""])[0].float().cpu().numpy() if encode_text is not None else None
        if writer:
            folder.mkdir(parents=True, exist_ok=True)
            _write_atomic(folder / "moments.npy", moments)
            if text is not None:
                _write_atomic(folder / "text.npy", text)
                _write_atomic(folder / "uncond.npy", uncond)
            (folder / "done").write_text(json.dumps({"images": n, "flips": len(flips)}))
        barrier()
        return cls(folder)
