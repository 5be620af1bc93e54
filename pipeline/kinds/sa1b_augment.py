"""SA-1B on the reading side, joint augmentation: the frames an image and its masks are resized to
(`resize`), and a horizontal flip (`hflip`) of the image and every geometric field together.

Frames as in `pipeline.kinds.sa1b`: `resize="longest"` keeps the aspect (long side `image_size`,
the batch's image zero-padded on the right and bottom); `resize="square"` (SAM 2's) warps both sides
to `image_size` (the mask frame likewise to `mask_size`), so masks are rasterised straight at a
square frame, nearest sampling per axis. A flip mirrors within the image's content (its frame's
width w, not the padded `image_size`): x -> w - x for points and box corners (a pixel's center
(c + 0.5) goes to that of its mirror pixel), and the masks' rasters mirrored column for column.
Whether a sample is mirrored is its own draw (`pipeline.seeds.Purpose.HFLIP`): turning `hflip` on
changes no other draw (the same masks, points and noise, mirrored).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.errors import ConfigError
from pipeline.rle import fit
from pipeline.seeds import Purpose

__all__ = ["RESIZE_MODES", "check_augment", "frames", "flipped"]

RESIZE_MODES = ("longest", "square")
_BOXES = ("boxes", "prompt_boxes")  # XYXY in the image frame
_POINTS = ("points", "point_coords")  # XY (last axis) in the image frame


def check_augment(options: Any) -> None:
    """Refuse augmentation options out of range, naming the value and what is allowed."""
    p = options.hflip
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
        raise ConfigError(f"hflip must be a probability in [0, 1] (0: never mirrored), got {p!r}")
    if options.resize not in RESIZE_MODES:
        raise ConfigError(f"resize must be one of {RESIZE_MODES}, got {options.resize!r}")


def frames(height: int, width: int, options: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """(image frame, mask frame), each (h, w), of an original image of (height, width)."""
    def frame(size: int) -> tuple[int, int]:
        return (size, size) if options.resize == "square" else fit(height, width, size)

    image = frame(options.image_size)
    return image, image if options.mask_size is None else frame(options.mask_size)


def flipped(sample: dict[str, Any], mask_width: int, options: Any, draw: Any) -> dict[str, Any]:
    """The decoded sample, mirrored left to right when its draw says so (probability `hflip`): its
    image, its masks (bit-packed rows of `mask_width` pixels), and its boxes and points (float32)."""
    if not options.hflip or draw.rng(Purpose.HFLIP).random() >= options.hflip:
        return sample
    w, out = np.float32(sample["image_size"][1]), dict(sample)
    out["image"] = sample["image"].flip(-1)
    bits = np.unpackbits(sample["masks_packed"], axis=-1, count=mask_width)
    out["masks_packed"] = np.packbits(bits[..., ::-1], axis=-1)
    for name in _BOXES:
        if name in sample:
            x0, y0, x1, y1 = np.asarray(sample[name], np.float32).T
            out[name] = np.stack([w - x1, y0, w - x0, y1], 1)
    for name in _POINTS:
        if name in sample:
            points = np.array(sample[name], np.float32)
            points[..., 0] = w - points[..., 0]
            out[name] = points
    return out
