"""Image checks and re-encoding shared by the packing sources (SA-1B and VQA images)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

__all__ = ["load_whole", "resize_image"]

_WIDE = ("I;16", "I;16L", "I;16B", "I")  # 16-bit PNGs open as I;16 (or I in older Pillow)


def load_whole(image: Image.Image, jpeg: bool) -> None:
    """Decode all of an opened image, so that a truncated or corrupt file fails here (a JPEG at 1/8
    scale: a full pass over its data, cheaply)."""
    if jpeg:
        image.draft(image.mode, (image.width // 8, image.height // 8))
    image.load()


def resize_image(data: bytes, fmt: str, size: tuple[int, int], quality: int, *, rgb: bool = False) -> bytes:
    """The image re-encoded at `size` (h, w): JPEG at `quality`, PNG losslessly in 8 bits (16-bit
    samples scaled, palettes expanded). Grayscale stays grayscale unless `rgb`.

    `rgb=True` is SA-1B's: its packer has always stored a resized grayscale JPEG as an RGB JPEG, and
    keeps doing so, so that its shards stay byte for byte what they were (VQA keeps grayscale gray)."""
    with Image.open(io.BytesIO(data)) as image:
        if fmt == "JPEG":
            image.draft(image.mode, (size[1], size[0]))  # JPEG only: decode at the smallest scale that covers it
        if rgb:
            image = image.convert("RGB")
        elif image.mode in _WIDE:
            image = Image.fromarray((np.clip(np.asarray(image, dtype=np.int64), 0, 65535) >> 8).astype(np.uint8))
        elif image.mode not in ("L", "RGB") + (("LA", "RGBA") if fmt == "PNG" else ()):
            image = image.convert("RGBA" if fmt == "PNG" and "transparency" in image.info else "RGB")
        small = image.resize((size[1], size[0]), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    if fmt == "JPEG":
        small.save(out, format="JPEG", quality=quality)
    else:
        small.save(out, format="PNG")
    return out.getvalue()
