"""The ``data.images`` section: image datasets for Stable Diffusion training."""

from __future__ import annotations

from dataclasses import dataclass

from giantmodel.config.errors import ConfigError


@dataclass
class ImageDataConfig:
    """How images are read, captioned and augmented (sources "images" and "shapes")."""

    resolution: int = 32
    """Training images are resized (shorter side) and cropped to resolution x resolution."""
    center_crop: bool = True
    """Crop the centre; false crops at a random place per sample (not compatible with data.cache_latents)."""
    random_flip: bool = True
    """Flip each sample horizontally with probability 1/2."""
    image_column: str | None = None
    """Where the image is: the metadata.jsonl key of an image folder (default "file_name") or the column of an on-disk HF dataset (default "image")."""
    caption_column: str = "text"
    """The metadata.jsonl key or dataset column that holds each image's caption."""
    num_shapes: int = 2048
    """Source "shapes": how many captioned images to generate."""
    max_images: int = 0
    """Use only the first N images of the dataset (0: all)."""

    def validate(self) -> None:
        if self.resolution < 8 or self.resolution % 8:
            raise ConfigError(f"must be a positive multiple of 8, got {self.resolution}",
                              "data.images.resolution")
        if self.num_shapes < 1:
            raise ConfigError(f"must be at least 1, got {self.num_shapes}", "data.images.num_shapes")
        if self.max_images < 0:
            raise ConfigError("must be >= 0 (0 uses every image)", "data.images.max_images")
