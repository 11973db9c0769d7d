"""Captioned image datasets and their deterministic, resumable, data-parallel loader.

Sources: an image folder with ``metadata.jsonl`` (the Hugging Face
imagefolder convention), a Hugging Face dataset saved with
``save_to_disk``, a plain folder of images sharing one prompt (DreamBooth),
and the generated shapes set (:mod:`giantmodel.data.shapes`).

Preprocessing is diffusers' ``train_text_to_image.py``: resize the shorter
side to ``resolution`` (bilinear, antialiased), centre or random crop,
random horizontal flip, scale to [-1, 1]. Every random choice for a sample
(crop, flip, caption dropout) comes from a generator seeded by the run seed
and the sample's position in the training stream, so it does not depend on
the layout, and a resumed run draws the same.

Batch semantics are those of the text loader (:mod:`giantmodel.data.loader`):
step ``k`` uses stream positions ``[s0 + k*G, s0 + (k+1)*G)``, data-parallel
rank ``r`` takes the ``r``-th contiguous slice of it, and stream position
``p`` is image ``perm_e[p mod N]`` of epoch ``e = p // N``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from giantmodel.config.errors import ConfigError, UserInputError
from giantmodel.data.loader import check_batch_layout
from giantmodel.data.shapes import ShapesSource

STATE_VERSION = 1
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
# Seeds of independent per-sample random streams.
AUGMENT_STREAM, VALID_STREAM = 1, 3


def sample_generator(seed: int, position: int, stream: int) -> torch.Generator:
    """A generator for one sample's random choices: depends only on the run
    seed, the sample's stream position and which stream it is."""
    mixed = np.random.SeedSequence([seed, stream, position]).generate_state(2, np.uint64)
    return torch.Generator().manual_seed(int(mixed[0] >> np.uint64(1)))


def _open_image(path: Path):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(path)
        img.load()
    except (OSError, UnidentifiedImageError) as e:
        raise UserInputError(f"{path}: cannot read the image ({e})") from None
    return img.convert("RGB")


# ------------------------------------------------------------------ sources
class FolderSource:
    """An image folder. With ``metadata.jsonl``: one JSON object per line, the
    image file under ``image_column`` and its caption under ``caption_column``.
    With ``prompt`` instead: every image in the folder, all with that caption."""

    def __init__(self, path: str | os.PathLike, image_column: str = "file_name",
                 caption_column: str = "text", prompt: str | None = None, check: bool = True):
        self.root = Path(path)
        self.name = str(self.root)
        if not self.root.is_dir():
            raise UserInputError(f"{self.root}: no such image folder")
        if prompt is not None:
            files = sorted(p for p in self.root.iterdir() if p.suffix.lower() in IMAGE_EXTS)
            if not files:
                raise UserInputError(f"{self.root}: no images ({', '.join(IMAGE_EXTS)})")
            self.files, self.captions = files, [prompt] * len(files)
        else:
            self.files, self.captions = self._read_metadata(image_column, caption_column)
        if check:
            self.check_files()

    def _read_metadata(self, image_column: str, caption_column: str):
        meta = self.root / "metadata.jsonl"
        if not meta.is_file():
            raise UserInputError(f"{meta} is missing: an image folder needs metadata.jsonl lines "
                                 f'like {{"file_name": "0001.png", "text": "a caption"}}')
        files, captions = [], []
        for n, line in enumerate(meta.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UserInputError(f"{meta}:{n}: not valid JSON ({e})") from None
            for key in (image_column, caption_column):
                if key not in row:
                    which = "data.images.caption_column" if key == caption_column \
                        else "data.images.image_column"
                    raise UserInputError(f"{meta}:{n}: no {key!r} key (keys: {', '.join(row)}); "
                                         f"set {which} to the right one")
            files.append(self.root / str(row[image_column]))
            captions.append(str(row[caption_column]))
        if not files:
            raise UserInputError(f"{meta} lists no images")
        return files, captions

    def check_files(self) -> None:
        """Every listed image exists and its header reads as an image."""
        from PIL import Image, UnidentifiedImageError

        for f in self.files:
            if not f.is_file():
                raise UserInputError(f"{f}: image listed in {self.root} does not exist")
            try:
                with Image.open(f) as img:
                    img.verify()
            except (OSError, UnidentifiedImageError, SyntaxError) as e:
                raise UserInputError(f"{f}: not a readable image ({e})") from None

    def __len__(self) -> int:
        return len(self.files)

    def load(self, i: int):
        return _open_image(self.files[i]), self.captions[i]

    def caption(self, i: int) -> str:
        return self.captions[i]


class HFDiskSource:
    """A Hugging Face dataset written by ``save_to_disk``: an image column
    (``datasets.Image`` feature, or raw bytes) and a caption column."""

    def __init__(self, path: str | os.PathLike, image_column: str = "image",
                 caption_column: str = "text"):
        try:
            import datasets
        except ImportError:
            raise UserInputError(f"{path} is a Hugging Face dataset, which needs the `datasets` "
                                 "package: pip install 'giantmodel[hf]'") from None
        try:
            ds = datasets.load_from_disk(str(path))
        except (OSError, ValueError, FileNotFoundError) as e:
            raise UserInputError(f"{path}: cannot load the dataset ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise UserInputError(f"{path}: a DatasetDict without a 'train' split")
            ds = ds["train"]
        for key, col in (("image_column", image_column), ("caption_column", caption_column)):
            if col not in ds.column_names:
                raise UserInputError(f"{path}: no column {col!r} (columns: "
                                     f"{', '.join(ds.column_names)}); set data.images.{key}")
        self.ds, self.image_column, self.caption_column = ds, image_column, caption_column
        self.name = str(path)
        self._captions = [str(c) for c in ds[caption_column]]

    def __len__(self) -> int:
        return len(self.ds)

    def load(self, i: int):
        import io

        from PIL import Image

        value = self.ds[int(i)][self.image_column]
        try:
            if isinstance(value, dict):  # undecoded Image feature: {"bytes", "path"}
                value = Image.open(io.BytesIO(value["bytes"])) if value.get("bytes") \
                    else Image.open(value["path"])
            elif isinstance(value, (bytes, bytearray)):
                value = Image.open(io.BytesIO(value))
            return value.convert("RGB"), self._captions[i]
        except (OSError, AttributeError) as e:
            raise UserInputError(f"{self.name}: row {i} has no readable image ({e})") from None

    def caption(self, i: int) -> str:
        return self._captions[i]


class Subset:
    """The first ``n`` images of a source."""

    def __init__(self, source, n: int):
        self.source, self.n, self.name = source, min(n, len(source)), source.name

    def __len__(self) -> int:
        return self.n

    def load(self, i: int):
        return self.source.load(i)

    def caption(self, i: int) -> str:
        return self.source.caption(i)


def open_source(cfg, seed: int):
    """The image source a ``data:`` section names (source "images" or "shapes")."""

    ic = cfg.images
    if cfg.source == "shapes":
        src = ShapesSource(ic.num_shapes, seed, ic.resolution)
    else:
        path = Path(cfg.paths[0])
        if (path / "metadata.jsonl").is_file() or not (path / "dataset_info.json").is_file() \
                and not (path / "dataset_dict.json").is_file():
            src = FolderSource(path, ic.image_column or "file_name", ic.caption_column)
        else:
            src = HFDiskSource(path, ic.image_column or "image", ic.caption_column)
    return Subset(src, ic.max_images) if ic.max_images else src


# ------------------------------------------------------------ preprocessing
def preprocess(img, resolution: int, center_crop: bool, flip: bool,
               gen: torch.Generator | None = None) -> torch.Tensor:
    """PIL image -> [3, R, R] float in [-1, 1] (torchvision's Resize, Center/RandomCrop,
    horizontal flip, ToTensor, Normalize(0.5, 0.5) on PIL images)."""
    from PIL import Image

    w, h = img.size
    if min(w, h) != resolution:
        if w <= h:
            nw, nh = resolution, int(resolution * h / w)
        else:
            nw, nh = int(resolution * w / h), resolution
        img = img.resize((nw, nh), Image.BILINEAR)
    w, h = img.size
    if center_crop:
        top, left = round((h - resolution) / 2.0), round((w - resolution) / 2.0)
    else:
        top = int(torch.randint(0, h - resolution + 1, (1,), generator=gen))
        left = int(torch.randint(0, w - resolution + 1, (1,), generator=gen))
    img = img.crop((left, top, left + resolution, top + resolution))
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0
    if flip:
        x = x.flip(-1)
    return x * 2.0 - 1.0


class Augment:
    """One sample's random choices, drawn in a fixed order from its generator."""

    def __init__(self, seed: int, position: int, random_flip: bool, caption_dropout: float):
        self.gen = sample_generator(seed, position, AUGMENT_STREAM)
        u = torch.rand(2, generator=self.gen)
        self.flip = bool(random_flip and u[0] < 0.5)
        self.drop_caption = bool(u[1] < caption_dropout)


# ------------------------------------------------------------------ loaders
class ImageLoader:
    """Endless iterator of this rank's training micro-batches of images.

    Each item holds ``pixel_values`` [B, 3, R, R] in [-1, 1] (or, from a
    latent cache, ``latent_moments`` [B, 2C, h, w] and possibly
    ``encoder_hidden_states``), ``input_ids`` [B, L] and ``position`` [B],
    the samples' stream positions (seeds of their noise and timesteps).
    """

    def __init__(self, source, tokenize: Callable[[list[str]], torch.Tensor], *, resolution: int,
                 center_crop: bool, random_flip: bool, caption_dropout: float,
                 global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, cache=None):
        self.source, self.tokenize, self.cache = source, tokenize, cache
        self.resolution, self.center_crop, self.random_flip = resolution, center_crop, random_flip
        self.caption_dropout = caption_dropout
        self.G, self.B, self.dp, self.rank, self.seed = (global_batch_size, micro_batch_size,
                                                         dp_size, dp_rank, seed)
        self.micro_per_step = check_batch_layout(global_batch_size, micro_batch_size, dp_size)
        self.step_start, self.micro = 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def image_index(self, position: int) -> int:
        n = len(self.source)
        epoch = position // n
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, 0x1A6E, epoch]).permutation(n)
            self._perm_epoch = epoch
        return int(self._perm[position % n])

    def positions(self) -> range:
        start = self.step_start + self.rank * (self.G // self.dp) + self.micro * self.B
        return range(start, start + self.B)

    def examples(self, positions) -> dict[str, torch.Tensor]:
        """The batch for these stream positions (no loader state changes)."""
        captions, pixels, rows = [], [], []
        for p in positions:
            i = self.image_index(p)
            aug = Augment(self.seed, p, self.random_flip, self.caption_dropout)
            if self.cache is not None:
                rows.append((i, aug.flip))
                captions.append("" if aug.drop_caption else self.source.caption(i))
                continue
            img, caption = self.source.load(i)
            pixels.append(preprocess(img, self.resolution, self.center_crop, aug.flip, aug.gen))
            captions.append("" if aug.drop_caption else caption)
        batch = {"position": torch.tensor(list(positions), dtype=torch.long)}
        if self.cache is not None:
            batch.update(self.cache.batch(rows, [c == "" for c in captions]))
            if "encoder_hidden_states" not in batch:
                batch["input_ids"] = self.tokenize(captions)
        else:
            batch["pixel_values"] = torch.stack(pixels)
            batch["input_ids"] = self.tokenize(captions)
        return batch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = self.examples(self.positions())
        self.micro += 1
        if self.micro == self.micro_per_step:
            self.micro, self.step_start = 0, self.step_start + self.G
        return batch

    @property
    def consumed_samples(self) -> int:
        return self.step_start + self.micro * self.B * self.dp

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "consumed_samples": self.consumed_samples,
                "step_start_samples": self.step_start, "micro_in_step": self.micro,
                "micro_batch_size": self.B, "dp_size": self.dp, "global_batch_size": self.G,
                "seed": self.seed, "num_images": len(self.source)}

    def load_state_dict(self, state: dict) -> None:
        for key, mine, what in (("seed", self.seed, "train.seed"),
                                ("num_images", len(self.source), "data")):
            if int(state.get(key, mine)) != mine:
                raise ConfigError(f"the checkpoint's image loader had {key}={state[key]}, this run "
                                  f"has {mine}; resuming would not continue the same sample order. "
                                  "Restore the original setting or start a new run directory", what)
        micro = int(state.get("micro_in_step", 0))
        if micro and (int(state["micro_batch_size"]), int(state["dp_size"]),
                      int(state["global_batch_size"])) != (self.B, self.dp, self.G):
            raise ConfigError("the checkpoint was taken in the middle of an optimizer step, so it "
                              "can only resume with the same global batch, micro-batch and dp "
                              "sizes", "train.micro_batch_size")
        self.step_start = int(state["step_start_samples"] if micro else state["consumed_samples"])
        self.micro = micro


class ImageValLoader:
    """A fixed, re-iterable set of validation micro-batches: batch ``j`` of
    rank ``r`` holds validation images ``[j*B*dp + r*B, ...+B)`` (wrapping),
    with no flip and no caption dropout, and noise seeded per image."""

    def __init__(self, train: ImageLoader, source, num_batches: int):
        self.train, self.source = train, source
        self.num_batches = num_batches if source is not None and len(source) else 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        t = self.train
        n = len(self.source) if self.source is not None else 0
        for j in range(self.num_batches):
            idx = [(j * t.B * t.dp + t.rank * t.B + k) % n for k in range(t.B)]
            pixels, captions = [], []
            for i in idx:
                img, caption = self.source.load(i)
                pixels.append(preprocess(img, t.resolution, True, False))
                captions.append(caption)
            # negative positions: a noise stream disjoint from training's
            yield {"pixel_values": torch.stack(pixels), "input_ids": t.tokenize(captions),
                   "position": torch.tensor([-1 - i for i in idx], dtype=torch.long)}

    def __len__(self) -> int:
        return self.num_batches
