"""Image data for diffusion: sources, bad input, preprocessing, the loader's
batch semantics (dp slices, resume), the latent cache and the shapes set."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from giantmodel.config.data import DataConfig
from giantmodel.config.errors import ConfigError, UserInputError
from giantmodel.data.images import FolderSource, ImageLoader, ImageValLoader, open_source, preprocess
from giantmodel.data.shapes import caption_words, check_caption, draw_shape
from giantmodel.models.sd.tokenizer import build_word_tokenizer

PIL = pytest.importorskip("PIL")


def _folder(tmp_path, n=6, size=(40, 30)):
    from PIL import Image

    d = tmp_path / "imgs"
    d.mkdir()
    lines = []
    for i in range(n):
        img, caption = draw_shape(i, 0, 48)
        img.resize(size).save(d / f"{i:03d}.png")
        lines.append(json.dumps({"file_name": f"{i:03d}.png", "text": caption}))
    (d / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    del Image
    return d


def _loader(source, rank=0, dp=1, B=2, G=4, seed=1, dropout=0.0, flip=True, cache=None):
    tok = build_word_tokenizer(caption_words(), 16)
    return ImageLoader(source, tok, resolution=16, center_crop=True, random_flip=flip,
                       caption_dropout=dropout, global_batch_size=G, micro_batch_size=B,
                       dp_rank=rank, dp_size=dp, seed=seed, cache=cache)


def test_folder_and_hf_dataset_sources(tmp_path):
    d = _folder(tmp_path)
    src = open_source(DataConfig(source="images", paths=[str(d)]), seed=0)
    assert len(src) == 6
    img, caption = src.load(2)
    assert img.size == (40, 30) and caption == draw_shape(2, 0, 48)[1]
    datasets = pytest.importorskip("datasets")
    rows = [src.load(i) for i in range(6)]
    ds = datasets.Dataset.from_dict({"img": [r[0] for r in rows], "caption": [r[1] for r in rows]},
                                    features=datasets.Features({"img": datasets.Image(),
                                                                "caption": datasets.Value("string")}))
    ds.save_to_disk(str(tmp_path / "hf"))
    cfg = DataConfig(source="images", paths=[str(tmp_path / "hf")])
    with pytest.raises(UserInputError, match="no column 'image'.*image_column"):
        open_source(cfg, seed=0)
    cfg.images.image_column = "img"
    with pytest.raises(UserInputError, match="no column 'text'.*caption_column"):
        open_source(cfg, seed=0)
    cfg.images.caption_column, cfg.images.image_column = "caption", "img"
    hf = open_source(cfg, seed=0)
    a, b = hf.load(4), src.load(4)
    assert a[1] == b[1] and np.array_equal(np.asarray(a[0]), np.asarray(b[0]))


def test_bad_image_input_fails_with_one_clear_line(tmp_path):
    d = _folder(tmp_path)
    (d / "003.png").unlink()
    with pytest.raises(UserInputError, match="003.png.*does not exist"):
        FolderSource(d)
    (d / "003.png").write_bytes(b"\x89PNG but not really")
    with pytest.raises(UserInputError, match="003.png: not a readable image"):
        FolderSource(d)
    (d / "metadata.jsonl").write_text(json.dumps({"file_name": "000.png", "caption": "x"}) + "\n")
    with pytest.raises(UserInputError, match="metadata.jsonl:1: no 'text' key.*caption_column"):
        FolderSource(d)
    with pytest.raises(UserInputError, match="metadata.jsonl is missing"):
        FolderSource(tmp_path)
    with pytest.raises(ConfigError, match="data.paths"):
        DataConfig(source="images").validate()
    bad = DataConfig(source="shapes", cache_latents=True)
    bad.images.center_crop = False
    with pytest.raises(ConfigError, match="data.cache_latents"):
        bad.validate()


def test_preprocess_resize_crop_flip():
    from PIL import Image

    arr = np.zeros((20, 40, 3), dtype=np.uint8)
    arr[:, :20] = 255  # left half white
    img = Image.fromarray(arr)
    x = preprocess(img, 10, center_crop=True, flip=False)
    assert x.shape == (3, 10, 10) and x.min() >= -1 and x.max() <= 1
    # 40x20 -> 20x10, centre 10 columns: white then black
    assert x[:, :, 0].mean() > 0.9 and x[:, :, -1].mean() < -0.9
    left = preprocess(img, 10, center_crop=False, flip=False, gen=torch.Generator().manual_seed(0))
    assert torch.equal(preprocess(img, 10, True, True), x.flip(-1))
    assert left.shape == (3, 10, 10)


def test_loader_dp_slices_resume_and_determinism():
    src = open_source(DataConfig(source="shapes"), seed=3)
    one = _loader(src, dropout=0.3)
    single = [next(one) for _ in range(6)]  # 3 steps of 2 micro-batches
    ranks = [_loader(src, rank=r, dp=2, B=1, dropout=0.3) for r in range(2)]
    for step in range(3):
        got = [next(r) for r in ranks for _ in range(2)]
        want = single[2 * step: 2 * step + 2]
        for key in ("pixel_values", "input_ids", "position"):
            assert torch.equal(torch.cat([g[key] for g in got]), torch.cat([w[key] for w in want]))
    # resume mid-step, then the same samples follow
    fresh = _loader(src, dropout=0.3)
    next(fresh)
    state = fresh.state_dict()
    resumed = _loader(src, dropout=0.3)
    resumed.load_state_dict(state)
    assert torch.equal(next(resumed)["pixel_values"], single[1]["pixel_values"])
    with pytest.raises(ConfigError, match="train.seed"):
        _loader(src, seed=2).load_state_dict(state)
    # caption dropout empties some captions: the empty caption is start, end, padding
    ids = torch.cat([b["input_ids"] for b in single])
    empty = (ids[:, 2:] == ids[0, -1]).all(dim=1) & (ids[:, 1] == ids[0, -1])
    assert 0 < int(empty.sum()) < len(ids)
    val = ImageValLoader(one, open_source(DataConfig(source="shapes"), seed=99), num_batches=2)
    v1, v2 = list(val), list(val)
    assert len(v1) == 2 and torch.equal(v1[1]["pixel_values"], v2[1]["pixel_values"])
    assert (v1[0]["position"] < 0).all()


def test_latent_cache_matches_uncached_batches(tmp_path):
    from giantmodel.data.latent_cache import LatentCache

    src = open_source(DataConfig(source="shapes"), seed=3)
    src.num = 10
    conv = torch.nn.Conv2d(3, 8, 2, stride=2)

    def encode(x):
        with torch.no_grad():
            return conv(x)

    def encode_text(captions):
        return torch.randn(len(captions), 16, 4, generator=torch.Generator().manual_seed(len(captions[0])))

    cache = LatentCache.build(tmp_path / "c", src, resolution=16, center_crop=True, random_flip=True,
                              encode_images=encode, encode_text=None, rank=0, world=1,
                              gather=lambda t: t, barrier=lambda: None, batch_size=3, writer=True)
    plain, cached = _loader(src), _loader(src, cache=cache)
    for _ in range(4):
        a, b = next(plain), next(cached)
        assert torch.allclose(encode(a["pixel_values"]), b["latent_moments"], atol=1e-6)
        assert torch.equal(a["input_ids"], b["input_ids"])
    assert LatentCache.ready(tmp_path / "c")
    with_text = LatentCache.build(tmp_path / "t", src, resolution=16, center_crop=True,
                                  random_flip=False, encode_images=encode, encode_text=encode_text,
                                  rank=0, world=1, gather=lambda t: t, barrier=lambda: None,
                                  batch_size=4, writer=True)
    batch = next(_loader(src, cache=with_text, flip=False, dropout=0.5))
    assert batch["encoder_hidden_states"].shape == (2, 16, 4) and "input_ids" not in batch


def test_shapes_captions_and_check():
    words = set(caption_words())
    hits = 0
    for i in range(60):
        img, caption = draw_shape(i, 5, 32)
        assert set(caption.split()) <= words
        r = check_caption(img, caption)
        hits += r["background"] and r["shape"]
        # the check is not vacuous: a wrong colour fails it
        other = "green" if " red " not in caption else "blue"
        wrong = caption.split()
        wrong[1] = other if wrong[1] != other else "white"
        assert not check_caption(img, " ".join(wrong))["shape"]
    assert hits == 60
