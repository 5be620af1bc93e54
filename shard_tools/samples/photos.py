"""One SA-1B-shaped image and its masks, rendered from a photograph bundled with scikit-image.

The image is a random crop (with a random flip) of a bundled photo; its masks are regions of real
segmentations of the crop (SLIC at several scales plus Felzenszwalb), so that masks overlap as in
SA-1B, encoded as COCO compressed RLE. `shard_tools.samples.sa1b` writes them as a dataset.
"""

from __future__ import annotations

import functools
import io
import logging
import pathlib
from typing import Any, NamedTuple

import numpy as np
import pycocotools.mask as mask_utils
import skimage.color
import skimage.data
import skimage.filters
import skimage.segmentation
from PIL import Image

__all__ = ["PHOTOS", "Job", "Rendered", "image_size", "photo_paths", "render"]

# The writer's logger: its warnings keep the name they had before the renderer had its own module.
logger = logging.getLogger("shard_tools.samples.sa1b")

#: Sample photographs shipped inside the scikit-image wheel (file names in
#: ``skimage/data``; the matching loaders are ``skimage.data.astronaut()``,
#: ``chelsea()``, ``coffee()``, ``rocket()``, ``hubble_deep_field()``,
#: ``immunohistochemistry()``, ``stereo_motorcycle()`` (left and right),
#: ``retina()``, ``camera()``, ``coins()`` and ``moon()``).  All of them load
#: without network access; the last three are grayscale and converted to RGB.
PHOTOS: tuple[str, ...] = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "rocket.jpg",
    "hubble_deep_field.jpg",
    "ihc.png",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "retina.jpg",
    "camera.png",
    "coins.png",
    "moon.png",
)

_JPEG_QUALITY = 90
_WORK_LONG_SIDE = 320  # long side of the working resolution for segmentation
_CHUNK = 16  # masks encoded per pycocotools.mask.encode call
_MIN_CROP = 0.6  # a crop keeps at least this fraction of each side
_SLIC_COMPACTNESS = 10.0
_MIN_REGION_PX = 6  # smaller regions (at working resolution) are dropped
_IOU_RANGE = (0.75, 1.0)
_STABILITY_RANGE = (0.8, 1.0)

# Segmentation scales, coarse to fine.  They are computed lazily, in order,
# until they hold at least as many regions as an image asks for (and always at
# least ``_MIN_LEVELS`` of them, so masks overlap across scales).
_LEVELS: tuple[tuple[str, int], ...] = (
    ("slic", 12),
    ("slic", 40),
    ("felzenszwalb", 400),
    ("slic", 120),
    ("slic", 300),
    ("slic", 800),
    ("slic", 2000),
    ("slic", 5000),
)
_MIN_LEVELS = 2


class Job(NamedTuple):
    """What to render: one image of a seed, its size and its range of mask counts."""

    seed: int
    image_id: int
    height: int
    width: int
    masks_lo: int
    masks_hi: int


class Rendered(NamedTuple):
    """One rendered image: its JPEG bytes and its annotations."""

    image_id: int
    height: int
    width: int
    jpeg: bytes
    annotations: list[dict[str, Any]]  # SA-1B annotations without "id"


def photo_paths() -> list[pathlib.Path]:
    """Return the paths of the bundled photographs used, in cycling order.

    Raises :class:`FileNotFoundError` if the scikit-image installation lacks
    one of them (they are part of every scikit-image wheel).
    """
    root = pathlib.Path(skimage.data.__file__).resolve().parent
    paths = [root / name for name in PHOTOS]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"bundled scikit-image sample photos missing: {missing}")
    return paths


@functools.lru_cache(maxsize=None)
def _photo(index: int) -> Image.Image:
    """Load (once per process) photo ``index`` of :data:`PHOTOS` as RGB."""
    with Image.open(photo_paths()[index]) as img:
        return img.convert("RGB")


def image_size(size: tuple[int, int], image_id: int) -> tuple[int, int]:
    """(height, width) of ``image_id``: every third image is portrait."""
    height, width = size
    if image_id % 3 == 0:
        return width, height
    return height, width


def _crop_box(
    rng: np.random.Generator, photo_w: int, photo_h: int, out_w: int, out_h: int
) -> tuple[int, int, int, int]:
    """Random crop keeping >= 60% of each side, close to the output aspect."""
    frac_h = rng.uniform(_MIN_CROP, 1.0)
    frac_w = frac_h * photo_h * (out_w / out_h) / photo_w
    frac_w = float(np.clip(frac_w, _MIN_CROP, 1.0))
    # If the width hit a bound, give the height a chance to follow the aspect.
    frac_h = float(np.clip(frac_w * photo_w * (out_h / out_w) / photo_h, _MIN_CROP, 1.0))
    crop_w = max(1, round(frac_w * photo_w))
    crop_h = max(1, round(frac_h * photo_h))
    left = int(rng.integers(0, photo_w - crop_w + 1))
    top = int(rng.integers(0, photo_h - crop_h + 1))
    return left, top, left + crop_w, top + crop_h


def _segment(work: np.ndarray, lab: np.ndarray, kind: str, param: int) -> np.ndarray:
    """Label map (consecutive labels from 0) of the working image.

    ``work`` is the RGB uint8 working image, ``lab`` its smoothed CIELAB
    version (computed once per image and shared by the SLIC scales; this is
    what ``slic(work, sigma=1)`` would compute internally on every call).
    """
    h, w = work.shape[:2]
    if kind == "slic":
        # slic() rescales its input to [0, 1]; scale the compactness alike so
        # that it keeps its usual meaning for CIELAB input.
        span = float(lab.max() - lab.min()) or 1.0
        labels = skimage.segmentation.slic(
            lab,
            n_segments=param,
            compactness=_SLIC_COMPACTNESS / span,
            sigma=0,
            convert2lab=False,
            start_label=0,
            channel_axis=-1,
        )
    else:
        min_size = max(8, (h * w) // 400)
        labels = skimage.segmentation.felzenszwalb(
            work, scale=float(param), sigma=0.8, min_size=min_size, channel_axis=-1
        )
    _, consecutive = np.unique(labels, return_inverse=True)
    if consecutive.max(initial=0) >= np.iinfo(np.uint16).max:
        raise RuntimeError("too many segments for a uint16 label map")
    return consecutive.reshape(h, w).astype(np.uint16)


class _Region(NamedTuple):
    level: int
    label: int
    pixels: np.ndarray  # flat indices into the working image
    rows: tuple[int, int]  # inclusive min/max row at working resolution
    cols: tuple[int, int]


def _regions(labels: np.ndarray, level: int, seen: set[bytes]) -> list[_Region]:
    """The regions of one label map, without tiny ones and repeats.

    Regions under ``_MIN_REGION_PX`` pixels (fewer for tiny images) are
    dropped, as are regions identical to one in ``seen`` (the coarser levels),
    which is updated.
    """
    h, w = labels.shape
    min_px = max(1, min(_MIN_REGION_PX, (h * w) // 100))
    flat = labels.ravel()
    order = np.argsort(flat, kind="stable")  # pixel indices ascending within a label
    counts = np.bincount(flat.astype(np.intp))
    bounds = np.concatenate(([0], np.cumsum(counts)))
    out = []
    for label in range(counts.size):
        if counts[label] < min_px:
            continue
        pix = order[bounds[label] : bounds[label + 1]]
        key = pix.tobytes()
        if key in seen:
            continue
        seen.add(key)
        r, c = np.divmod(pix, w)
        out.append(_Region(level, label, pix, (int(r.min()), int(r.max())), (int(c.min()), int(c.max()))))
    return out


def _choose(rng: np.random.Generator, levels: list[list[_Region]], n: int) -> list[_Region]:
    """Pick ``n`` regions spread over the levels (coarse to fine), so masks overlap.

    Each level gets an equal share of ``n``; a level with fewer regions than
    its share gives all of them and passes the rest on to the finer levels.
    Within a level the regions are sampled without replacement.
    """
    chosen: list[_Region] = []
    for i, regions in enumerate(levels):
        room = n - len(chosen)
        if room <= 0:
            break
        later = sum(map(len, levels[i + 1 :]))
        share = max(room - later, -(-room // (len(levels) - i)))  # ceil division
        if len(regions) <= share:
            chosen.extend(regions)
        else:
            picks = np.sort(rng.choice(len(regions), size=share, replace=False))
            chosen.extend(regions[int(j)] for j in picks)
    return chosen


def _nearest_index(out_len: int, in_len: int) -> np.ndarray:
    """Source index of each output pixel for nearest (pixel-centre) upsampling."""
    return ((2 * np.arange(out_len, dtype=np.int64) + 1) * in_len) // (2 * out_len)


def render(job: Job) -> Rendered:
    """Produce the JPEG bytes and the annotations of one image."""
    seq = np.random.SeedSequence([job.seed, job.image_id])
    rng_count, rng_crop, rng_pick, rng_ann = (np.random.default_rng(s) for s in seq.spawn(4))
    n_masks = int(rng_count.integers(job.masks_lo, job.masks_hi + 1))
    src = _cropped_photo(job, rng_crop)
    jpeg = _jpeg(src.resize((job.width, job.height), Image.Resampling.BICUBIC))
    segments = _segmentation(src, job.height, job.width, n_masks)
    chosen = _choose(rng_pick, segments.levels, n_masks)
    if len(chosen) < n_masks:
        logger.warning("image %d: only %d regions for %d requested masks", job.image_id, len(chosen), n_masks)
    return Rendered(job.image_id, job.height, job.width, jpeg, _annotations(segments, chosen, rng_ann))


def _cropped_photo(job: Job, rng: np.random.Generator) -> Image.Image:
    """A random crop of the job's bundled photo, flipped horizontally half of the time."""
    photo = _photo((job.image_id - 1 + job.seed) % len(PHOTOS))
    src = photo.crop(_crop_box(rng, photo.width, photo.height, job.width, job.height))
    if rng.random() < 0.5:
        src = src.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return src


def _jpeg(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=_JPEG_QUALITY)
    return buf.getvalue()


class _Segments(NamedTuple):
    """The segmentations of one image at a working resolution, and their regions per level."""

    height: int  # full resolution
    width: int
    work_height: int
    work_width: int
    label_maps: list[np.ndarray]
    levels: list[list[_Region]]


def _segmentation(src: Image.Image, height: int, width: int, n_masks: int) -> _Segments:
    """Segment the crop at a working resolution, coarse to fine, until the levels hold ``n_masks`` regions."""
    scale = min(1.0, _WORK_LONG_SIDE / max(height, width))
    wh, ww = max(1, round(height * scale)), max(1, round(width * scale))
    work = np.asarray(src.resize((ww, wh), Image.Resampling.BILINEAR, reducing_gap=2.0))
    lab = skimage.filters.gaussian(skimage.color.rgb2lab(work), sigma=1.0, mode="reflect", channel_axis=-1)
    label_maps: list[np.ndarray] = []
    seen: set[bytes] = set()
    levels: list[list[_Region]] = []
    for kind, param in _LEVELS:
        if len(levels) >= _MIN_LEVELS and sum(map(len, levels)) >= n_masks:
            break
        label_maps.append(_segment(work, lab, kind, param))
        levels.append(_regions(label_maps[-1], len(label_maps) - 1, seen))
    return _Segments(height, width, wh, ww, label_maps, levels)


def _annotations(segments: _Segments, chosen: list[_Region], rng: np.random.Generator) -> list[dict[str, Any]]:
    """The SA-1B annotations (without "id") of the chosen regions: full-resolution masks, encoded in chunks."""
    height, width = segments.height, segments.width
    row_src = _nearest_index(height, segments.work_height)  # full row -> working row (non-decreasing)
    col_src = _nearest_index(width, segments.work_width)
    # Full-resolution label maps, stored transposed (W, H) so that a stack of
    # masks (k, W, H) in C order is an (H, W, k) Fortran array once transposed.
    full_t = {
        lv: np.ascontiguousarray(segments.label_maps[lv].T[col_src][:, row_src])
        for lv in sorted({r.level for r in chosen})
    }
    annotations: list[dict[str, Any]] = []
    stack = np.zeros((_CHUNK, width, height), dtype=np.uint8)
    spans: list[tuple[int, int, int, int]] = []  # boxes written in the last chunk
    for start in range(0, len(chosen), _CHUNK):
        part = chosen[start : start + _CHUNK]
        masks = stack[: len(part)]
        for i, (r0, r1, c0, c1) in enumerate(spans):  # re-zero only what was written
            stack[i, c0:c1, r0:r1] = 0
        spans = [_draw_mask(masks[i], full_t[reg.level], reg, row_src, col_src) for i, reg in enumerate(part)]
        rles = mask_utils.encode(masks.transpose(2, 1, 0))
        areas = mask_utils.area(rles)
        bboxes = mask_utils.toBbox(rles)
        for i, reg in enumerate(part):
            if int(areas[i]) == 0:  # cannot happen with nearest upsampling; be safe
                continue
            x, y = _point_in(reg, segments.work_width, row_src, col_src, rng)
            annotations.append(
                {
                    "segmentation": {"size": [height, width], "counts": rles[i]["counts"].decode("ascii")},
                    "bbox": [float(v) for v in bboxes[i]],
                    "area": int(areas[i]),
                    "predicted_iou": float(rng.uniform(*_IOU_RANGE)),
                    "stability_score": float(rng.uniform(*_STABILITY_RANGE)),
                    "point_coords": [[float(x), float(y)]],
                    "crop_box": [0.0, 0.0, float(width), float(height)],
                }
            )
    return annotations


def _draw_mask(
    mask: np.ndarray, full_t: np.ndarray, reg: _Region, row_src: np.ndarray, col_src: np.ndarray
) -> tuple[int, int, int, int]:
    """Set the region's pixels in ``mask`` (W, H, zero) within its box; return the box (rows, then columns)."""
    r0 = int(np.searchsorted(row_src, reg.rows[0], "left"))
    r1 = int(np.searchsorted(row_src, reg.rows[1], "right"))
    c0 = int(np.searchsorted(col_src, reg.cols[0], "left"))
    c1 = int(np.searchsorted(col_src, reg.cols[1], "right"))
    np.equal(full_t[c0:c1, r0:r1], reg.label, out=mask[c0:c1, r0:r1].view(bool))
    return r0, r1, c0, c1


def _point_in(
    reg: _Region, work_width: int, row_src: np.ndarray, col_src: np.ndarray, rng: np.random.Generator
) -> tuple[int, int]:
    """(x, y) of a pixel inside the mask: a random working pixel of the region,
    then a random full-resolution pixel among those mapping to it."""
    wr, wc = divmod(int(reg.pixels[rng.integers(reg.pixels.size)]), work_width)
    y = int(rng.integers(np.searchsorted(row_src, wr, "left"), np.searchsorted(row_src, wr, "right")))
    x = int(rng.integers(np.searchsorted(col_src, wc, "left"), np.searchsorted(col_src, wc, "right")))
    return x, y
