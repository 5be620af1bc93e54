"""The on-disk format, in one place: manifest schema, shard indexes, shard names, sample members,
array encoding.

Both the packer (`shard_tools`) and the reader (`pipeline`) import this module; any change to what
is written bumps `SCHEMA_VERSION` (the manifest) or `INDEX_VERSION` (the shard index files).

A dataset is a folder holding `manifest.json`, uncompressed WebDataset-compatible tar shards
`<split>-<index:06d>.tar` and, beside each, its index `<split>-<index:06d>.idx`. Every sample is
a run of tar members `<key>.<ext>`. The manifest grows with shards, never with samples: per
split, a table with one row per shard (name, samples, units, bytes, SHA-256, and its index
file's name, bytes and SHA-256). The per-sample table lives in each shard's index (`ShardIndex`):
keys, units, each sample's byte span, and each member's header offset, size and extension, so a
reader fetches one small file when it first touches a shard, then any sample by byte range. A
kind whose samples hold several units the loader yields one by one (rows of an embeddings block,
questions of a VQA image) records each sample's unit count; every sample has at least one.

An embeddings sample is a block of rows: `<key>.msgpack` is its column table and `<key>.bin`
the columns' raw little-endian bytes (`pack_columns`), so a reader takes zero-copy views.

A dataset indexed in place (`shard-pack index`: original SA-1B or WebDataset archives, never
copied) has `origin` "indexed": its shards are the original archives, named by a path relative to
the manifest's folder (no `..`) or by an absolute path or URL (`shard_url`), and its manifest lists
the member extensions the samples hold (`members`: SA-1B originals `jpg` + `json`, where packed
samples hold `jpg` + `msgpack`). One archive may serve several splits, each with its own index
file listing only that split's samples; within a split a shard is listed once.

Schema history: 1, SA-1B only; 2 adds per-sample `units` and the `vqa` and `embeddings` kinds;
3 moves the per-sample tables (keys, offsets, units) out of the manifest into per-shard index
files, and lists shards as columns; 4 adds datasets indexed in place (`origin`, `members`, shard
names that are paths or URLs) and the `webdataset` kind. Versions 1 and 2 are still read,
converted in memory (`shard-pack upgrade` writes the indexes and a current manifest in place); 3
is read as it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.errors import ManifestError, ShardIndexError
from pipeline.format.members import (
    EMB_DATA, EMB_ROW, EMB_TABLE, KIND_NAMES, SA1B_ANN, SA1B_JPG, SA1B_JSON, SA1B_RECORD_FIELDS, VQA_IMAGE_EXTS,
    VQA_IMAGE_FIELDS, VQA_QUESTION_FIELDS, VQA_RECORD, VQA_RECORD_FIELDS, WEBDATASET,
)
from pipeline.format.names import (
    _EXT_RE, _INDEX_RE, _KEY_BYTES, _SHA_RE, _SHARD_RE, _shard_name_ok, check_ext, check_key, check_shard_name, shard_name,
)
from pipeline.format.records import (
    BFLOAT16, COLUMN_ALIGN, COLUMN_DTYPES, column_offsets, decode_array, encode_array, pack_columns, pack_record,
    storage_dtype, unpack_columns, unpack_record,
)
from pipeline.format.safejson import MAX_JSON_BYTES, MAX_JSON_DEPTH, parse_json

__all__ = [
    "SCHEMA_VERSION",
    "FORMAT",
    "MANIFEST_NAME",
    "KIND_NAMES",
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
    "column_offsets",
    "storage_dtype",
    "pack_columns",
    "unpack_columns",
    "INDEX_EXT",
    "INDEX_VERSION",
    "MAX_INDEX_BYTES",
    "ShardIndex",
    "IndexInfo",
    "ShardInfo",
    "Split",
    "Manifest",
    "index_name",
    "shard_name",
    "check_shard_name",
    "check_key",
    "check_ext",
    "ORIGINS",
    "SA1B_JSON",
    "WEBDATASET",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "parse_json",
    "encode_array",
    "decode_array",
    "pack_record",
    "unpack_record",
]

SCHEMA_VERSION = 4
_READABLE_VERSIONS = (1, 2, 3, 4)
ORIGINS = ("packed", "indexed")  # shards written by `shard-pack`, or original archives indexed in place
FORMAT = "shardstream"
MANIFEST_NAME = "manifest.json"

# The shard index file (`ShardIndex.to_bytes`), little-endian: a header (magic, version, flags 0,
# samples n, members m, key bytes, extension-table bytes, the shard's bytes, units), then
# spans u64[n, 2], member header offsets u64[m], member sizes u64[m], units u32[n], key ends
# u32[n], member ends u32[n], member extension numbers u8[m], the keys, the extensions ("\n"-joined).
INDEX_EXT = ".idx"
INDEX_VERSION = 1
INDEX_MAGIC = b"SSINDEX\n"
_INDEX_HEADER = struct.Struct("<8sIIQQQQQQ")
MAX_INDEX_SAMPLES = 1 << 24
MAX_INDEX_BYTES = 1 << 30
_MAX_MEMBERS = 16  # per sample
BLOCK_BYTES = 512  # a tar block


def _padded(size: int) -> int:
    return size + (-size % BLOCK_BYTES)


class ShardIndex:
    """Where each sample of one shard lies: its key, its units, its byte span (its first member's
    header to its last member's padded end) and each member's header offset, size and extension.

    Stored beside the dataset as a small binary file (`to_bytes`), read by a worker when it first
    touches the shard. Members are recorded one by one, so an index can also describe archives
    whose samples' members are not adjacent. `members=None` marks an index made in memory from a
    schema-2 manifest, which recorded sample offsets only."""

    def __init__(self, keys: bytes, key_ends: np.ndarray, spans: np.ndarray, units: np.ndarray,
                 members: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
                 exts: tuple[str, ...] = ()) -> None:
        self.keys, self.key_ends, self.spans, self.units = keys, key_ends, spans, units
        self.members, self.exts = members, exts  # members: (ends per sample, header offsets, sizes, ext numbers)
        self.unit_starts = np.concatenate(([0], np.cumsum(units))).astype(np.int64)  # each sample's first unit, then the count

    @property
    def samples(self) -> int:
        return len(self.units)

    @property
    def nbytes(self) -> int:
        arrays = [self.key_ends, self.spans, self.units, self.unit_starts, *(self.members or ())]
        return len(self.keys) + sum(a.nbytes for a in arrays)

    def key(self, i: int) -> str:
        return self.keys[(int(self.key_ends[i - 1]) if i else 0) : int(self.key_ends[i])].decode()

    def key_list(self) -> list[str]:
        starts = [0, *self.key_ends[:-1].tolist()]
        return [self.keys[a:b].decode() for a, b in zip(starts, self.key_ends.tolist())]

    def span(self, i: int) -> tuple[int, int]:
        start, end = self.spans[i].tolist()
        return start, end

    def sample_members(self, i: int) -> list[tuple[str, int, int]]:
        """(extension, header offset, data bytes) of each member of sample `i`, in shard order."""
        if self.members is None:
            raise ValueError("this index does not record members (made from a schema-2 manifest)")
        ends, offsets, sizes, exts = self.members
        first = int(ends[i - 1]) if i else 0
        return [(self.exts[e], o, s) for e, o, s in zip(exts[first : ends[i]].tolist(), offsets[first : ends[i]].tolist(),
                                                        sizes[first : ends[i]].tolist())]

    @classmethod
    def build(cls, keys: Sequence[str], units: Sequence[int], members: Sequence[Sequence[tuple[str, int, int]]]) -> ShardIndex:
        """The index of samples given as key, units and members (extension, header offset, data bytes)."""
        exts = tuple(sorted({ext for sample in members for ext, _, _ in sample}))
        if len(exts) > 256 or len("\n".join(exts)) > 4096:  # (what `from_bytes` reads back)
            raise ValueError(f"{len(exts)} distinct member extensions: an index holds at most 256, in 4096 bytes")
        number = {ext: i for i, ext in enumerate(exts)}
        flat = [m for sample in members for m in sample]
        offsets = np.asarray([o for _, o, _ in flat], dtype=np.int64)
        sizes = np.asarray([s for _, _, s in flat], dtype=np.int64)
        ends = np.cumsum([len(sample) for sample in members], dtype=np.int64)
        spans = np.asarray([[sample[0][1], sample[-1][1] + BLOCK_BYTES + _padded(sample[-1][2])] for sample in members],
                           dtype=np.int64).reshape(-1, 2)
        encoded = [k.encode() for k in keys]
        return cls(b"".join(encoded), np.cumsum([len(k) for k in encoded], dtype=np.int64), spans,
                   np.asarray(units, dtype=np.int64),
                   (ends, offsets, sizes, np.asarray([number[e] for e, _, _ in flat], dtype=np.uint8)), exts)

    def to_bytes(self, shard_bytes: int) -> bytes:
        """The index file: a fixed header, then the arrays and the key and extension tables (little-endian)."""
        if self.members is None:
            raise ValueError("an index without members cannot be written")
        ends, offsets, sizes, exts = self.members
        ext_table = "\n".join(self.exts).encode()
        header = _INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, 0, self.samples, len(offsets), len(self.keys),
                                    len(ext_table), shard_bytes, int(self.units.sum()))
        return b"".join([header, self.spans.astype("<u8").tobytes(), offsets.astype("<u8").tobytes(),
                         sizes.astype("<u8").tobytes(), self.units.astype("<u4").tobytes(),
                         self.key_ends.astype("<u4").tobytes(), ends.astype("<u4").tobytes(),
                         exts.astype("u1").tobytes(), self.keys, ext_table])

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, url: str, *, samples: int, units: int, shard_bytes: int) -> ShardIndex:
        """Parse and check an index file against what the manifest says of its shard; IndexError
        (a ShardIndexError) naming the file on anything that is not exactly what `to_bytes` writes."""
        def bad(message: str) -> ShardIndexError:
            return ShardIndexError(url, f"invalid shard index: {message}")

        if len(data) < _INDEX_HEADER.size:
            raise bad(f"{len(data)} bytes, shorter than its header")
        magic, version, flags, n, m, key_bytes, ext_bytes, total, unit_count = _INDEX_HEADER.unpack_from(data)
        if magic != INDEX_MAGIC or version != INDEX_VERSION or flags:
            raise bad(f"not a version-{INDEX_VERSION} shardstream index (magic {magic!r}, version {version})")
        if (n, unit_count, total) != (samples, units, shard_bytes):
            raise bad(f"{n} samples, {unit_count} units, shard of {total} bytes; the manifest says {samples}, {units}, "
                      f"{shard_bytes}")
        if n > MAX_INDEX_SAMPLES or m > n * _MAX_MEMBERS or m < n or key_bytes > 80 * n or ext_bytes > 4096:
            raise bad(f"sizes out of bounds ({n} samples, {m} members, {key_bytes} key bytes, {ext_bytes} extension bytes)")
        if len(data) != _INDEX_HEADER.size + 28 * n + 17 * m + key_bytes + ext_bytes:
            raise bad(f"{len(data)} bytes, the header's counts need {_INDEX_HEADER.size + 28 * n + 17 * m + key_bytes + ext_bytes}")
        pos = _INDEX_HEADER.size

        def take(dtype: str, count: int) -> np.ndarray:
            nonlocal pos
            array = np.frombuffer(data, dtype, count, pos)
            pos += array.nbytes
            return array.astype(np.int64)

        spans, offsets, sizes = take("<u8", 2 * n).reshape(n, 2), take("<u8", m), take("<u8", m)
        unit_array, key_ends, ends, ext_numbers = take("<u4", n), take("<u4", n), take("<u4", n), take("u1", m)
        keys, ext_table = bytes(data[pos : pos + key_bytes]), bytes(data[pos + key_bytes :])
        exts = tuple(ext_table.decode("ascii", "replace").split("\n")) if ext_bytes else ()
        lengths = np.diff(key_ends, prepend=0)
        if (lengths < 1).any() or (lengths > 80).any() or (n and key_ends[-1] != key_bytes) or \
                not _KEY_BYTES[np.frombuffer(keys, np.uint8)].all():
            raise bad("keys must be 1-80 of [A-Za-z0-9_-] each, filling the key table")
        if (unit_array < 1).any():
            raise bad("a sample with no units")
        if len(set(exts)) != len(exts) or not all(_EXT_RE.fullmatch(e) for e in exts) or (ext_numbers >= len(exts)).any():
            raise bad(f"invalid extension table {exts!r}"[:200])
        if n and ((spans[:, 0] >= spans[:, 1]).any() or spans[:, 1].max() > total or (np.diff(spans[:, 0]) <= 0).any()):
            raise bad("sample spans out of order, empty or past the shard's end")
        counts = np.diff(ends, prepend=0)
        if (counts < 1).any() or (n and ends[-1] != m) or (counts > _MAX_MEMBERS).any():
            raise bad("every sample needs 1 to 16 members, filling the member table")
        sample = np.repeat(np.arange(n), counts)
        member_end = offsets + BLOCK_BYTES + sizes + (-sizes % BLOCK_BYTES)
        same = sample[1:] == sample[:-1]
        if m and ((offsets < spans[sample, 0]) | (member_end > spans[sample, 1])).any() or \
                (same & (offsets[1:] < member_end[:-1])).any() or \
                len(np.unique(sample * 256 + ext_numbers)) != m:
            raise bad("members out of order, overlapping, outside their sample's span or repeated")
        return cls(keys, key_ends, spans, unit_array, (ends, offsets, sizes, ext_numbers.astype(np.uint8)), exts)

    @classmethod
    def of_offsets(cls, keys: Sequence[str], offsets: Sequence[int], units: Sequence[int] | None) -> ShardIndex:
        """A schema-2 shard entry (keys, sample offsets, units) as an index without members."""
        encoded = [k.encode() for k in keys]
        bounds = np.asarray(offsets, dtype=np.int64)
        return cls(b"".join(encoded), np.cumsum([len(k) for k in encoded], dtype=np.int64),
                   np.stack([bounds[:-1], bounds[1:]], axis=1),
                   np.asarray(units if units is not None else [1] * len(keys), dtype=np.int64))



@dataclasses.dataclass(frozen=True)
class IndexInfo:
    """A shard's index file, as the manifest lists it."""

    name: str
    bytes: int
    sha256: str

    @classmethod
    def of(cls, shard: str, data: bytes, name: str | None = None) -> IndexInfo:
        """The manifest's entry for `data`, the index file of the shard named `shard` (stored as
        `index_name(shard)` unless `name` says otherwise: an archive indexed in place)."""
        return cls(name or index_name(shard), len(data), hashlib.sha256(data).hexdigest())


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One shard, as the manifest lists it: counts, size, checksum and its index file. A shard of a
    schema-2 manifest has no index file; its index is `inline`, made from the manifest in memory."""

    name: str
    samples: int
    units: int
    bytes: int
    sha256: str
    index: IndexInfo | None
    inline: ShardIndex | None = dataclasses.field(default=None, compare=False, repr=False)


_COLUMNS = ("name", "samples", "units", "bytes", "sha256", "index", "index_bytes", "index_sha256")


class Split(Sequence[ShardInfo]):
    """One split's shards, kept as columns (one entry per shard, never per sample): what opening a
    dataset costs grows with its shards."""

    def __init__(self, shards: Sequence[ShardInfo]) -> None:
        self.names = [s.name for s in shards]
        self.sample_counts = np.asarray([s.samples for s in shards], dtype=np.int64)
        self.unit_counts = np.asarray([s.units for s in shards], dtype=np.int64)
        self.shard_bytes = np.asarray([s.bytes for s in shards], dtype=np.int64)
        self.sha256 = [s.sha256 for s in shards]
        self.indexes = [s.index for s in shards]
        self.inline = [s.inline for s in shards] if any(s.inline is not None for s in shards) else None

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> ShardInfo:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(f"shard {i} of {len(self)}")
        return ShardInfo(self.names[i], int(self.sample_counts[i]), int(self.unit_counts[i]), int(self.shard_bytes[i]),
                         self.sha256[i], self.indexes[i], self.inline[i] if self.inline else None)

    @property
    def samples(self) -> int:
        return int(self.sample_counts.sum())

    @property
    def units(self) -> int:
        return int(self.unit_counts.sum())

    def to_json(self) -> dict[str, Any]:
        if any(i is None for i in self.indexes):
            raise ValueError("shards without an index file cannot be listed in a schema-3 manifest (shard-pack upgrade)")
        columns = [self.names, self.sample_counts.tolist(), self.unit_counts.tolist(), self.shard_bytes.tolist(),
                   self.sha256, [i.name for i in self.indexes], [i.bytes for i in self.indexes],  # type: ignore[union-attr]
                   [i.sha256 for i in self.indexes]]  # type: ignore[union-attr]
        return {"samples": self.samples, "units": self.units, "shards": dict(zip(_COLUMNS, columns))}

    @classmethod
    def from_json(cls, obj: Any, url: str, name: str, origin: str = "packed") -> Split:
        """A schema-3/4 split (a table of columns), checked: types, bounds, totals, shard names of the
        dataset's origin."""
        shards = obj["shards"]
        if not isinstance(shards, dict) or set(shards) != set(_COLUMNS):
            raise ManifestError(url, f"split {name!r}: want the shard columns {list(_COLUMNS)}")
        columns = [shards[c] for c in _COLUMNS]
        count = len(columns[0]) if isinstance(columns[0], list) else -1
        if not all(isinstance(c, list) and len(c) == count for c in columns):
            raise ManifestError(url, f"split {name!r}: shard columns must be lists of equal length")
        names, samples, units, sizes, sha, index, index_bytes, index_sha = columns
        ints = (samples, units, sizes, index_bytes)
        if not all(type(v) is int and 0 <= v < 1 << 62 for column in ints for v in column) or \
                not all(isinstance(v, str) and _SHA_RE.fullmatch(v) for column in (sha, index_sha) for v in column) or \
                not all(isinstance(v, str) and _shard_name_ok(v, origin) for v in names) or \
                not all(isinstance(v, str) and _INDEX_RE.fullmatch(v) for v in index):
            raise ManifestError(url, f"split {name!r}: a shard entry of the wrong type or form")
        bad = [n for n, s, u in zip(names, samples, units) if u < s or (u and not s)]
        if bad:
            raise ManifestError(url, f"split {name!r}: shard {bad[0]!r} has fewer units than samples")
        split = cls([ShardInfo(*row[:5], IndexInfo(*row[5:])) for row in zip(*columns)])
        if (obj.get("samples"), obj.get("units")) != (split.samples, split.units):
            raise ManifestError(url, f"split {name!r} says {obj.get('samples')} samples and {obj.get('units')} units, "
                                f"its shards hold {split.samples} and {split.units}")
        return split


@dataclasses.dataclass(frozen=True)
class Manifest:
    kind: str
    splits: Mapping[str, Split]  # (any sequences of ShardInfo given are made Splits)
    options: Mapping[str, Any]  # the packing options that shaped the shards
    fingerprint: str  # of the input listing and options: a resumed pack must match it
    skipped: Sequence[Mapping[str, str]] = ()  # {"source", "key", "reason"} per skipped input sample
    version: int = SCHEMA_VERSION  # the schema it was read from (older ones are converted in memory)
    origin: str = "packed"  # one of ORIGINS: "indexed" when the shards are original archives, indexed in place
    members: tuple[str, ...] = ()  # indexed in place: the member extensions its samples hold, sorted

    def __post_init__(self) -> None:
        splits = {name: s if isinstance(s, Split) else Split(s) for name, s in self.splits.items()}
        object.__setattr__(self, "splits", splits)
        object.__setattr__(self, "members", tuple(self.members))
        if self.origin not in ORIGINS:
            raise ValueError(f"origin must be one of {ORIGINS}, got {self.origin!r}")
        if (self.origin == "indexed") != bool(self.members) or list(self.members) != sorted(set(self.members)) or \
                not all(isinstance(e, str) and _EXT_RE.fullmatch(e) for e in self.members):
            raise ValueError(f"members {self.members!r}: a dataset indexed in place lists its member extensions "
                             "(sorted, distinct), a packed one none")
        for split in splits.values():
            for name in split.names:
                check_shard_name(name, self.origin)

    def samples(self, split: str) -> int:
        return self.splits[split].samples

    def to_json(self) -> bytes:
        obj = {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "fingerprint": self.fingerprint,
            "options": dict(self.options),
            "splits": {name: split.to_json() for name, split in sorted(self.splits.items())},
            "skipped": [dict(s) for s in self.skipped],
            "origin": self.origin,
            "members": list(self.members),
        }
        return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, url: str) -> Manifest:
        """Parse and check a manifest; one of schema 1 or 2 (per-sample tables in the JSON) is
        converted in memory, each shard's index made `inline`."""
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            raise ManifestError(url, f"not valid JSON: {exc!r}"[:300]) from exc
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ManifestError(url, f"not a {FORMAT} manifest")
        version = obj.get("schema_version")
        if version not in _READABLE_VERSIONS:
            raise ManifestError(url, f"schema version {version!r}; this version reads {list(_READABLE_VERSIONS)}")
        if obj.get("kind") not in KIND_NAMES:
            raise ManifestError(url, f"unknown kind {obj.get('kind')!r}; known: {sorted(KIND_NAMES)}")
        try:
            origin, members = (obj["origin"], obj["members"]) if version >= 4 else ("packed", [])
            if origin not in ORIGINS or not isinstance(members, list):
                raise ManifestError(url, f"origin {origin!r} (want one of {list(ORIGINS)}) or members {members!r}"[:300])
            if version >= 3:
                splits = {name: Split.from_json(split, url, name, origin) for name, split in obj["splits"].items()}
            else:
                splits = {name: Split(tuple(_legacy_shard(s, url) for s in split["shards"]))
                          for name, split in obj["splits"].items()}
            manifest = cls(obj["kind"], splits, obj["options"], obj["fingerprint"], tuple(obj["skipped"]), version,
                           origin, tuple(members))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:  # (ValueError: Manifest's own checks)
            raise ManifestError(url, f"invalid manifest: {exc!r}"[:500]) from exc
        # A packed shard belongs to one split; an archive indexed in place may serve several (each split's
        # index lists only its samples), but is listed once per split. Index files are never shared.
        per_split = [split.names for split in manifest.splits.values()] if origin == "indexed" else \
            [[n for split in manifest.splits.values() for n in split.names]]
        indexes = [i.name for split in manifest.splits.values() for i in split.indexes if i is not None]
        for listed in (*per_split, indexes):
            if len(set(listed)) != len(listed):
                twice = sorted({n for n in listed if listed.count(n) > 1})
                raise ManifestError(url, f"{twice[0]!r} is listed more than once: its samples would be read twice")
        return manifest


def _legacy_shard(obj: Any, url: str) -> ShardInfo:
    """A schema-1/2 shard entry (keys, offsets and units listed per sample), checked, with its index made in memory."""
    try:
        keys, offsets, units, size = obj["keys"], obj["offsets"], obj.get("units"), obj["bytes"]
        ok = (
            isinstance(keys, list) and isinstance(offsets, list) and type(size) is int
            and obj["samples"] == len(keys) and len(offsets) == len(keys) + 1
            and all(isinstance(k, str) and k for k in keys)  # (keys are checked when their samples are read)
            and all(type(o) is int for o in offsets)
            and all(a < b for a, b in zip(offsets, offsets[1:]))
            and (not offsets or 0 <= offsets[0] and offsets[-1] <= size)
            and (units is None or (isinstance(units, list) and len(units) == len(keys)
                                   and all(type(u) is int and u >= 1 for u in units)))
            and isinstance(obj["sha256"], str) and _SHA_RE.fullmatch(obj["sha256"])
        )
    except (KeyError, TypeError) as exc:
        raise ManifestError(url, f"invalid shard entry: {exc!r}") from exc
    if not ok or not isinstance(obj.get("name"), str) or _SHARD_RE.fullmatch(obj["name"]) is None:
        raise ManifestError(url, f"inconsistent shard entry {obj.get('name')!r}")
    index = ShardIndex.of_offsets(keys, offsets, units)
    return ShardInfo(obj["name"], len(keys), int(index.units.sum()), size, obj["sha256"], None, index)


def index_name(shard: str) -> str:
    """The index file of a shard this project packs: `train-000000.tar` -> `train-000000.idx`."""
    return shard.removesuffix(".tar") + INDEX_EXT

