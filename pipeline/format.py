"""The on-disk format, in one place: manifest schema, shard names, sample members, array encoding.

Both the packer (`shard_tools`) and the reader (`pipeline`) import this module; any change to what
is written bumps `SCHEMA_VERSION`.

A dataset is a folder holding `manifest.json` and uncompressed, WebDataset-compatible tar shards
`<split>-<index:06d>.tar`. Every sample is a run of consecutive tar members `<key>.<ext>`; the
manifest lists, per shard, its sample count, size, SHA-256 and each sample's key and byte offset
(the offset of its first member's header; a final entry marks the end of the last sample), so a
reader can fetch any sample by byte range. A kind whose samples hold several units the loader
yields one by one (rows of an embeddings block, questions of a VQA image) lists each sample's
unit count in `units`; without it every sample is one unit.

An embeddings sample is a block of rows: `<key>.msgpack` is its column table and `<key>.bin`
the columns' raw little-endian bytes (`pack_columns`), so a reader takes zero-copy views.

Schema history: 1, SA-1B only; 2 adds `units` (a version 1 manifest reads as version 2) and the
`vqa` and `embeddings` kinds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from pipeline.errors import ManifestError

__all__ = [
    "SCHEMA_VERSION",
    "FORMAT",
    "MANIFEST_NAME",
    "KIND_MEMBERS",
    "SA1B_JPG",
    "SA1B_ANN",
    "SA1B_RECORD_FIELDS",
    "VQA_IMAGE_EXTS",
    "VQA_RECORD",
    "VQA_RECORD_FIELDS",
    "VQA_IMAGE_FIELDS",
    "VQA_QUESTION_FIELDS",
    "EMB_TABLE",
    "EMB_DATA",
    "EMB_ROW",
    "BFLOAT16",
    "COLUMN_DTYPES",
    "COLUMN_ALIGN",
    "storage_dtype",
    "pack_columns",
    "unpack_columns",
    "ShardInfo",
    "Manifest",
    "shard_name",
    "check_key",
    "encode_array",
    "decode_array",
    "pack_record",
    "unpack_record",
]

SCHEMA_VERSION = 2
_READABLE_VERSIONS = (1, 2)
FORMAT = "shardstream"
MANIFEST_NAME = "manifest.json"

# Member extensions of one sample, per kind, in the order they are written.
SA1B_JPG = "jpg"
SA1B_ANN = "msgpack"
# VQA: one image member, `jpg` or `png` as the original file is (never re-encoded but with
# --image-max-side), then the record.
VQA_IMAGE_EXTS = {"JPEG": "jpg", "PNG": "png"}  # Pillow format -> member extension
VQA_RECORD = "msgpack"
# Embeddings: a block of rows, its column table then the columns' bytes.
EMB_TABLE = "msgpack"
EMB_DATA = "bin"
KIND_MEMBERS: dict[str, tuple[str, ...]] = {
    "sa1b": (SA1B_JPG, SA1B_ANN),
    "vqa": (*VQA_IMAGE_EXTS.values(), VQA_RECORD),  # exactly one of the image extensions
    "embeddings": (EMB_TABLE, EMB_DATA),
}

# The SA-1B annotation record (msgpack map). Geometry is in the original image frame
# (`image.width` x `image.height`), whatever size the stored JPEG has (`stored_size`).
SA1B_RECORD_FIELDS = (
    "image",  # {"image_id": int, "width": int, "height": int, "file_name": str}
    "stored_size",  # [height, width] of the stored JPEG
    "counts",  # list of bytes: COCO compressed RLE strings, one per mask, size = [height, width]
    "ids",  # int64 (N,)
    "bbox",  # float64 (N, 4) XYWH
    "area",  # float64 (N,)
    "predicted_iou",  # float64 (N,)
    "stability_score",  # float64 (N,)
    "point_coords",  # float64 (P, 2): all masks' points, concatenated
    "point_counts",  # uint32 (N,): points per mask
    "crop_box",  # float64 (N, 4) XYWH
)

# The VQA record (msgpack map): one image of one split and all the questions of that split about it.
VQA_RECORD_FIELDS = (
    "image",  # {"path", "width", "height", "format", "mode", "sha256"}: the input file (path relative to --images)
    "stored_size",  # [height, width] of the stored image (smaller than the original with --image-max-side)
    "split",  # the split it was packed into
    "questions",  # list, one map per question (VQA_QUESTION_FIELDS), in input order
)
VQA_IMAGE_FIELDS = ("path", "width", "height", "format", "mode", "sha256")
VQA_QUESTION_FIELDS = (
    "question",  # str, as asked (LLaVA: the human turn without its <image> token)
    "answer",  # str (JSON numbers and booleans as JSON text)
    "source",  # the annotation file, as given to the packer
    "record",  # index of the record in that file
    "turn",  # index of the question among the record's (LLaVA conversations: one per human/gpt pair; else 0)
    "layout",  # "vqa-rad", "slake", "llava" or "mapped"
    "fields",  # the original JSON record, every field as it was
)
# Embeddings blocks. The table (msgpack map) is {"rows": n, "columns": [[name, dtype, shape, offset], ...]}:
# shape starts with n, dtype is one of COLUMN_DTYPES, and each column's bytes start at `offset` in
# the data member: the first at 0, each next one at the first multiple of COLUMN_ALIGN after the
# one before (zero padding), the data ending with the last column. Nothing else is accepted.
EMB_ROW = "row"  # the column holding each row's index in the packed input arrays (int64)
BFLOAT16 = "bfloat16"  # numpy has no bfloat16: stored as its little-endian 16-bit patterns, read as torch.bfloat16
COLUMN_DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                 "float16", BFLOAT16, "float32", "float64")
COLUMN_ALIGN = 64
_COLUMN_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

_KEY_RE = re.compile(r"[A-Za-z0-9_\-]{1,80}")
_ARRAY_DTYPES = frozenset({"|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8", "|b1"})


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def check_key(key: str) -> str:
    """Keys are flat names (letters, digits, `_`, `-`; at most 80): safe in tar, URLs and file systems."""
    if not _KEY_RE.fullmatch(key):
        raise ValueError(f"invalid sample key {key!r}: allowed are 1-80 of [A-Za-z0-9_-]")
    return key


def encode_array(array: np.ndarray) -> dict[str, Any]:
    """A numpy array as a plain msgpack map (dtype, shape, little-endian bytes): no pickle, no ext types."""
    array = np.ascontiguousarray(array)
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype.str not in _ARRAY_DTYPES:
        raise ValueError(f"dtype {array.dtype} cannot be stored; allowed: {sorted(_ARRAY_DTYPES)}")
    return {"dtype": dtype.str, "shape": list(array.shape), "data": array.astype(dtype, copy=False).tobytes()}


def decode_array(obj: Any) -> np.ndarray:
    """Inverse of `encode_array`; raises ValueError on anything that is not exactly such a map."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise ValueError("not an encoded array (want a map with dtype, shape, data)")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if dtype not in _ARRAY_DTYPES:
        raise ValueError(f"array dtype {dtype!r} not allowed")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"invalid array shape {shape!r}")
    if not isinstance(data, bytes) or len(data) != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
        raise ValueError(f"array data does not match dtype {dtype} and shape {shape}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def storage_dtype(name: str) -> np.dtype:
    """The little-endian numpy dtype holding a column dtype's values (bfloat16: its uint16 bit patterns)."""
    if name not in COLUMN_DTYPES:
        raise ValueError(f"column dtype {name!r} not allowed; allowed: {list(COLUMN_DTYPES)}")
    return _STORAGE_DTYPES[name]


_STORAGE_DTYPES = {name: np.dtype("<u2" if name == BFLOAT16 else name).newbyteorder("<") for name in COLUMN_DTYPES}


def _column_layout(columns: Sequence[tuple[str, str, tuple[int, ...]]]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for _, dtype, shape in columns:
        start = -(-end // COLUMN_ALIGN) * COLUMN_ALIGN
        offsets.append(start)
        end = start + math.prod(shape) * storage_dtype(dtype).itemsize  # exact: no int64 overflow
    return offsets, end


def pack_columns(columns: Sequence[tuple[str, str, np.ndarray]]) -> tuple[bytes, bytes]:
    """(table, data) members of a block from (name, dtype, array) columns of equal length; a bfloat16
    column is given as its uint16 bit patterns."""
    n = len(columns[0][2]) if columns else 0
    layout = [(name, dtype, tuple(array.shape)) for name, dtype, array in columns]
    for name, dtype, array in columns:
        if not _COLUMN_NAME_RE.fullmatch(name) or array.ndim < 1 or len(array) != n:
            raise ValueError(f"column {name!r}: want a name like a Python identifier and {n} rows, got {array.shape}")
        if array.dtype.newbyteorder("<") != storage_dtype(dtype):
            raise ValueError(f"column {name!r}: array of {array.dtype} given for dtype {dtype}")
    offsets, end = _column_layout(layout)
    data = bytearray(end)
    for (_, dtype, array), offset in zip(columns, offsets):
        raw = np.ascontiguousarray(array, dtype=storage_dtype(dtype)).tobytes()
        data[offset : offset + len(raw)] = raw
    table = {"rows": n, "columns": [[name, dtype, list(shape), offset] for (name, dtype, shape), offset in zip(layout, offsets)]}
    return pack_record(table), bytes(data)


def unpack_columns(table: bytes, data: bytes) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (dtype, read-only view into `data`)} of a block; ValueError on anything `pack_columns`
    would not have written (unknown dtypes, lengths that disagree, offsets off the layout, extra bytes)."""
    obj = unpack_record(table)
    if set(obj) != {"rows", "columns"} or type(obj["rows"]) is not int or not isinstance(obj["columns"], list):
        raise ValueError("not a column table (want a map with rows and columns)")
    n, layout, given = obj["rows"], [], []
    for column in obj["columns"]:
        if not (isinstance(column, list) and len(column) == 4 and isinstance(column[0], str)
                and _COLUMN_NAME_RE.fullmatch(column[0]) and column[1] in COLUMN_DTYPES
                and isinstance(column[2], list) and column[2][:1] == [n]
                and all(type(d) is int and d >= 0 for d in column[2]) and type(column[3]) is int):
            raise ValueError(f"invalid column entry {column!r}"[:200])
        layout.append((column[0], column[1], tuple(column[2])))
        given.append(column[3])
    if len({name for name, _, _ in layout}) != len(layout):
        raise ValueError("duplicate column names")
    offsets, end = _column_layout(layout)
    if given != offsets or len(data) != end:
        raise ValueError(f"column offsets {given} and {len(data)} data bytes, expected {offsets} and {end}")
    return {
        name: (dtype, np.frombuffer(data, storage_dtype(dtype), math.prod(shape), offset).reshape(shape))
        for (name, dtype, shape), offset in zip(layout, offsets)
    }


def pack_record(record: Mapping[str, Any]) -> bytes:
    return msgpack.packb(record, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def unpack_record(data: bytes) -> dict[str, Any]:
    """Unpack a msgpack map; every length is bounded by the input size and extension types are refused."""
    obj = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext)  # lengths capped at len(data)
    if not isinstance(obj, dict):
        raise ValueError(f"record is a {type(obj).__name__}, want a map")
    return obj


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    name: str
    bytes: int
    sha256: str
    keys: tuple[str, ...]
    offsets: tuple[int, ...]  # len(keys) + 1: each sample's first header, then the end of the last sample
    units: tuple[int, ...] | None = None  # per sample, for kinds whose samples hold several units

    @property
    def samples(self) -> int:
        return len(self.keys)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "samples": self.samples,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "keys": list(self.keys),
            "offsets": list(self.offsets),
            **({"units": list(self.units)} if self.units is not None else {}),
        }

    @classmethod
    def from_json(cls, obj: Any, url: str) -> ShardInfo:
        try:
            units = obj.get("units")
            shard = cls(obj["name"], obj["bytes"], obj["sha256"], tuple(obj["keys"]), tuple(obj["offsets"]),
                        None if units is None else tuple(units))
            ok = (
                obj["samples"] == len(shard.keys)
                and len(shard.offsets) == len(shard.keys) + 1
                and all(isinstance(o, int) for o in shard.offsets)
                and list(shard.offsets) == sorted(shard.offsets)
                and (not shard.offsets or 0 <= shard.offsets[0] and shard.offsets[-1] <= shard.bytes)
                and (shard.units is None or (len(shard.units) == len(shard.keys)
                                             and all(type(u) is int and u >= 1 for u in shard.units)))
            )
        except (KeyError, TypeError) as exc:
            raise ManifestError(url, f"invalid shard entry: {exc!r}") from exc
        if not ok or re.fullmatch(r"[A-Za-z0-9_\-]+\.tar", str(shard.name)) is None:
            raise ManifestError(url, f"inconsistent shard entry {obj.get('name')!r}")
        return shard


@dataclasses.dataclass(frozen=True)
class Manifest:
    kind: str
    splits: Mapping[str, Sequence[ShardInfo]]
    options: Mapping[str, Any]  # the packing options that shaped the shards
    fingerprint: str  # of the input listing and options: a resumed pack must match it
    skipped: Sequence[Mapping[str, str]] = ()  # {"source", "key", "reason"} per skipped input sample

    def samples(self, split: str) -> int:
        return sum(s.samples for s in self.splits[split])

    def to_json(self) -> bytes:
        obj = {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "fingerprint": self.fingerprint,
            "options": dict(self.options),
            "splits": {
                name: {"samples": self.samples(name), "shards": [s.to_json() for s in shards]}
                for name, shards in sorted(self.splits.items())
            },
            "skipped": [dict(s) for s in self.skipped],
        }
        return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, url: str) -> Manifest:
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            raise ManifestError(url, f"not valid JSON: {exc!r}"[:300]) from exc
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ManifestError(url, f"not a {FORMAT} manifest")
        if obj.get("schema_version") not in _READABLE_VERSIONS:
            raise ManifestError(
                url, f"schema version {obj.get('schema_version')!r}; this version reads {list(_READABLE_VERSIONS)}"
            )
        if obj.get("kind") not in KIND_MEMBERS:
            raise ManifestError(url, f"unknown kind {obj.get('kind')!r}; known: {sorted(KIND_MEMBERS)}")
        try:
            splits = {
                name: tuple(ShardInfo.from_json(s, url) for s in split["shards"])
                for name, split in obj["splits"].items()
            }
            return cls(obj["kind"], splits, obj["options"], obj["fingerprint"], tuple(obj["skipped"]))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(url, f"invalid manifest: {exc!r}") from exc
