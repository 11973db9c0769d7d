"""A captioned image set made from the seed: coloured shapes on coloured backgrounds.

Image ``i`` is a circle, square or triangle in one of six colours, on a
background of another, at a random size and place, captioned like "a red
circle on a blue background". It needs no files and no network, which is
what the tiny Stable Diffusion default trains on, and it comes with a check
that a generated image depicts its caption: the background's colour (the
border's median) and the shape's colour (the mean of the pixels that differ
from the background) must be the ones the caption names.
"""

from __future__ import annotations

import re

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40), "green": (40, 165, 60), "blue": (45, 75, 215),
    "yellow": (235, 205, 45), "white": (240, 240, 240), "black": (25, 25, 25),
}
SHAPES = ("circle", "square", "triangle")
_CAPTION = re.compile(r"an? (\w+) (\w+) on an? (\w+) background")


def caption_words() -> list[str]:
    """Every word a caption can use (the tiny tokenizer's vocabulary)."""
    return ["a", "an", "on", "background", *COLOURS, *SHAPES]


def shape_spec(i: int, seed: int) -> tuple[str, str, str, np.random.Generator]:
    """(shape, colour, background colour, rng for the geometry) of image ``i``."""
    rng = np.random.default_rng([seed, 0x5A17E5, i])
    names = list(COLOURS)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    colour = names[int(rng.integers(len(names)))]
    bg = [n for n in names if n != colour][int(rng.integers(len(names) - 1))]
    return shape, colour, bg, rng


def draw_shape(i: int, seed: int, resolution: int):
    """(PIL RGB image, caption) of image ``i``."""
    from PIL import Image, ImageDraw

    shape, colour, bg, rng = shape_spec(i, seed)
    scale = 4  # draw large and shrink: anti-aliased edges
    R = resolution * scale

    def jitter(rgb):
        return tuple(int(np.clip(c + rng.integers(-12, 13), 0, 255)) for c in rgb)

    img = Image.new("RGB", (R, R), jitter(COLOURS[bg]))
    draw = ImageDraw.Draw(img)
    r = R * rng.uniform(0.2, 0.32)
    cx, cy = (R * rng.uniform(0.5 - 0.45 + r / R, 0.5 + 0.45 - r / R) for _ in range(2))
    fill = jitter(COLOURS[colour])
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        s = r * 0.9
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r * 0.95, cy + r * 0.8), (cx + r * 0.95, cy + r * 0.8)],
                     fill=fill)
    img = img.resize((resolution, resolution), Image.LANCZOS)
    article = "an" if colour[0] in "aeiou" else "a"
    return img, f"{article} {colour} {shape} on a {bg} background"


class ShapesSource:
    """``num`` generated images, indexable like any image source."""

    def __init__(self, num: int, seed: int, resolution: int, offset: int = 0):
        self.num, self.seed, self.resolution, self.offset = num, seed, resolution, offset
        self.name = f"shapes-{num}-seed{seed}"

    def __len__(self) -> int:
        return self.num

    def load(self, i: int):
        if not 0 <= i < self.num:
            raise IndexError(i)
        return draw_shape(self.offset + i, self.seed, self.resolution)

    def caption(self, i: int) -> str:
        shape, colour, bg, _ = shape_spec(self.offset + i, self.seed)
        article = "an" if colour[0] in "aeiou" else "a"
        return f"{article} {colour} {shape} on a {bg} background"


def _nearest(rgb: np.ndarray) -> str:
    names = list(COLOURS)
    table = np.array([COLOURS[n] for n in names], dtype=np.float64)
    return names[int(np.argmin(((table - rgb) ** 2).sum(axis=1)))]


def check_caption(image, caption: str) -> dict[str, bool]:
    """Does ``image`` (PIL, or uint8 array [H, W, 3]) show ``caption``'s colours?

    ``background``: the median border colour is nearest the named background;
    ``shape``: the pixels far from that colour (at least 3% of the image)
    average nearest the named shape colour.
    """
    m = _CAPTION.fullmatch(caption.strip())
    if m is None:
        raise ValueError(f"not a shapes caption: {caption!r}")
    colour, bg = m.group(1), m.group(3)
    arr = np.asarray(image, dtype=np.float64)[..., :3]
    border = np.concatenate([arr[0], arr[-1], arr[:, 0], arr[:, -1]])
    bg_rgb = np.median(border, axis=0)
    dist = np.sqrt(((arr - bg_rgb) ** 2).sum(axis=-1))
    mask = dist > 80
    shape_ok = bool(mask.mean() >= 0.03) and _nearest(arr[mask].mean(axis=0)) == colour
    return {"background": _nearest(bg_rgb) == bg, "shape": shape_ok}


def draw_ring(i: int, seed: int, resolution: int, colour: str = "red", bg: str = "blue"):
    """A ring (an annulus) of ``colour`` on ``bg``, at a random size and place:
    the tiny DreamBooth recipe's "instance", an object the shapes set never shows."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([seed, 0x219, i])
    R = resolution * 4
    img = Image.new("RGB", (R, R), COLOURS[bg])
    draw = ImageDraw.Draw(img)
    r = R * rng.uniform(0.24, 0.32)
    cx, cy = (R * rng.uniform(0.5 - 0.45 + r / R, 0.5 + 0.45 - r / R) for _ in range(2))
    draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=COLOURS[colour])
    h = r * 0.5
    draw.ellipse([cx - h, cy - h, cx + h, cy + h], fill=COLOURS[bg])
    return img.resize((resolution, resolution), Image.LANCZOS)


class RingSource:
    """``num`` generated rings, all captioned ``prompt`` (DreamBooth instance images)."""

    def __init__(self, num: int, seed: int, resolution: int, prompt: str):
        self.num, self.seed, self.resolution, self.prompt = num, seed, resolution, prompt
        self.name = f"rings-{num}-seed{seed}"

    def __len__(self) -> int:
        return self.num

    def load(self, i: int):
        if not 0 <= i < self.num:
            raise IndexError(i)
        return draw_ring(i, self.seed, self.resolution), self.prompt

    def caption(self, i: int) -> str:
        return self.prompt
