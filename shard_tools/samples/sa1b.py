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

    python -m shard_tools.samples.sa1b OUT [--images N] [--height H] [--width W]
        [--layout tar|folder] [--seed S] [--workers K]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import logging
import multiprocessing
import os
import pathlib
import tarfile
import time
from collections.abc import Iterable, Iterator, Sequence

from pipeline.errors import ConfigError
from shard_tools.samples.photos import PHOTOS, Job, Rendered, image_size, photo_paths, render

__all__ = ["PHOTOS", "photo_paths", "write_sa1b", "main"]

logger = logging.getLogger(__name__)


def _rendered(jobs: Sequence[Job], workers: int) -> Iterator[Rendered]:
    """Render jobs in order, in this process or in a spawn-based pool."""
    if workers <= 1 or len(jobs) <= 1:
        yield from map(render, jobs)
        return
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        yield from pool.map(render, jobs)


def _json_bytes(item: Rendered, first_id: int) -> bytes:
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
    _check_arguments(images, size, masks, images_per_archive, seed, layout, workers)
    workers = workers or os.cpu_count() or 1
    photo_paths()  # fail early if the photos are missing

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [Job(int(seed), i, *image_size((height, width), i), lo, hi) for i in range(1, images + 1)]
    files = _files(_rendered(jobs, workers))
    if layout == "folder":
        return sorted(_write_folder(out, files))
    return sorted(_write_archives(out, files, images_per_archive))


def _check_arguments(images: int, size: tuple[int, int], masks: tuple[int, int], images_per_archive: int,
                     seed: int, layout: str, workers: int) -> None:
    height, width = (int(v) for v in size)
    lo, hi = (int(v) for v in masks)
    if images < 0:
        raise ConfigError(f"images must be >= 0, got {images}")
    if height < 1 or width < 1:
        raise ConfigError(f"size must be positive, got {size}")
    if not 1 <= lo <= hi:
        raise ConfigError(f"masks must satisfy 1 <= low <= high, got {masks}")
    if images_per_archive < 1:
        raise ConfigError(f"images_per_archive must be >= 1, got {images_per_archive}")
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}")
    if layout not in ("tar", "folder"):
        raise ConfigError(f"layout must be 'tar' or 'folder', got {layout!r}")
    if workers < 0:
        raise ConfigError(f"workers must be >= 0, got {workers}")


def _files(items: Iterable[Rendered]) -> Iterator[tuple[tuple[str, bytes], tuple[str, bytes]]]:
    """The ``sa_<id>.jpg`` and ``sa_<id>.json`` (name, bytes) of each image, annotation ids numbered from 1."""
    next_ann_id = 1
    for item in items:
        payload = _json_bytes(item, next_ann_id)
        next_ann_id += len(item.annotations)
        stem = f"sa_{item.image_id}"
        yield (f"{stem}.jpg", item.jpeg), (f"{stem}.json", payload)


def _write_folder(out: pathlib.Path, files: Iterable[tuple[tuple[str, bytes], ...]]) -> list[pathlib.Path]:
    written = []
    for pair in files:
        for name, data in pair:
            _write_atomic(out / name, data)
            written.append(out / name)
    return written


def _write_archives(out: pathlib.Path, files: Iterable[tuple[tuple[str, bytes], ...]],
                    images_per_archive: int) -> list[pathlib.Path]:
    """Archives ``sa_000000.tar``, ... of ``images_per_archive`` images each; an archive an error
    interrupts is dropped."""
    written: list[pathlib.Path] = []
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
        for n, pair in enumerate(files):
            if n % images_per_archive == 0:
                if tar is not None:
                    finish_archive()
                    tar = None
                tar_path = out / f"sa_{n // images_per_archive:06d}.tar"
                tar_tmp = tar_path.with_name(tar_path.name + ".tmp")
                tar = tarfile.open(tar_tmp, "w", format=tarfile.USTAR_FORMAT)
            for name, data in pair:
                _add_member(tar, name, data)
        if tar is not None:
            finish_archive()
            tar = None
    finally:
        if tar is not None:  # an error interrupted an archive: drop it
            tar.close()
            tar_tmp.unlink(missing_ok=True)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m shard_tools.samples.sa1b",
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
