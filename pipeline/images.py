"""Image decoding shared by the kinds: JPEG/PNG bytes -> (3, h, w) uint8 RGB at the size a batch needs.

JPEGs are decoded at the smallest libjpeg scale that covers the frame (`draft`), then resized with
antialiased bilinear filtering (torch's uint8 kernel, ~6x PIL's). Every image becomes RGB:
grayscale is replicated, palettes expanded, alpha dropped, 16-bit samples scaled to 8 bits.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from pipeline.errors import SampleError
from pipeline.tario import ReadLimits

# Pillow imports its common format plugins on the first `Image.open` (~20 ms): here instead, once,
# before DataLoader workers fork, not on the path of each worker's first batch.
Image.preinit()

__all__ = ["MAX_IMAGE_PIXELS", "open_image", "to_rgb", "decode_image"]

MAX_IMAGE_PIXELS = ReadLimits.max_image_pixels  # larger images are refused (decompression bombs)
_WIDE = ("I;16", "I;16L", "I;16B", "I")  # 16-bit PNGs open as I;16 (or I in older Pillow)


def open_image(data: bytes, formats: Sequence[str], url: str, key: str, field: str,
               max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """A lazily opened image of one of `formats` (nothing decoded yet), refused above `max_pixels`."""
    try:
        with warnings.catch_warnings():  # Pillow warns of large images; the cap below refuses them
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(formats))
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise SampleError(url, key, field, f"cannot decode {'/'.join(formats)}: {exc}") from exc
    if image.width * image.height > max_pixels:
        image.close()
        raise SampleError(url, key, field, f"{image.width}x{image.height} pixels exceed the cap {max_pixels}")
    return image


def to_rgb(image: Image.Image) -> np.ndarray:
    """(h, w, 3) uint8 pixels of a loaded or lazily opened image, whatever its mode."""
    if image.mode == "RGB":
        return np.array(image)
    if image.mode in _WIDE:  # Pillow's own conversion clips 16-bit values at 255
        gray = (np.clip(np.asarray(image, dtype=np.int64), 0, 65535) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    return np.array(image.convert("RGB"))


def decode_image(data: bytes, frame: tuple[int, int] | None, url: str, key: str,
                 max_pixels: int = MAX_IMAGE_PIXELS, *, formats: Sequence[str] = ("JPEG",), field: str = "jpg",
                 size: tuple[int, int] | None = None) -> torch.Tensor:
    """The image as (3, h, w) uint8 RGB at `frame` (h, w), or as stored with `frame=None`.
    `size`, if given, is the (h, w) the stored image must have."""
    image = open_image(data, formats, url, key, field, max_pixels)
    try:
        with image:
            if size is not None and (image.height, image.width) != tuple(size):
                raise SampleError(url, key, field, f"image is {image.height}x{image.width}, the record says "
                                  f"{size[0]}x{size[1]}")
            if frame is not None:
                image.draft("RGB", (frame[1], frame[0]))  # JPEG only; other formats ignore it
            pixels = torch.from_numpy(to_rgb(image)).permute(2, 0, 1)
    except (OSError, ValueError, SyntaxError) as exc:
        raise SampleError(url, key, field, f"cannot decode {'/'.join(formats)}: {exc}") from exc
    if frame is None or pixels.shape[1:] == tuple(frame):
        return pixels
    return F.interpolate(pixels[None], size=tuple(frame), mode="bilinear", antialias=True, align_corners=False)[0]
