"""Build small SA-1B-shaped datasets from real photographs, fully offline.

The images are random crops (with random horizontal flips) of the sample
photographs bundled inside the scikit-image wheel (``skimage/data/*.png|jpg``;
nothing is downloaded).  The masks come from a real segmentation of each crop:
SLIC superpixels at several scales plus one Felzenszwalb segmentation, so that,
as in SA-1B, masks overlap (whole objects and their parts).  Every mask is
encoded as COCO compressed RLE with :mod:`pycocotools` and stored in Meta's
SA-1B JSON schema::

    {"image": {"image_id": 1, "width": W, "height": H, "file_name": "sa_1.jpg"},
     "annotations": [{"id": 1,
                      "segmentation": {"size": [H, W], "counts": "<RLE>"},
                      "bbox": [x, y, w, h], "area": 1234,
                      "predicted_iou": 0.93, "stability_score": 0.97,
                      "point_coords": [[x, y]],
                      "crop_box": [0.0, 0.0, W, H]}, ...]}

Two layouts are supported: ``"tar"`` (SA-1B's: plain tar archives
``sa_000000.tar``, ``sa_000001.tar``, ... holding ``sa_<id>.jpg`` followed by
``sa_<id>.json`` for each image, in increasing id order) and ``"folder"`` (the
same files written flat into the output folder).

Output is byte-for-byte deterministic for a given seed and arguments,
regardless of the number of worker processes.

Command line::

    python -m shard_tools.sample_data OUT [--images N] [--height H] [--width W]
        [--layout tar|folder] [--seed S] [--workers K]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import io
import json
import logging
import multiprocessing
import os
import pathlib
import tarfile
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import pycocotools.mask as mask_utils
import skimage.color
import skimage.data
import skimage.filters
import skimage.segmentation
from PIL import Image

__all__ = ["PHOTOS", "photo_paths", "write_sa1b", "main"]

logger = logging.getLogger(__name__)

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


class _Job(NamedTuple):
    seed: int
    image_id: int
    height: int
    width: int
    masks_lo: int
    masks_hi: int


class _Rendered(NamedTuple):
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


def _image_size(size: tuple[int, int], image_id: int) -> tuple[int, int]:
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


def _render(job: _Job) -> _Rendered:
    """Produce the JPEG bytes and the annotations of one image."""
    seq = np.random.SeedSequence([job.seed, job.image_id])
    rng_count, rng_crop, rng_pick, rng_ann = (np.random.default_rng(s) for s in seq.spawn(4))
    height, width = job.height, job.width
    n_masks = int(rng_count.integers(job.masks_lo, job.masks_hi + 1))

    # -- image: crop + flip + resize of a bundled photo ------------------------
    photo = _photo((job.image_id - 1 + job.seed) % len(PHOTOS))
    box = _crop_box(rng_crop, photo.width, photo.height, width, height)
    src = photo.crop(box)
    if rng_crop.random() < 0.5:
        src = src.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    full = src.resize((width, height), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    full.save(buf, format="JPEG", quality=_JPEG_QUALITY)
    jpeg = buf.getvalue()

    # -- segmentation at a working resolution -----------------------------------
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
    chosen = _choose(rng_pick, levels, n_masks)
    if len(chosen) < n_masks:
        logger.warning("image %d: only %d regions for %d requested masks", job.image_id, len(chosen), n_masks)

    # -- full-resolution masks, encoded in chunks --------------------------------
    row_src = _nearest_index(height, wh)  # full row -> working row (non-decreasing)
    col_src = _nearest_index(width, ww)
    # Full-resolution label maps, stored transposed (W, H) so that a stack of
    # masks (k, W, H) in C order is an (H, W, k) Fortran array once transposed.
    full_t = {
        lv: np.ascontiguousarray(label_maps[lv].T[col_src][:, row_src])
        for lv in sorted({r.level for r in chosen})
    }
    annotations: list[dict[str, Any]] = []
    stack = np.zeros((_CHUNK, width, height), dtype=np.uint8)
    spans: list[tuple[int, int, int, int]] = []  # boxes written in the last chunk
    for start in range(0, len(chosen), _CHUNK):
        part = chosen[start : start + _CHUNK]
        k = len(part)
        masks = stack[:k]
        for i, (r0, r1, c0, c1) in enumerate(spans):  # re-zero only what was written
            stack[i, c0:c1, r0:r1] = 0
        spans = []
        for i, reg in enumerate(part):
            r0 = int(np.searchsorted(row_src, reg.rows[0], "left"))
            r1 = int(np.searchsorted(row_src, reg.rows[1], "right"))
            c0 = int(np.searchsorted(col_src, reg.cols[0], "left"))
            c1 = int(np.searchsorted(col_src, reg.cols[1], "right"))
            np.equal(full_t[reg.level][c0:c1, r0:r1], reg.label, out=masks[i, c0:c1, r0:r1].view(bool))
            spans.append((r0, r1, c0, c1))
        rles = mask_utils.encode(masks.transpose(2, 1, 0))
        areas = mask_utils.area(rles)
        bboxes = mask_utils.toBbox(rles)
        for i, reg in enumerate(part):
            if int(areas[i]) == 0:  # cannot happen with nearest upsampling; be safe
                continue
            # A pixel inside the mask: a random working pixel of the region,
            # then a random full-resolution pixel among those mapping to it.
            wr, wc = divmod(int(reg.pixels[rng_ann.integers(reg.pixels.size)]), ww)
            y = int(rng_ann.integers(np.searchsorted(row_src, wr, "left"), np.searchsorted(row_src, wr, "right")))
            x = int(rng_ann.integers(np.searchsorted(col_src, wc, "left"), np.searchsorted(col_src, wc, "right")))
            annotations.append(
                {
                    "segmentation": {"size": [height, width], "counts": rles[i]["counts"].decode("ascii")},
                    "bbox": [float(v) for v in bboxes[i]],
                    "area": int(areas[i]),
                    "predicted_iou": float(rng_ann.uniform(*_IOU_RANGE)),
                    "stability_score": float(rng_ann.uniform(*_STABILITY_RANGE)),
                    "point_coords": [[float(x), float(y)]],
                    "crop_box": [0.0, 0.0, float(width), float(height)],
                }
            )
    return _Rendered(job.image_id, height, width, jpeg, annotations)


def _rendered(jobs: Sequence[_Job], workers: int) -> Iterator[_Rendered]:
    """Render jobs in order, in this process or in a spawn-based pool."""
    if workers <= 1 or len(jobs) <= 1:
        yield from map(_render, jobs)
        return
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        yield from pool.map(_render, jobs)


def _json_bytes(item: _Rendered, first_id: int) -> bytes:
    """SA-1B JSON of one image, annotation ids numbered from ``first_id``."""
    anns = [
        {
            "id": first_id + i,
            "segmentation": a["segmentation"],
            "bbox": a["bbox"],
            "area": a["area"],
            "predicted_iou": a["predicted_iou"],
            "stability_score": a["stability_score"],
            "point_coords": a["point_coords"],
            "crop_box": a["crop_box"],
        }
        for i, a in enumerate(item.annotations)
    ]
    doc = {
        "image": {
            "image_id": item.image_id,
            "width": item.width,
            "height": item.height,
            "file_name": f"sa_{item.image_id}.jpg",
        },
        "annotations": anns,
    }
    return json.dumps(doc, separators=(",", ":")).encode("ascii")


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    tar.addfile(info, io.BytesIO(data))


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_sa1b(
    out_dir: str | os.PathLike[str],
    *,
    images: int = 16,
    size: tuple[int, int] = (600, 900),
    masks: tuple[int, int] = (60, 140),
    images_per_archive: int = 8,
    seed: int = 0,
    layout: str = "tar",
    workers: int = 1,
) -> list[pathlib.Path]:
    """Write a small SA-1B-shaped dataset of real photographs and masks.

    Args:
        out_dir: Output folder (created if missing).  Files of the same names
            are overwritten; other files are left alone.
        images: Number of images; their ids are 1, 2, ..., ``images``.
        size: ``(height, width)`` of each image.  Every third image (ids 3, 6,
            ...) is portrait: its height and width are swapped.
        masks: Inclusive ``(low, high)`` range of the number of masks per
            image; each image draws its count from the seed.
        images_per_archive: Images per tar archive (``layout="tar"`` only).
        seed: Non-negative seed; output is byte-identical for equal arguments.
        layout: ``"tar"``: archives ``sa_000000.tar``, ... each holding
            ``sa_<id>.jpg`` then ``sa_<id>.json`` per image in id order.
            ``"folder"``: the same ``.jpg``/``.json`` files written flat.
        workers: Worker processes (spawn-based pool); 0 means
            ``os.cpu_count()``.  The output does not depend on it.  As with
            any spawn pool, a calling script needs the
            ``if __name__ == "__main__":`` guard when ``workers > 1``.

    Returns:
        The written archives (``"tar"``) or files (``"folder"``), in
        ``sorted()`` order.
    """
    height, width = (int(v) for v in size)
    lo, hi = (int(v) for v in masks)
    if images < 0:
        raise ValueError(f"images must be >= 0, got {images}")
    if height < 1 or width < 1:
        raise ValueError(f"size must be positive, got {size}")
    if not 1 <= lo <= hi:
        raise ValueError(f"masks must satisfy 1 <= low <= high, got {masks}")
    if images_per_archive < 1:
        raise ValueError(f"images_per_archive must be >= 1, got {images_per_archive}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if layout not in ("tar", "folder"):
        raise ValueError(f"layout must be 'tar' or 'folder', got {layout!r}")
    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    workers = workers or os.cpu_count() or 1
    photo_paths()  # fail early if the photos are missing

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [_Job(int(seed), i, *_image_size((height, width), i), lo, hi) for i in range(1, images + 1)]
    written: list[pathlib.Path] = []
    next_ann_id = 1
    tar: tarfile.TarFile | None = None
    tar_path = out / "sa_000000.tar"
    tar_tmp = tar_path.with_name(tar_path.name + ".tmp")

    def finish_archive() -> None:
        assert tar is not None
        tar.close()
        os.replace(tar_tmp, tar_path)
        written.append(tar_path)
        logger.debug("wrote %s", tar_path)

    try:
        for n, item in enumerate(_rendered(jobs, workers)):
            payload = _json_bytes(item, next_ann_id)
            next_ann_id += len(item.annotations)
            stem = f"sa_{item.image_id}"
            if layout == "folder":
                for name, data in ((f"{stem}.jpg", item.jpeg), (f"{stem}.json", payload)):
                    _write_atomic(out / name, data)
                    written.append(out / name)
                continue
            if n % images_per_archive == 0:
                if tar is not None:
                    finish_archive()
                    tar = None
                tar_path = out / f"sa_{n // images_per_archive:06d}.tar"
                tar_tmp = tar_path.with_name(tar_path.name + ".tmp")
                tar = tarfile.open(tar_tmp, "w", format=tarfile.USTAR_FORMAT)
            _add_member(tar, f"{stem}.jpg", item.jpeg)
            _add_member(tar, f"{stem}.json", payload)
        if tar is not None:
            finish_archive()
            tar = None
    finally:
        if tar is not None:  # an error interrupted an archive: drop it
            tar.close()
            tar_tmp.unlink(missing_ok=True)
    return sorted(written)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m shard_tools.sample_data",
        description="Write an SA-1B-shaped dataset from scikit-image's bundled photos.",
    )
    parser.add_argument("out", help="output folder")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--height", type=int, default=600)
    parser.add_argument("--width", type=int, default=900)
    parser.add_argument("--masks-min", type=int, default=60)
    parser.add_argument("--masks-max", type=int, default=140)
    parser.add_argument("--images-per-archive", type=int, default=8)
    parser.add_argument("--layout", choices=("tar", "folder"), default="tar")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1, help="worker processes (0: all CPUs)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        paths = write_sa1b(
            args.out,
            images=args.images,
            size=(args.height, args.width),
            masks=(args.masks_min, args.masks_max),
            images_per_archive=args.images_per_archive,
            seed=args.seed,
            layout=args.layout,
            workers=args.workers,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {len(paths)} {args.layout} file(s) with {args.images} image(s) to {args.out} "
          f"in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
