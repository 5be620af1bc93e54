"""SA-1B on the packing side: list `sa_<id>.jpg` + `sa_<id>.json` pairs in archives and folders,
check each pair, and encode it as the sample members of `pipeline.format` (JPEG + msgpack record).
`PACKING` declares the kind to `shard_tools.kinds`: its subcommand (`shard-pack sa1b`), its pairs
found in archives indexed in place (`shard-pack index sa1b`), its preview (masks and boxes over the
image) and its loader options as flags.

With `image_max_side`, larger JPEGs are re-encoded to that long side; the annotations keep the
original geometry and RLE, and the loader maps both into the same frame (see `pipeline.kinds.sa1b`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import io
import logging
import posixpath
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from pipeline.errors import ConfigError, InputError, SampleError, ShardError
from pipeline.format import SA1B_ANN, SA1B_JPG, SA1B_JSON, check_key, pack_record, parse_json
from pipeline.rle import fit, nearest_index
from pipeline.kinds.sa1b import annotation_record
from pipeline.kinds.sa1b_augment import RESIZE_MODES
from pipeline.kinds.sa1b_prompts import BOX_NOISE_MODES
from pipeline.storage import filesystem
from pipeline.tario import BLOCK, ArchiveMember
import shard_tools.flags as flags
from shard_tools.drawing import ALPHA, Drawing, Tiles, mask_colours, picture, tiled, wrap
from shard_tools.flags import Subparsers, int_or_none
from shard_tools.images import load_whole, resize_image
from shard_tools.pack import Part, SampleRef, pack, parse_splits
from shard_tools.plugin import KindOption, PackingKind
from shard_tools.scan import LIMITS, Indexing, Members, flat_members, skip

__all__ = ["PACKING", "Sa1bSource", "check_pair"]

log = logging.getLogger(__name__)
_ROLES = ("jpg", "json")


def _member_key(name: str) -> tuple[str, str]:
    key, _, ext = posixpath.basename(name).partition(".")
    return key, ext.lower()


@dataclasses.dataclass(frozen=True)
class Sa1bSource:
    """SA-1B as released (tar archives and/or folders of jpg/json pairs) -> shard samples."""

    image_max_side: int | None = None
    jpeg_quality: int = 90
    # fsspec's options for the input URLs (as `shard-pack --storage-options`): never in the manifest or fingerprint
    storage_options: dict[str, Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    kind: str = dataclasses.field(default="sa1b", init=False)

    def __post_init__(self) -> None:
        if self.image_max_side is not None and (not isinstance(self.image_max_side, int) or self.image_max_side < 16):
            raise ConfigError(f"image_max_side must be an int >= 16 or None, got {self.image_max_side!r}")
        if not 1 <= self.jpeg_quality <= 95:
            raise ConfigError(f"jpeg_quality must be in [1, 95], got {self.jpeg_quality!r}")

    def options(self) -> dict[str, Any]:
        quality = self.jpeg_quality if self.image_max_side else None  # (no re-encoding, no quality)
        return {"image_max_side": self.image_max_side, "jpeg_quality": quality}

    # -- listing ---------------------------------------------------------------------------------

    def index(self, sources: Sequence[str]) -> tuple[list[SampleRef], list[dict[str, str]]]:
        """All complete pairs sorted by key, and the inputs skipped (unpaired, duplicate, bad name);
        InputError, saying what was found, if there is no pair."""
        found: dict[str, dict[str, Part]] = {}
        skipped: list[dict[str, str]] = []
        ignored = 0
        for part_key, role, part in self._parts(sources):
            if role not in _ROLES:
                ignored += 1
                log.debug("ignoring %s: not a .jpg or .json", part.name)
                continue
            try:
                check_key(part_key)
            except ValueError as exc:
                skipped.append({"source": part.name, "key": part_key, "reason": f"{part.name}: {exc}"})
                continue
            entry = found.setdefault(part_key, {})
            if role in entry:
                reason = f"{part.name}: duplicate key {part_key!r} (first seen in {entry[role].name}); kept the first"
                skipped.append({"source": part.name, "key": part_key, "reason": reason})
                continue
            entry[role] = part
        if ignored:
            log.warning("ignored %d input files that are neither .jpg nor .json", ignored)
        refs = []
        for key in sorted(found):
            entry = found[key]
            if set(entry) != set(_ROLES):
                (role, part), = entry.items()
                missing = "JSON" if role == "jpg" else "image"
                reason = f"{part.name}: no {missing} for key {key!r}"
                skipped.append({"source": part.name, "key": key, "reason": reason})
                continue
            refs.append(SampleRef(key, tuple((role, entry[role]) for role in _ROLES)))
        if not refs:
            lone = collections.Counter(role for entry in found.values() if len(entry) == 1 for role in entry)
            seen = [f"{lone['jpg']} JPEGs without their JSON", f"{lone['json']} JSONs without their JPEG",
                    f"{len(skipped) - lone.total()} files with a bad name or a duplicate key", f"{ignored} other files"]
            raise InputError("no SA-1B samples (sa_<id>.jpg with its sa_<id>.json): found "
                             + (", ".join(s for s in seen if not s.startswith("0 ")) or "no files"),
                             url=", ".join(sources))
        return refs, skipped

    def _parts(self, sources: Sequence[str]):  # -> Iterator[tuple[str, str, Part]]
        for source in sources:
            fs, path = filesystem(source, self.storage_options)
            if fs.isdir(path):
                for file in sorted(fs.find(path)):
                    if file.endswith(".tar"):
                        yield from self._archive(fs, file, posixpath.basename(file))
                    else:
                        key, ext = _member_key(file)
                        yield key, ext, Part(fs.unstrip_protocol(file), 0, fs.size(file), posixpath.relpath(file, path))
            elif path.endswith(".tar") and fs.isfile(path):
                yield from self._archive(fs, path, posixpath.basename(path))
            else:
                raise FileNotFoundError(f"{source}: not an SA-1B .tar archive or a folder")

    @staticmethod
    def _archive(fs: Any, path: str, name: str):  # -> Iterator[tuple[str, str, Part]]
        url = fs.unstrip_protocol(path)
        members = 0
        try:
            with fs.open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as archive:
                for member in archive:
                    members += 1
                    if member.isfile():
                        key, ext = _member_key(member.name)
                        yield key, ext, Part(url, member.offset_data, member.size, f"{name}:{member.name}")
        except tarfile.TarError as exc:
            what = f"a damaged tar archive after {members} members" if members else "not a tar archive"
            raise InputError(f"{what} ({exc}); only uncompressed .tar archives are read", url=url) from exc

    # -- encoding --------------------------------------------------------------------------------

    def encode(self, ref: SampleRef) -> tuple[list[tuple[str, bytes]], dict[str, int]]:
        parts = dict(ref.parts)
        jpg, meta_bytes = (_read(parts[role], self.storage_options) for role in _ROLES)
        record, (height, width) = check_pair(jpg, meta_bytes, parts["jpg"].name, parts["json"].name, ref.key)
        stored = (height, width)
        if self.image_max_side and max(height, width) > self.image_max_side:
            stored = fit(height, width, self.image_max_side)
            jpg = resize_image(jpg, "JPEG", stored, self.jpeg_quality, rgb=True)  # (RGB: see resize_image)
        record["stored_size"] = list(stored)
        return [(SA1B_JPG, jpg), (SA1B_ANN, pack_record(record))], {"masks": len(record["counts"])}


def _read(part: Part, storage_options: dict[str, Any] | None) -> bytes:
    fs, path = filesystem(part.url, storage_options)
    return fs.cat_file(path, start=part.offset, end=part.offset + part.size)


def check_pair(jpg: bytes, meta: bytes, jpg_name: str, json_name: str,
               key: str) -> tuple[dict[str, Any], tuple[int, int]]:
    """(the stored record without `stored_size`, the image's (height, width)) of an SA-1B pair, checked
    whole: JSON within limits, annotations, RLE, a whole JPEG of the size the JSON states. Packing
    and `shard-pack index` both call it; the names are what errors name."""
    try:
        parsed = parse_json(meta)
    except ValueError as exc:
        raise SampleError(f"invalid JSON: {exc}"[:300], url=json_name, key=key, field="json") from exc
    record, height, width = annotation_record(parsed, json_name, key)
    return record, _check_jpeg(jpg, (height, width), jpg_name, key)


def _check_jpeg(data: bytes, size: tuple[int, int], where: str, key: str) -> tuple[int, int]:
    """The JPEG's (height, width) after checking it is a whole JPEG of the size the JSON states."""
    if not data.startswith(b"\xff\xd8"):
        raise SampleError("not a JPEG file", url=where, key=key, field="jpg")
    try:
        with Image.open(io.BytesIO(data), formats=["JPEG"]) as image:
            if (image.height, image.width) != size:
                raise SampleError(f"JPEG is {image.height}x{image.width}, the JSON says {size[0]}x{size[1]}",
                                  url=where, key=key, field="jpg")
            load_whole(image, jpeg=True)
    except (OSError, SyntaxError, ValueError) as exc:
        raise SampleError(f"truncated or corrupt JPEG: {exc}", url=where, key=key, field="jpg") from exc
    return size


# -- `shard-pack sa1b` ------------------------------------------------------------------------------

def _add(sub: Subparsers, name: str, dask: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, parents=[flags.quiet(), flags.shards("samples"), flags.fractions(),
                                      flags.images("re-encode larger JPEGs to this long side (masks stay exact)"),
                                      flags.workers(dask=dask), flags.storage()],
                       help="pack SA-1B (.tar archives and/or folders of sa_<id>.jpg + sa_<id>.json)")
    p.add_argument("sources", nargs="+", metavar="SRC", help="SA-1B .tar archives or folders")
    p.add_argument("out", metavar="OUT", help=flags.OUT)
    return p


def _run(args: argparse.Namespace) -> int:
    options = flags.pack_options(args, splits=parse_splits(args.split), max_skipped=args.max_skipped)
    source = Sa1bSource(image_max_side=args.image_max_side, jpeg_quality=args.jpeg_quality,
                        storage_options=args.storage_options)
    return flags.summary(pack(source, args.sources, args.out, options, progress=not args.quiet))


# -- `shard-pack index sa1b`: the pairs of archives as Meta ships them --------------------------------

def _samples(url: str, scanned: Iterator[ArchiveMember], skipped: list[dict[str, str]],
             counts: collections.Counter[str]) -> list[tuple[str, Members]]:
    """Each archive's jpg/json pairs, wherever in the archive either lies, checked as packing checks them."""
    pending: dict[str, dict[str, ArchiveMember]] = {}  # the member whose partner has not come yet
    held, done, samples = 0, set(), []
    for member, key, ext in flat_members(url, scanned, skipped, counts):
        if ext not in (SA1B_JPG, SA1B_JSON):
            counts["ignored"] += 1
            continue
        try:
            check_key(key)
        except ValueError as exc:
            skipped.append(skip(url, member.name, key, str(exc)))
            continue
        entry = pending.setdefault(key, {}) if key not in done else {}
        if key in done or ext in entry:
            skipped.append(skip(url, member.name, key, f"duplicate key {key!r} in this archive; kept the first"))
            continue
        entry[ext] = member
        held += member.size
        if held > LIMITS.max_sample_bytes:
            raise ShardError(f"more than {LIMITS.max_sample_bytes} bytes of members wait for their pair at "
                             f"{member.name!r}: the archive's samples are not kept together", url=url)
        if len(entry) == 2:
            del pending[key]
            done.add(key)
            held -= sum(m.size for m in entry.values())
            sample = _pair(url, key, entry, skipped)
            if sample is not None:
                samples.append(sample)
                counts["masks"] += sample[2]
    for key, entry in pending.items():
        (ext, member), = entry.items()
        missing = "JSON" if ext == SA1B_JPG else "image"
        skipped.append(skip(url, member.name, key, f"no {missing} for key {key!r} in this archive"))
    return [(key, members) for key, members, _ in sorted(samples, key=lambda s: s[1][0][1])]


def _pair(url: str, key: str, entry: dict[str, ArchiveMember],
          skipped: list[dict[str, str]]) -> tuple[str, Members, int] | None:
    """(key, members, masks) of a pair that packing would accept, else None (the reason skipped)."""
    jpg, meta = entry[SA1B_JPG], entry[SA1B_JSON]
    members = sorted([(ext, m.offset, m.size) for ext, m in entry.items()], key=lambda m: m[1])
    end = members[-1][1] + BLOCK + members[-1][2]
    if end - members[0][1] > LIMITS.max_sample_bytes:
        skipped.append(skip(url, meta.name, key, f"the pair lies {end - members[0][1]} bytes apart, more than "
                            f"max_sample_bytes={LIMITS.max_sample_bytes}"))
        return None
    assert jpg.data is not None and meta.data is not None
    try:
        record, _ = check_pair(jpg.data, meta.data, f"{url}:{jpg.name}", f"{url}:{meta.name}", key)
    except SampleError as exc:
        skipped.append({"source": exc.url, "key": key, "reason": str(exc)})
        return None
    return key, members, len(record["counts"])


def _wanted(name: str) -> bool:
    return name.endswith((f".{SA1B_JPG}", f".{SA1B_JSON}"))


# -- `shard-pack preview`: masks, boxes and prompts over the image ---------------------------------

def _mask_frame(batch: dict[str, Any], i: int) -> tuple[int, int]:
    """The part of sample i's mask canvas that covers its image: the mask frame (`fit`) where the image
    has its own frame; else (`resize="square"`, `scale_jitter`) the mask pixels whose centres lie in it."""
    s, m = batch["images"].shape[-1], batch["masks"].shape[-1]
    original, content = batch["original_sizes"][i].tolist(), tuple(batch["image_sizes"][i].tolist())
    if content == fit(*original, s):
        return fit(*original, m)
    return min(m, -(-(2 * content[0] * m - s) // (2 * s))), min(m, -(-(2 * content[1] * m - s) // (2 * s)))


def _tiles(batch: dict[str, Any], tile: int) -> Tiles:
    """Each image cut to its frame, its masks scaled from the mask frame into it by the loader's own
    nearest rule, each in its own colour (smaller over larger) at `ALPHA`, each mask's box, and the
    prompts where the batch has them: prompt boxes dotted, points as dots ringed in white."""
    tiles = []
    for i in range(len(batch["keys"])):
        shown = picture(batch["images"][i], batch["image_sizes"][i], tile)
        (h, w), (tw, th) = batch["image_sizes"][i].tolist(), shown.size
        mh, mw = _mask_frame(batch, i)
        rows, cols = nearest_index(mh, th), nearest_index(mw, tw)
        count = int(batch["mask_counts"][i])
        colours = mask_colours(count)
        paint, covered = np.zeros((th, tw, 3), np.float32), np.zeros((th, tw), bool)
        for j in np.argsort(-batch["areas"][i, :count].cpu().numpy(), kind="stable"):  # smaller masks on top
            inside = batch["masks"][i, j, :mh, :mw].cpu().numpy()[rows][:, cols]
            paint[inside], covered = colours[j], covered | inside
        pixels = np.asarray(shown, dtype=np.float32).copy()
        pixels[covered] = (1 - ALPHA) * pixels[covered] + ALPHA * paint[covered]
        shown = Image.fromarray(pixels.round().astype(np.uint8))
        draw, scale = ImageDraw.Draw(shown), np.array([tw / w, th / h, tw / w, th / h])
        for j, corners in enumerate(batch["boxes"][i, :count].cpu().numpy() * scale):
            draw.rectangle(_box(corners), outline=colours[j])
        for j, corners in enumerate(batch["prompt_boxes"][i, :count].cpu().numpy() * scale
                                    if "prompt_boxes" in batch else ()):
            x0, y0, x1, y1 = _box(corners)
            dots = [(x, y) for x in range(x0, x1 + 1, 3) for y in (y0, y1)] + \
                [(x, y) for y in range(y0, y1 + 1, 3) for x in (x0, x1)]
            draw.point(dots, fill=colours[j])
        for j, points in enumerate(batch["point_coords"][i, :count].cpu().numpy() * scale[:2]
                                   if "point_coords" in batch else ()):
            for x, y in points:
                draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=colours[j], outline=(255, 255, 255))
        size = "x".join(map(str, batch["original_sizes"][i].tolist()))
        tiles.append((shown, wrap(str(batch["keys"][i]), tile, 1) + [f"{count} masks, original {size}"]))
    return tiles


def _box(corners: np.ndarray) -> list[int]:
    """A box's corners (XYXY, tile pixels) as the pixels its outline is drawn on."""
    x0, y0, x1, y1 = (round(v) for v in corners.tolist())
    return [x0, y0, max(x0, x1 - 1), max(y0, y1 - 1)]


PACKING = PackingKind(
    add=_add, run=_run, key_number=(r"^sa_(\d+)$", 10),  # (sa_<image_id>)
    index=Indexing(_samples, _wanted, help="SA-1B .tar archives (sa_<id>.jpg + sa_<id>.json), every pair checked as "
                   "packing does", what="SA-1B as Meta ships it"),
    preview=Drawing(tiled(_tiles), shows="SA-1B: masks and boxes over the image"),
    options=(KindOption("--image-size", "SA-1B", int_or_none),
             KindOption("--mask-size", "SA-1B (none = the image frame)", int_or_none),
             KindOption("--max-masks", "SA-1B", int),
             *(KindOption(f"--{name}", f"SA-1B: {what}", float) for name, what in (
                 ("max-mask-area", "masks over this fraction of the image never chosen"),
                 ("min-predicted-iou", "masks below it never chosen"),
                 ("min-stability-score", "masks below it never chosen"),
                 ("box-noise", "prompt boxes with noise of this std x side (drawn dotted)"),
                 ("hflip", "probability of a mirrored sample"))),
             KindOption("--fill-masks", "SA-1B: repeat masks up to --max-masks (true/false)", flags.boolean),
             KindOption("--points-per-mask", "SA-1B: point prompts per mask (drawn as dots)", int),
             KindOption("--box-noise-mode", "SA-1B", choices=BOX_NOISE_MODES),
             KindOption("--resize", "SA-1B", choices=RESIZE_MODES),
             KindOption("--scale-jitter", "SA-1B: LO,HI factors of the image size (large-scale jitter)", flags.pair)),
)
