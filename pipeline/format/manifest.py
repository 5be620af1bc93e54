"""The manifest (`manifest.json`): the dataset's kind, packing options and origin, and per split a
table with one row per shard (`Split`, `ShardInfo`, `IndexInfo`). Any change to what it holds bumps
`SCHEMA_VERSION`.

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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.errors import ConfigError, DatasetError, ManifestError
from pipeline.format.index import ShardIndex, index_name
from pipeline.format.members import KIND_NAMES
from pipeline.format.names import _EXT_RE, _INDEX_RE, _SHA_RE, _SHARD_RE, _shard_name_ok, check_shard_name

__all__ = ["SCHEMA_VERSION", "FORMAT", "MANIFEST_NAME", "ORIGINS", "IndexInfo", "ShardInfo", "Split", "Manifest"]

SCHEMA_VERSION = 4
_READABLE_VERSIONS = (1, 2, 3, 4)
ORIGINS = ("packed", "indexed")  # shards written by `shard-pack`, or original archives indexed in place
FORMAT = "shardstream"
MANIFEST_NAME = "manifest.json"


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
            raise DatasetError("shards without an index file cannot be listed in a schema-3 manifest "
                               "(shard-pack upgrade)")
        indexes = [i for i in self.indexes if i is not None]  # (all of them: checked above)
        columns = [self.names, self.sample_counts.tolist(), self.unit_counts.tolist(), self.shard_bytes.tolist(),
                   self.sha256, [i.name for i in indexes], [i.bytes for i in indexes], [i.sha256 for i in indexes]]
        return {"samples": self.samples, "units": self.units, "shards": dict(zip(_COLUMNS, columns))}

    @classmethod
    def from_json(cls, obj: Any, url: str, name: str, origin: str = "packed") -> Split:
        """A schema-3/4 split (a table of columns), checked: types, bounds, totals, shard names of the
        dataset's origin."""
        shards = obj["shards"]
        if not isinstance(shards, dict) or set(shards) != set(_COLUMNS):
            raise ManifestError(f"split {name!r}: want the shard columns {list(_COLUMNS)}", url=url)
        columns = [shards[c] for c in _COLUMNS]
        count = len(columns[0]) if isinstance(columns[0], list) else -1
        if not all(isinstance(c, list) and len(c) == count for c in columns):
            raise ManifestError(f"split {name!r}: shard columns must be lists of equal length", url=url)
        names, samples, units, sizes, sha, index, index_bytes, index_sha = columns
        ints = (samples, units, sizes, index_bytes)
        if not all(type(v) is int and 0 <= v < 1 << 62 for column in ints for v in column) or \
                not all(isinstance(v, str) and _SHA_RE.fullmatch(v) for column in (sha, index_sha) for v in column) or \
                not all(isinstance(v, str) and _shard_name_ok(v, origin) for v in names) or \
                not all(isinstance(v, str) and _INDEX_RE.fullmatch(v) for v in index):
            raise ManifestError(f"split {name!r}: a shard entry of the wrong type or form", url=url)
        bad = [n for n, s, u in zip(names, samples, units) if u < s or (u and not s)]
        if bad:
            raise ManifestError(f"split {name!r}: shard {bad[0]!r} has fewer units than samples", url=url)
        split = cls([ShardInfo(*row[:5], IndexInfo(*row[5:])) for row in zip(*columns)])
        if (obj.get("samples"), obj.get("units")) != (split.samples, split.units):
            raise ManifestError(f"split {name!r} says {obj.get('samples')} samples and {obj.get('units')} units, "
                                f"its shards hold {split.samples} and {split.units}", url=url)
        return split


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A dataset's manifest: its kind, splits, packing options and origin (`to_json`, `from_json`)."""

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
            raise ConfigError(f"origin must be one of {ORIGINS}, got {self.origin!r}")
        if (self.origin == "indexed") != bool(self.members) or list(self.members) != sorted(set(self.members)) or \
                not all(isinstance(e, str) and _EXT_RE.fullmatch(e) for e in self.members):
            raise ConfigError(f"members {self.members!r}: a dataset indexed in place lists its member extensions "
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
            raise ManifestError(f"not valid JSON: {exc!r}"[:300], url=url) from exc
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ManifestError(f"not a {FORMAT} manifest", url=url)
        version = obj.get("schema_version")
        if version not in _READABLE_VERSIONS:
            raise ManifestError(f"schema version {version!r}; this version reads {list(_READABLE_VERSIONS)}", url=url)
        if obj.get("kind") not in KIND_NAMES:
            raise ManifestError(f"unknown kind {obj.get('kind')!r}; known: {sorted(KIND_NAMES)}", url=url)
        try:
            origin, members = (obj["origin"], obj["members"]) if version >= 4 else ("packed", [])
            if origin not in ORIGINS or not isinstance(members, list):
                raise ManifestError(f"origin {origin!r} (want one of {list(ORIGINS)}) or members {members!r}"[:300],
                                    url=url)
            if version >= 3:
                splits = {name: Split.from_json(split, url, name, origin) for name, split in obj["splits"].items()}
            else:
                splits = {name: Split(tuple(_legacy_shard(s, url) for s in split["shards"]))
                          for name, split in obj["splits"].items()}
            manifest = cls(obj["kind"], splits, obj["options"], obj["fingerprint"], tuple(obj["skipped"]), version,
                           origin, tuple(members))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:  # (ValueError: Manifest's own checks)
            raise ManifestError(f"invalid manifest: {exc!r}"[:500], url=url) from exc
        # A packed shard belongs to one split; an archive indexed in place may serve several (each split's
        # index lists only its samples), but is listed once per split. Index files are never shared.
        per_split = [split.names for split in manifest.splits.values()] if origin == "indexed" else \
            [[n for split in manifest.splits.values() for n in split.names]]
        indexes = [i.name for split in manifest.splits.values() for i in split.indexes if i is not None]
        for listed in (*per_split, indexes):
            if len(set(listed)) != len(listed):
                twice = sorted({n for n in listed if listed.count(n) > 1})
                raise ManifestError(f"{twice[0]!r} is listed more than once: its samples would be read twice", url=url)
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
        raise ManifestError(f"invalid shard entry: {exc!r}", url=url) from exc
    if not ok or not isinstance(obj.get("name"), str) or _SHARD_RE.fullmatch(obj["name"]) is None:
        raise ManifestError(f"inconsistent shard entry {obj.get('name')!r}", url=url)
    index = ShardIndex.of_offsets(keys, offsets, units)
    return ShardInfo(obj["name"], len(keys), int(index.units.sum()), size, obj["sha256"], None, index)

