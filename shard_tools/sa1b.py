"""SA-1B on the packing side: list `sa_<id>.jpg` + `sa_<id>.json` pairs in archives and folders,
check each pair, and encode it as the sample members of `pipeline.format` (JPEG + msgpack record).

With `image_max_side`, larger JPEGs are re-encoded to that long side; the annotations keep the
original geometry and RLE, and the loader maps both into the same frame (see `pipeline.kinds.sa1b`).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import logging
import posixpath
import tarfile
from collections.abc import Sequence
from typing import Any

from PIL import Image

from pipeline.errors import InputError, SampleError
from pipeline.format import SA1B_ANN, SA1B_JPG, check_key, pack_record, parse_json
from pipeline.rle import fit
from pipeline.kinds.sa1b import annotation_record
from pipeline.storage import filesystem
from shard_tools.images import load_whole, resize_image
from shard_tools.pack import Part, SampleRef

__all__ = ["Sa1bSource", "check_pair"]

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
    kind: str = dataclasses.field(default="sa1b", init=False)

    def __post_init__(self) -> None:
        if self.image_max_side is not None and (not isinstance(self.image_max_side, int) or self.image_max_side < 16):
            raise ValueError(f"image_max_side must be an int >= 16 or None, got {self.image_max_side!r}")
        if not 1 <= self.jpeg_quality <= 95:
            raise ValueError(f"jpeg_quality must be in [1, 95], got {self.jpeg_quality!r}")

    def options(self) -> dict[str, Any]:
        return {"image_max_side": self.image_max_side, "jpeg_quality": self.jpeg_quality if self.image_max_side else None}

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
                skipped.append({"source": part.name, "key": key, "reason": f"{part.name}: no {missing} for key {key!r}"})
                continue
            refs.append(SampleRef(key, tuple((role, entry[role]) for role in _ROLES)))
        if not refs:
            lone = collections.Counter(role for entry in found.values() if len(entry) == 1 for role in entry)
            seen = [f"{lone['jpg']} JPEGs without their JSON", f"{lone['json']} JSONs without their JPEG",
                    f"{len(skipped) - lone.total()} files with a bad name or a duplicate key", f"{ignored} other files"]
            raise InputError(", ".join(sources), "no SA-1B samples (sa_<id>.jpg with its sa_<id>.json): found "
                             + (", ".join(s for s in seen if not s.startswith("0 ")) or "no files"))
        return refs, skipped

    def _parts(self, sources: Sequence[str]):  # -> Iterator[tuple[str, str, Part]]
        for source in sources:
            fs, path = filesystem(source)
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
            raise InputError(url, f"{what} ({exc}); only uncompressed .tar archives are read") from exc

    # -- encoding --------------------------------------------------------------------------------

    def encode(self, ref: SampleRef) -> tuple[list[tuple[str, bytes]], dict[str, int]]:
        parts = dict(ref.parts)
        jpg, meta_bytes = (_read(parts[role]) for role in _ROLES)
        record, (height, width) = check_pair(jpg, meta_bytes, parts["jpg"].name, parts["json"].name, ref.key)
        stored = (height, width)
        if self.image_max_side and max(height, width) > self.image_max_side:
            stored = fit(height, width, self.image_max_side)
            jpg = resize_image(jpg, "JPEG", stored, self.jpeg_quality, rgb=True)  # (RGB: see resize_image)
        record["stored_size"] = list(stored)
        return [(SA1B_JPG, jpg), (SA1B_ANN, pack_record(record))], {"masks": len(record["counts"])}


def _read(part: Part) -> bytes:
    fs, path = filesystem(part.url)
    return fs.cat_file(path, start=part.offset, end=part.offset + part.size)


def check_pair(jpg: bytes, meta: bytes, jpg_name: str, json_name: str, key: str) -> tuple[dict[str, Any], tuple[int, int]]:
    """(the stored record without `stored_size`, the image's (height, width)) of an SA-1B pair, checked
    whole: JSON within limits, annotations, RLE, a whole JPEG of the size the JSON states. Packing
    and `shard-pack index` both call it; the names are what errors name."""
    try:
        parsed = parse_json(meta)
    except ValueError as exc:
        raise SampleError(json_name, key, "json", f"invalid JSON: {exc}"[:300]) from exc
    record, height, width = annotation_record(parsed, json_name, key)
    return record, _check_jpeg(jpg, (height, width), jpg_name, key)


def _check_jpeg(data: bytes, size: tuple[int, int], where: str, key: str) -> tuple[int, int]:
    """The JPEG's (height, width) after checking it is a whole JPEG of the size the JSON states."""
    if not data.startswith(b"\xff\xd8"):
        raise SampleError(where, key, "jpg", "not a JPEG file")
    try:
        with Image.open(io.BytesIO(data), formats=["JPEG"]) as image:
            if (image.height, image.width) != size:
                raise SampleError(where, key, "jpg", f"JPEG is {image.height}x{image.width}, the JSON says {size[0]}x{size[1]}")
            load_whole(image, jpeg=True)
    except (OSError, SyntaxError, ValueError) as exc:
        raise SampleError(where, key, "jpg", f"truncated or corrupt JPEG: {exc}") from exc
    return size
