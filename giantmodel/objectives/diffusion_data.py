"""The diffusion objective's data: loaders, the latent cache, DreamBooth's
class images, and the samples written after training.

The latent cache and the class images need the initialised (possibly
pretrained, possibly sharded) model, which exists only after the trainer
has loaded weights; so the training loader prepares them on its first
batch, on every rank together (sharded models run in lockstep).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from giantmodel.config.errors import ConfigError, UserInputError
from giantmodel.data.images import (
    Augment,
    FolderSource,
    ImageLoader,
    ImageValLoader,
    Subset,
    open_source,
    preprocess,
)
from giantmodel.data.latent_cache import LatentCache, cache_key
from giantmodel.data.shapes import RingSource, ShapesSource, caption_words, check_caption
from giantmodel.models.sd.sampling import generate_images, save_png, to_pil

VALID_IMAGES = 64


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_agree(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` holds on every rank."""
    if _world()[1] == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _gather(t: torch.Tensor) -> torch.Tensor:
    _rank, world = _world()
    if world == 1:
        return t
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous())
    return out


def _barrier() -> None:
    if _world()[1] > 1:
        dist.barrier()


class PreparedLoader:
    """A loader that runs ``prepare(loader)`` before its first batch."""

    def __init__(self, loader, prepare):
        self.loader, self._prepare = loader, prepare

    def __iter__(self):
        return self

    def __next__(self):
        if self._prepare is not None:
            prepare, self._prepare = self._prepare, None
            prepare(self.loader)
        return next(self.loader)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


class DreamBoothLoader(ImageLoader):
    """Instance and class images in one batch: B instance examples, then B
    class examples (``is_prior``), as diffusers' train_dreambooth.py builds it.
    Stream position p uses pair j = perm[p mod L], L = max(instances, classes):
    instance j mod n_i and class j mod n_c."""

    def __init__(self, instances, classes, tokenize, **kw):
        self.instances, self.classes = instances, classes
        super().__init__(_Length(max(len(instances), len(classes))), tokenize, **kw)

    def examples(self, positions) -> dict[str, torch.Tensor]:
        halves = []
        for source, offset in ((self.instances, 0), (self.classes, 1)):
            pixels, captions = [], []
            for p in positions:
                i = self.image_index(p) % len(source)
                aug = Augment(self.seed, 2 * p + offset, self.random_flip, self.caption_dropout)
                img, caption = source.load(i)
                pixels.append(preprocess(img, self.resolution, self.center_crop, aug.flip, aug.gen))
                captions.append("" if aug.drop_caption else caption)
            halves.append((torch.stack(pixels), self.tokenize(captions)))
        n = len(positions)
        pos = torch.tensor(list(positions), dtype=torch.long)
        return {"pixel_values": torch.cat([halves[0][0], halves[1][0]]),
                "input_ids": torch.cat([halves[0][1], halves[1][1]]),
                "position": torch.cat([2 * pos, 2 * pos + 1]),
                "is_prior": torch.tensor([False] * n + [True] * n)}


class _Length:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class TrainingData:
    """Sources of one job, opened (and checked) before any process group exists."""

    def __init__(self, cfg, vae_cfg):
        self.cfg, self.sd, self.vae_cfg = cfg, cfg.sd, vae_cfg
        db = self.sd.dreambooth
        res, seed = cfg.data.images.resolution, cfg.train.seed
        self.val = None
        if db is not None:
            if db.instance_dir:
                try:
                    self.train = FolderSource(db.instance_dir, prompt=db.instance_prompt)
                except UserInputError as e:
                    raise ConfigError(str(e), "sd.dreambooth.instance_dir") from None
            else:
                self.train = RingSource(db.num_instance_images, seed, res, db.instance_prompt)
            return
        if cfg.data.source not in ("images", "shapes"):
            raise ConfigError(f"the diffusion objective trains on images: set data.source to "
                              f"'shapes' (generated, no files) or 'images' (data.paths=[DIR]), "
                              f"not {cfg.data.source!r}", "data.source")
        self.train = open_source(cfg.data, seed)
        if cfg.data.source == "shapes":
            self.val = ShapesSource(VALID_IMAGES, seed, res, offset=cfg.data.images.num_shapes)
        elif cfg.data.valid_fraction > 0 and len(self.train) > 1:
            n_val = max(1, int(len(self.train) * cfg.data.valid_fraction))
            base = self.train
            self.val = _Tail(base, n_val)
            self.train = Subset(base, len(base) - n_val)

    def all_captions(self) -> list[str]:
        db = self.sd.dreambooth
        if db is not None:
            return [db.instance_prompt, db.class_prompt, *caption_words()]
        if self.cfg.data.source == "shapes":
            return caption_words()
        return [self.train.caption(i) for i in range(len(self.train))]

    def loaders(self, objective, *, dp_rank: int, dp_size: int):
        cfg, ic, t = self.cfg, self.cfg.data.images, self.cfg.train
        kw = {"resolution": ic.resolution, "center_crop": ic.center_crop, "random_flip": ic.random_flip,
                  "caption_dropout": self.sd.caption_dropout, "global_batch_size": t.global_batch_size,
                  "micro_batch_size": t.micro_batch_size, "dp_rank": dp_rank, "dp_size": dp_size,
                  "seed": t.seed}
        tok = objective.tokenizer
        if dp_rank == 0 and _world()[0] == 0:
            tok.save(Path(cfg.run.dir) / "tokenizer")
        db = self.sd.dreambooth
        if db is not None and db.with_prior_preservation:
            # the class images exist only after _prepare_classes; their number is known now
            loader = DreamBoothLoader(self.train, _Length(db.num_class_images), tok, **kw)
            prepare = functools.partial(self._prepare_classes, objective)
        else:
            loader = ImageLoader(self.train, tok, **kw)
            prepare = functools.partial(self._prepare_cache, objective) if cfg.data.cache_latents else None
        val = ImageValLoader(loader, self.val, cfg.data.val_batches)
        return (PreparedLoader(loader, prepare) if prepare else loader), val

    # ------------------------------------------------------------ the cache
    def _prepare_cache(self, objective, loader: ImageLoader) -> None:
        module, device = objective.module, _device(objective.module)
        ic, trained_text = self.cfg.data.images, self.sd.train_text_encoder
        probe = preprocess(self.train.load(0)[0], ic.resolution, True, False)[None].to(device)
        with torch.no_grad():
            fp = module("moments", probe).float().cpu().numpy().round(3).tobytes()
            tok = objective.tokenizer
            ids = tok(["a"]).to(device)
            tfp = b"" if trained_text else module("text", ids).float().cpu().numpy().round(3).tobytes()
        key = cache_key({"data": [self.train.name, len(self.train)], "res": ic.resolution,
                         "crop": ic.center_crop, "flip": ic.random_flip, "text": not trained_text,
                         "vae": hashlib.sha256(fp).hexdigest(), "te": hashlib.sha256(tfp).hexdigest(),
                         "tok": hashlib.sha256(json.dumps(tok.vocab, sort_keys=True).encode()
                                               ).hexdigest()})
        folder = self.cfg.data.resolved_cache_dir() / "latents" / key
        rank, world = _world()
        if not _all_agree(LatentCache.ready(folder), device):
            def encode_images(x):
                with torch.no_grad():
                    return module("moments", x.to(device))

            def encode_text(captions):
                with torch.no_grad():
                    return module("text", tok(captions).to(device))
            writer = int(os.environ.get("LOCAL_RANK", rank)) == 0
            LatentCache.build(folder, self.train, resolution=ic.resolution,
                              center_crop=ic.center_crop, random_flip=ic.random_flip,
                              encode_images=encode_images,
                              encode_text=None if trained_text else encode_text,
                              rank=rank, world=world, gather=_gather, barrier=_barrier,
                              batch_size=max(1, self.cfg.train.micro_batch_size), writer=writer)
        loader.cache = LatentCache(folder)

    # ----------------------------------------------------- DreamBooth priors
    def _prepare_classes(self, objective, loader: DreamBoothLoader) -> None:
        db = self.sd.dreambooth
        folder = Path(db.class_dir or Path(self.cfg.run.dir) / "class_images")
        folder.mkdir(parents=True, exist_ok=True)
        have = len([p for p in folder.iterdir() if p.suffix.lower() == ".png"])
        missing = list(range(have, db.num_class_images))
        device = _device(objective.module)
        if not _all_agree(not missing, device):
            generate_class_images(objective, folder, missing)
        loader.classes = Subset(FolderSource(folder, prompt=db.class_prompt), db.num_class_images)


def generate_class_images(objective, folder: Path, indices: list[int], batch: int = 8) -> None:
    """Class images ``indices`` from the model itself, split over the ranks in lockstep."""

    sd, db = objective.sd, objective.sd.dreambooth
    rank, world = _world()
    mine = indices[rank::world]
    per_rank = -(-len(indices) // world)
    mine = mine + [None] * (per_rank - len(mine))  # equal work: sharded models run in lockstep
    objective.module.eval()
    for s in range(0, per_rank, batch):
        chunk = mine[s:s + batch]
        images = generate_images(objective.module, [db.class_prompt] * len(chunk), sampler=sd.sampler,
                                 steps=sd.sample_steps, guidance_scale=sd.guidance_scale,
                                 seed=objective.seed * 100_003 + (chunk[0] or 0))
        for i, img in zip(chunk, images):
            if i is not None:
                save_png(img, folder / f"class-{i:05d}.png")
    objective.module.train()
    _barrier()


class _Tail:
    """The last ``n`` images of a source (held out for validation)."""

    def __init__(self, source, n: int):
        self.source, self.n, self.start, self.name = source, n, len(source) - n, source.name + ":val"

    def __len__(self) -> int:
        return self.n

    def load(self, i: int):
        return self.source.load(self.start + i)

    def caption(self, i: int) -> str:
        return self.source.caption(self.start + i)


def _device(module) -> torch.device:
    return next(module.parameters()).device


def sample_prompts(objective) -> list[str]:
    sd, data = objective.sd, objective.data
    if sd.sample_prompts:
        return list(sd.sample_prompts)
    if sd.dreambooth is not None:
        return [sd.dreambooth.instance_prompt, sd.dreambooth.class_prompt] * (sd.num_samples // 2)
    src = data.val or data.train
    return [src.caption(i % len(src)) for i in range(sd.num_samples)]


def write_samples(objective, model, out: Path, batch: int = 16) -> str | None:
    """PNGs for the sample prompts (and, on the shapes set, the caption check rate)."""

    sd = objective.sd
    prompts = sample_prompts(objective)
    if not prompts:
        return None
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    results, images = [], []
    for s in range(0, len(prompts), batch):
        images += list(generate_images(model, prompts[s:s + batch], sampler=sd.sampler,
                                       steps=sd.sample_steps, guidance_scale=sd.guidance_scale,
                                       seed=objective.seed + s))
    for i, (img, prompt) in enumerate(zip(images, prompts)):
        save_png(img, out / f"{i:03d}.png")
        if objective.cfg.data.source == "shapes" and sd.dreambooth is None:
            results.append({"prompt": prompt, **check_caption(to_pil(img), prompt)})
    _grid(images, out / "grid.png")
    (out / "prompts.txt").write_text("\n".join(prompts) + "\n")
    model.train()
    line = f"{len(images)} samples in {out}"
    if results:
        ok = sum(r["background"] and r["shape"] for r in results)
        (out / "caption_check.json").write_text(json.dumps(
            {"rate": ok / len(results), "passed": ok, "total": len(results),
             "background_rate": float(np.mean([r["background"] for r in results])),
             "shape_rate": float(np.mean([r["shape"] for r in results])), "images": results},
            indent=2))
        line += f"; caption check {ok}/{len(results)} ({ok / len(results):.0%})"
    return line


def _grid(images: list[torch.Tensor], path: Path, cols: int = 8) -> None:
    from PIL import Image


    h, w = images[0].shape[1:]
    rows = -(-len(images) // cols)
    grid = Image.new("RGB", (w * min(cols, len(images)), h * rows))
    for k, img in enumerate(images):
        grid.paste(to_pil(img), ((k % cols) * w, (k // cols) * h))
    grid.save(path)


def open_training_data(cfg, vae_cfg) -> TrainingData:
    return TrainingData(cfg, vae_cfg)
