"""Image decoding shared by the kinds: JPEG/PNG bytes -> (3, h, w) uint8 RGB at the size a batch needs.

JPEGs are decoded at the smallest libjpeg scale that covers the frame (Pillow's `draft`: 1/2, 1/4,
1/8), then resized with antialiased bilinear filtering (torch's uint8 kernel, ~6x PIL's). Colour
and grayscale JPEGs go through libjpeg-turbo straight into an array (simplejpeg): the same pixels
as Pillow's, bit for bit, without its two copies out of its own image memory (~15% of a decode);
what simplejpeg refuses goes to Pillow, which packing checked the JPEGs with.
`smart_resize` is Qwen2-VL's pixel budget: the frame it gives is decoded the same way.
Every image becomes RGB: grayscale is replicated, palettes expanded, alpha dropped, 16-bit samples
scaled to 8 bits.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Sequence

import numpy as np
import simplejpeg
import torch
import torch.nn.functional as F
from PIL import Image

from pipeline.errors import SampleError
from pipeline.tario import ReadLimits

# Pillow imports its common format plugins on the first `Image.open` (~20 ms): here instead, once,
# before DataLoader workers fork, not on the path of each worker's first batch.
Image.preinit()

__all__ = ["MAX_IMAGE_PIXELS", "open_image", "to_rgb", "draft_scale", "smart_resize", "decode_image"]

MAX_IMAGE_PIXELS = ReadLimits.max_image_pixels  # larger images are refused (decompression bombs)
_WIDE = ("I;16", "I;16L", "I;16B", "I")  # 16-bit PNGs open as I;16 (or I in older Pillow)
# Qwen2-VL's pixel budget (transformers' `Qwen2VLImageProcessor`): patch 14 x merge 2, and its `size`
QWEN2_VL_FACTOR, QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS = 28, 56 * 56, 28 * 28 * 1280
MAX_ASPECT = 200  # smart_resize refuses images more elongated than this


def open_image(data: bytes, formats: Sequence[str], url: str, key: str, field: str,
               max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """A lazily opened image of one of `formats` (nothing decoded yet), refused above `max_pixels`."""
    try:
        with warnings.catch_warnings():  # Pillow warns of large images; the cap below refuses them
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(formats))
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise SampleError(f"cannot decode {'/'.join(formats)}: {exc}", url=url, key=key, field=field) from exc
    try:
        _check_pixels(image.height, image.width, max_pixels, url, key, field)
    except SampleError:
        image.close()
        raise
    return image


def _check_pixels(height: int, width: int, max_pixels: int, url: str, key: str, field: str) -> None:
    if width * height > max_pixels:
        raise SampleError(f"{width}x{height} pixels exceed the cap {max_pixels}", url=url, key=key, field=field)


def to_rgb(image: Image.Image) -> np.ndarray:
    """(h, w, 3) uint8 pixels of a loaded or lazily opened image, whatever its mode."""
    if image.mode == "RGB":
        return np.array(image)
    if image.mode in _WIDE:  # Pillow's own conversion clips 16-bit values at 255
        gray = (np.clip(np.asarray(image, dtype=np.int64), 0, 65535) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    return np.array(image.convert("RGB"))


def _check_size(height: int, width: int, size: tuple[int, int] | None, url: str, key: str, field: str) -> None:
    if size is not None and (height, width) != tuple(size):
        raise SampleError(f"image is {height}x{width}, the record says {size[0]}x{size[1]}",
                          url=url, key=key, field=field)


def draft_scale(height: int, width: int, frame: tuple[int, int]) -> int:
    """The libjpeg scale denominator Pillow's JPEG `draft` picks for `frame` (h, w): the largest of 8,
    4, 2, 1 that keeps the decoded image at least as large as the frame (by whole multiples of it)."""
    fits = min(width // frame[1], height // frame[0])
    return next((s for s in (8, 4, 2) if fits >= s), 1)


def smart_resize(height: int, width: int, factor: int = QWEN2_VL_FACTOR, min_pixels: int = QWEN2_VL_MIN_PIXELS,
                 max_pixels: int = QWEN2_VL_MAX_PIXELS) -> tuple[int, int]:
    """The (h, w) transformers' Qwen2-VL `smart_resize` gives an image of (height, width): both
    multiples of `factor`, about the same aspect, the area within [min_pixels, max_pixels] (the
    same arithmetic, so the same result). ValueError for an aspect ratio over 200, as there."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):g} is over {MAX_ASPECT}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _turbo_jpeg(data: bytes | memoryview, frame: tuple[int, int] | None, url: str, key: str, field: str,
                max_pixels: int, size: tuple[int, int] | None) -> np.ndarray | None:
    """(h, w, 3) RGB pixels of a YCbCr or grayscale JPEG, decoded as Pillow's draft decodes them;
    None for what Pillow should take instead: other JPEGs (CMYK, ...) and any that libjpeg-turbo's
    simpler API refuses (odd subsampling, damage), which Pillow then decodes or names."""
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    _check_pixels(height, width, max_pixels, url, key, field)
    _check_size(height, width, size, url, key, field)
    if colorspace not in ("YCbCr", "Gray"):
        return None
    scale = 1 if frame is None else draft_scale(height, width, frame)
    try:
        return simplejpeg.decode_jpeg(data, "RGB", min_height=-(-height // scale), min_width=-(-width // scale))
    except ValueError:
        return None


def decode_image(data: bytes, frame: tuple[int, int] | None, url: str, key: str,
                 max_pixels: int = MAX_IMAGE_PIXELS, *, formats: Sequence[str] = ("JPEG",), field: str = "jpg",
                 size: tuple[int, int] | None = None) -> torch.Tensor:
    """The image as (3, h, w) uint8 RGB at `frame` (h, w), or as stored with `frame=None`.
    `size`, if given, is the (h, w) the stored image must have."""
    rgb = None
    if "JPEG" in formats and bytes(data[:3]) == b"\xff\xd8\xff":
        rgb = _turbo_jpeg(data, frame, url, key, field, max_pixels, size)
    if rgb is None:
        image = open_image(data, formats, url, key, field, max_pixels)
        try:
            with image:
                _check_size(image.height, image.width, size, url, key, field)
                if frame is not None:
                    image.draft("RGB", (frame[1], frame[0]))  # JPEG only; other formats ignore it
                rgb = to_rgb(image)
        except (OSError, ValueError, SyntaxError) as exc:
            raise SampleError(f"cannot decode {'/'.join(formats)}: {exc}", url=url, key=key, field=field) from exc
    pixels = torch.from_numpy(rgb).permute(2, 0, 1)
    if frame is None or pixels.shape[1:] == tuple(frame):
        return pixels
    return F.interpolate(pixels[None], size=tuple(frame), mode="bilinear", antialias=True, align_corners=False)[0]
