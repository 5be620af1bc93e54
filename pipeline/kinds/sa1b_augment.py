"""SA-1B on the reading side, joint augmentation: the frames an image and its masks are resized to
(`resize`), large-scale jitter (`scale_jitter`: scaled, then cropped or padded), and a horizontal
flip (`hflip`) of the image and every geometric field together.

Frames as in `pipeline.kinds.sa1b`: `resize="longest"` keeps the aspect (long side `image_size`,
the batch's image zero-padded on the right and bottom); `resize="square"` (SAM 2's) warps both sides
to `image_size` (the mask frame likewise to `mask_size`), so masks are rasterised straight at a
square frame, nearest sampling per axis. A flip mirrors within the image's content (its frame's
width w, not the padded `image_size`): x -> w - x for points and box corners (a pixel's center
(c + 0.5) goes to that of its mirror pixel), and the masks' rasters mirrored column for column.
Whether a sample is mirrored is its own draw (`pipeline.seeds.Purpose.HFLIP`): turning `hflip` on
changes no other draw (the same masks, points and noise, mirrored).

Scale jitter (`View`): a factor f drawn in [lo, hi] scales the original so that its long side is
round(f x `image_size`) (both sides, with `resize="square"`); the canvas (`image_size`^2) is then
read from an offset (drawn uniformly, in whole scaled pixels, on each axis the scaled image
overhangs; 0 where it is smaller, then padded on the right and bottom). Masks are sampled straight
from their RLE at the canvas's mask pixels (`pipeline.rle.affine_index`: mask pixel j, `image_size`
/ `mask_size` image pixels wide, samples original pixel floor(((j + 0.5) x image_size / mask_size +
offset) x H / h_scaled)), never at full size. What a crop shows of a mask (`View.show`) is its
original pixels whose centers land in the content (`View.window`): a mask whose box lies outside the
crop is dropped before anything of it is decoded, one with no pixel shown before its raster; the
boxes, areas and prompts of the others describe what is shown (from the runs cut to the window,
`pipeline.rle.crop`), not the whole mask.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pipeline.errors import ConfigError
from pipeline.rle import Runs, affine_index, areas, crop, fit, foreground_pixels, nearest_index, tight_boxes
from pipeline.seeds import Purpose

__all__ = ["RESIZE_MODES", "MAX_SCALE", "IMAGE_FIELDS", "check_augment", "depends", "frames", "flips", "flipped",
           "Shown", "View", "view_of", "augmented"]

RESIZE_MODES = ("longest", "square")
MAX_SCALE = 10.0  # scale_jitter's largest factor (an image decoded at 10 x image_size on a side)
_BOXES = ("boxes", "prompt_boxes")  # XYXY in the image frame
_POINTS = ("points", "point_coords")  # XY (last axis) in the image frame


# A batch's fields that come of the image alone, and the options that shape them (`depends`).
IMAGE_FIELDS = frozenset({"images", "image_sizes", "original_sizes", "image_ids", "keys"})
_IMAGE_OPTIONS = frozenset({"image_size", "resize", "hflip", "scale_jitter", "max_image_pixels"})


def depends(options: Any, inputs: frozenset[str] | None) -> tuple[bool, frozenset[str]]:
    """`Kind.depends`: the image's fields change with the epoch only under augmentation, and only its
    frame and augmentation shape them; masks and prompts are drawn afresh each epoch. `decode_device`
    shapes none: it says where pixels are made, not what they are (but for the decoders' IDCT)."""
    if inputs is not None and inputs <= IMAGE_FIELDS:
        return options.hflip > 0 or options.scale_jitter is not None, _IMAGE_OPTIONS
    return True, frozenset(f.name for f in dataclasses.fields(options)) - {"decode_device"}  # (where, not what)


def check_augment(options: Any) -> None:
    """Refuse augmentation options out of range, naming the value and what is allowed."""
    p = options.hflip
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
        raise ConfigError(f"hflip must be a probability in [0, 1] (0: never mirrored), got {p!r}")
    if options.resize not in RESIZE_MODES:
        raise ConfigError(f"resize must be one of {RESIZE_MODES}, got {options.resize!r}")
    jitter = options.scale_jitter
    if jitter is None:
        return
    ok = isinstance(jitter, (tuple, list)) and len(jitter) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in jitter)
    if not ok or not 0 < jitter[0] <= jitter[1] <= MAX_SCALE:
        raise ConfigError(f"scale_jitter must be None or (lo, hi) with 0 < lo <= hi <= {MAX_SCALE:g} (factors of "
                          f"image_size), got {jitter!r}")


def frames(height: int, width: int, options: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """(image frame, mask frame), each (h, w), of an original image of (height, width)."""
    def frame(size: int) -> tuple[int, int]:
        return (size, size) if options.resize == "square" else fit(height, width, size)

    image = frame(options.image_size)
    return image, image if options.mask_size is None else frame(options.mask_size)


def flips(options: Any, draw: Any) -> bool:
    """Whether the sample is mirrored left to right (its own draw, probability `hflip`): its masks are
    then rasterised mirrored (`rle.bits_at`), the rest mirrored by `flipped`."""
    return bool(options.hflip) and draw.rng(Purpose.HFLIP).random() < options.hflip


def flipped(sample: dict[str, Any]) -> dict[str, Any]:
    """A decoded sample whose masks were rasterised mirrored: its boxes and points (float32) mirrored
    left to right too, within the image's content, and its image marked `mirrored`: `Sa1b.collate`
    copies it into the batch mirrored (`collate.copy_mirrored`), in the copy it makes anyway."""
    w, out = np.float32(sample["image_size"][1]), {**sample, "mirrored": True}
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


@dataclasses.dataclass(frozen=True)
class Shown:
    """The chosen masks as a view shows them (`View.show`): a row per chosen mask with a pixel shown."""

    masks: Runs  # the distinct masks of the rows, whole: rasterised at the view's rows and columns
    inside: Runs  # the same masks, only their pixels the canvas shows (`rle.crop`): points are drawn there
    rows: np.ndarray  # each row's mask among `masks`
    kept: np.ndarray  # bool per chosen mask: whether it is a row
    bbox: np.ndarray  # (rows, 4) XYWH, original frame: the tight box of what is shown of the mask
    area: np.ndarray  # (rows,) original pixels shown
    point: np.ndarray  # (rows, 2) XY, original frame: the mask's first point, or its middle pixel shown


def _centers_in(src: int, scaled: int, start: int, length: int) -> tuple[int, int]:
    """[first, end): the source pixels p whose centers, (p + 0.5) x scaled / src, lie in [start, start + length)."""
    def first(at: int) -> int:  # the first p with (p + 0.5) * scaled / src >= at, in exact integers
        return min(src, max(0, -((scaled - 2 * at * src) // (2 * scaled))))

    return first(start), first(start + length)


@dataclasses.dataclass(frozen=True)
class View:
    """Where an original image of `size` (H, W) lands: scaled to `scaled` (h, w; the frame the image is
    decoded at and columns are scaled to), the canvas read from `offset` (y, x) scaled pixels on, its
    `content` (h, w) the image's part of the canvas (`image_sizes`); masks sampled at original rows
    `rows` and columns `cols` (the mask canvas's content)."""

    size: tuple[int, int]
    scaled: tuple[int, int]
    offset: tuple[int, int]
    content: tuple[int, int]
    rows: np.ndarray
    cols: np.ndarray

    @property
    def cropped(self) -> bool:
        return self.content != self.scaled

    def visible(self, bbox: np.ndarray) -> np.ndarray:
        """Which boxes (XYWH, original frame) overlap the content: the others' masks are dropped."""
        if not self.cropped:
            return np.ones(len(bbox), bool)
        (height, width), (h, w), (oy, ox) = self.size, self.scaled, self.offset
        x, y, bw, bh = bbox.T
        left, top = x * w / width - ox, y * h / height - oy
        right, bottom = (x + bw) * w / width - ox, (y + bh) * h / height - oy
        return (right > 0) & (bottom > 0) & (left < self.content[1]) & (top < self.content[0])

    @property
    def window(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The original's pixels the content shows, ([top, bottom) rows, [left, right) columns): those
        whose centers land in it."""
        (height, width), (h, w), (oy, ox), (ch, cw) = self.size, self.scaled, self.offset, self.content
        return _centers_in(height, h, oy, ch), _centers_in(width, w, ox, cw)

    def show(self, masks: Runs, rows: np.ndarray, bbox: np.ndarray, area: np.ndarray, point: np.ndarray) -> Shown:
        """The chosen masks as shown (`Shown`): `masks` the distinct ones parsed, each chosen mask's
        index among them in `rows`, and its stored `bbox`, `area` and first `point`. Uncropped, all of
        each; cropped, what the window shows: a mask with no pixel there is dropped, and a first point
        the crop cut off is replaced by the mask's middle pixel shown (column-major): every point is on it."""
        if not self.cropped:
            return Shown(masks, masks, rows, np.ones(len(rows), bool), bbox, area, point)
        inside = crop(masks, *self.window)
        pixels = areas(inside)
        keep = pixels > 0
        kept = keep[rows]
        if not keep.all():
            masks, inside, rows = masks.subset(keep), inside.subset(keep), (np.cumsum(keep) - 1)[rows[kept]]
        x0, y0, x1, y1 = tight_boxes(inside)[rows].T
        (height, width), (h, w), (oy, ox), (ch, cw) = self.size, self.scaled, self.offset, self.content
        point = point[kept].copy()
        at = point * (w / width, h / height) - (ox, oy)  # (in the canvas)
        off = ~((at >= 0) & (at < (cw, ch))).all(1)
        if off.any():
            point[off] = foreground_pixels(inside, np.full((int(off.sum()), 1), 0.5), rows[off])[:, 0] + 0.5
        return Shown(masks, inside, rows, kept, np.stack([x0, y0, x1 - x0, y1 - y0], 1).astype(np.float64),
                     pixels[keep][rows].astype(np.float64), point)

    def image(self, pixels: Any) -> Any:
        """The content of the canvas from the image decoded at `scaled`: (3, h, w)."""
        (oy, ox), (h, w) = self.offset, self.content
        return pixels[:, oy : oy + h, ox : ox + w] if self.cropped else pixels

    def place(self, sample: dict[str, Any]) -> dict[str, Any]:
        """A sample's boxes and points (in the scaled frame) moved by the offset and clipped to the
        content (they describe what it shows: `show`)."""
        if not self.cropped:
            return sample
        (oy, ox), (h, w), out = self.offset, self.content, dict(sample)
        for name in _BOXES:
            if name in sample:
                out[name] = np.clip(sample[name] - np.array([ox, oy, ox, oy], sample[name].dtype), 0, (w, h, w, h))
        for name in _POINTS:
            if name in sample:
                out[name] = np.clip(sample[name] - np.array([ox, oy], sample[name].dtype), 0, (w, h))
        return out


def view_of(height: int, width: int, options: Any, draw: Any) -> View:
    """Where a sample of (height, width) lands: its frames (`frames`), or with `scale_jitter` its
    drawn scale (`Purpose.SCALE_JITTER`) and crop offset (`Purpose.CROP`)."""
    if options.scale_jitter is None:
        image, mask = frames(height, width, options)
        rows, cols = nearest_index(height, mask[0]), nearest_index(width, mask[1])
        return View((height, width), image, (0, 0), image, rows, cols)
    s, m = options.image_size, options.mask_frame
    long = max(1, round(draw.rng(Purpose.SCALE_JITTER).uniform(*options.scale_jitter) * s))
    scaled = (long, long) if options.resize == "square" else fit(height, width, long)
    room = np.maximum(np.array(scaled) - s, 0)
    offset = tuple(int(v) for v in draw.rng(Purpose.CROP).integers(0, room + 1))
    content = (min(scaled[0] - offset[0], s), min(scaled[1] - offset[1], s))
    rows = affine_index(height, scaled[0], offset[0], (s, m), m)
    return View((height, width), scaled, offset, content, rows, affine_index(width, scaled[1], offset[1], (s, m), m))


def augmented(sample: dict[str, Any], view: View, flip: bool) -> dict[str, Any]:
    """A decoded sample (columns in the view's scaled frame) placed in its canvas, then mirrored
    with `flip` (its masks were rasterised mirrored: `flips`)."""
    placed = view.place(sample)
    return flipped(placed) if flip else placed
