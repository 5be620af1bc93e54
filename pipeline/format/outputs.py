"""The sidecar format: outputs computed from a dataset's samples (a teacher's embeddings, generated
captions), written by `pipeline.OutputWriter` and attached to the samples they were computed from.

A sidecar is a folder (or object-storage prefix) beside nothing: it names the dataset it is of.

- `outputs.json` (`OutputsManifest`), written last: what the outputs are of (the datasets'
  fingerprints, the split, each source's plan items, the kind and its options, the seed and the
  batch fields the outputs were computed from), each field's schema, and per epoch written (or
  "all", where the samples do not change with the epoch) its chunks and per-shard indexes.
- `<epoch>/r<rank>-<n>.tar`: a writing rank's chunks, each a run of records in the order written;
  a record is one tar member `<key>.<field>` per field: the raw little-endian bytes of a fixed field
  (its dtype and shape in the manifest), a msgpack map `{"v": value}` of a variable one. The key is
  the sample's, or where the writer was given none (`keyed` false: embeddings rows have no keys)
  `x<source>-<plan item>` (`record_key`).
- `<epoch>/r<rank>-<n>.json` (`Commit`): the chunk's size, SHA-256, records (source, plan item,
  start, end) and the writing loader's state after it; a chunk counts only once its commit exists.
- `<epoch>/index/s<source>-<shard>.idx`: per shard of each source, the record of each plan item
  of the shard in item order (`pack_item_index`: chunk number, start, end), made when the epoch is
  complete. The manifest grows with chunks and shards, never with records.

A linked sidecar (`shard-pack link`, `Linked`) holds no chunks: vectors an `embeddings` dataset
holds already, matched to the samples by key. Its one folder, `all`, has the item indexes alone,
and each record is a row's raw bytes in one field's column of that dataset: (shard number in its
split, start, end), or (-1, 0, 0) for a sample it has no row for.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import re
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.errors import ConfigError, DatasetError

__all__ = ["OUTPUTS_NAME", "OUTPUTS_FORMAT", "OUTPUTS_VERSION", "OUTPUT_DTYPES", "ALL_EPOCHS", "OutputField",
           "Commit", "OutputsManifest", "FileRef", "epoch_folder", "chunk_name", "commit_name", "item_index_name",
           "pack_item_index", "unpack_item_index", "item_index_items", "check_field_name", "record_key", "Linked",
           "MISSING"]

OUTPUTS_NAME = "outputs.json"
OUTPUTS_FORMAT = "shardstream-outputs"
OUTPUTS_VERSION = 1
OUTPUT_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")
ALL_EPOCHS = "all"  # the one pass of outputs that do not change with the epoch
_FIELD_RE = re.compile(r"[a-z][a-z0-9]{0,31}")
_INDEX_MAGIC = b"SSOUTIDX"
_INDEX_HEADER = struct.Struct("<8sIQ")  # magic, version, items
MISSING = (-1, 0, 0)  # a linked sidecar's record of a sample its dataset has no row for


def check_field_name(name: str) -> str:
    """An output field's name is its records' member extension: 1-32 lowercase letters and digits."""
    if not isinstance(name, str) or not _FIELD_RE.fullmatch(name):
        raise ConfigError(f"output field name {name!r}: want 1-32 lowercase letters and digits, starting with a "
                          "letter (it names the records' tar members, <key>.<field>)")
    return name


def record_key(key: str, source: int, item: int, keyed: bool) -> str:
    """The name a record's members carry: its sample's key, or (`keyed` false) its plan item's."""
    return key if keyed else f"x{source}-{item}"


def epoch_folder(epoch: int | None) -> str:
    """The folder of one epoch's outputs (None: outputs that serve every epoch)."""
    return ALL_EPOCHS if epoch is None else f"epoch-{epoch:06d}"


def chunk_name(folder: str, rank: int, number: int) -> str:
    return f"{folder}/r{rank:05d}-{number:06d}.tar"


def commit_name(folder: str, rank: int, number: int) -> str:
    return f"{folder}/r{rank:05d}-{number:06d}.json"


def item_index_name(folder: str, source: int, shard: int) -> str:
    return f"{folder}/index/s{source:03d}-{shard:06d}.idx"


@dataclasses.dataclass(frozen=True)
class OutputField:
    """One output field: a fixed array per sample (`dtype`, `shape`), or any msgpack value (dtype None)."""

    name: str
    dtype: str | None
    shape: tuple[int, ...] | None

    def __post_init__(self) -> None:
        check_field_name(self.name)
        if self.dtype is not None and (self.dtype not in OUTPUT_DTYPES or self.shape is None
                                       or not all(isinstance(n, int) and n >= 0 for n in self.shape)):
            raise DatasetError(f"output field {self.name!r}: dtype {self.dtype!r}, shape {self.shape!r}: want one "
                               f"of {OUTPUT_DTYPES} and a shape of non-negative ints")

    @property
    def fixed(self) -> bool:
        return self.dtype is not None

    @property
    def nbytes(self) -> int:
        """A fixed field's bytes per record."""
        assert self.shape is not None and self.dtype is not None
        itemsize = 2 if self.dtype == "bfloat16" else np.dtype(self.dtype).itemsize
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape or ())}" if self.fixed else "variable (msgpack)"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": None if self.shape is None else list(self.shape)}

    @classmethod
    def from_json(cls, obj: Any) -> OutputField:
        if not isinstance(obj, dict) or set(obj) != {"name", "dtype", "shape"}:
            raise DatasetError(f"not an output field: {obj!r:.200}")
        shape = obj["shape"]
        return cls(obj["name"], obj["dtype"], None if shape is None else tuple(shape))


@dataclasses.dataclass(frozen=True)
class FileRef:
    """A file of the sidecar, as its manifest lists it: name (inside the sidecar), bytes, SHA-256."""

    name: str
    bytes: int
    sha256: str

    def to_json(self) -> list[Any]:
        return [self.name, self.bytes, self.sha256]

    @classmethod
    def from_json(cls, obj: Any, folder: str) -> FileRef:
        ok = isinstance(obj, list) and len(obj) == 3 and isinstance(obj[0], str) and isinstance(obj[1], int) \
            and isinstance(obj[2], str) and re.fullmatch(r"[0-9a-f]{64}", obj[2]) is not None
        if not ok or not re.fullmatch(re.escape(folder) + r"/(index/)?[a-z0-9\-]+\.(tar|idx)", obj[0]):
            raise DatasetError(f"not a file of epoch folder {folder!r}: {obj!r:.200}")
        return cls(obj[0], obj[1], obj[2])


@dataclasses.dataclass(frozen=True)
class Commit:
    """A written chunk, committed: `records` rows (source, plan item, start, end) in write order; the
    writing loader's `state` after its last batch; `batches`: the rank's batches written by then;
    `last`: the rank's share of the epoch is complete; `of`: what the outputs are of (as the manifest
    will say: a writer started again with another loader is refused before the manifest exists)."""

    rank: int
    world_size: int
    number: int
    bytes: int
    sha256: str
    records: np.ndarray
    batches: int
    state: dict[str, Any]
    fields: tuple[OutputField, ...]
    keyed: bool
    last: bool
    of: dict[str, Any]

    def to_bytes(self) -> bytes:
        return json.dumps({"rank": self.rank, "world_size": self.world_size, "number": self.number, "keyed": self.keyed,
                           "of": self.of,
                           "bytes": self.bytes, "sha256": self.sha256,
                           "records": base64.b64encode(np.ascontiguousarray(self.records, "<i8").tobytes()).decode(),
                           "batches": self.batches, "state": self.state,
                           "fields": [f.to_json() for f in self.fields], "last": self.last},
                          sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, url: str) -> Commit:
        try:
            obj = json.loads(data)
            records = np.frombuffer(base64.b64decode(obj["records"], validate=True), "<i8").reshape(-1, 4)
            return cls(int(obj["rank"]), int(obj["world_size"]), int(obj["number"]), int(obj["bytes"]),
                       str(obj["sha256"]), records, int(obj["batches"]), dict(obj["state"]),
                       tuple(OutputField.from_json(f) for f in obj["fields"]), bool(obj["keyed"]), bool(obj["last"]),
                       dict(obj["of"]))
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise DatasetError(f"not a commit of the outputs writer: {exc}", url=url) from exc


@dataclasses.dataclass(frozen=True)
class Linked:
    """What a linked sidecar's records lie in: the `embeddings` dataset at `dataset` (its manifest's
    `fingerprint`), its `split`, and the column of its `field`; each sample matched to the row whose
    `id_field` is the number `key_pattern`'s one group finds in the sample's key (in `key_base`)."""

    dataset: str
    fingerprint: str
    split: str
    field: str
    id_field: str
    key_pattern: str
    key_base: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> Linked:
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(obj, dict) or sorted(obj) != sorted(names) \
                or not all(isinstance(obj[n], int if n == "key_base" else str) for n in names):
            raise DatasetError(f"not a link to a column of vectors: {obj!r:.200}")
        return cls(**obj)


@dataclasses.dataclass(frozen=True)
class OutputsManifest:
    """A sidecar's manifest (see the module docstring). `of`: what the outputs are of, compared with
    the loader that attaches them (`pipeline.outputs.attach`); `epochs`: per epoch folder, its
    chunks and, per source, per shard, its item index."""

    of: dict[str, Any]
    fields: tuple[OutputField, ...]
    keyed: bool  # records named by their samples' keys (else by their plan items: `record_key`)
    epochs: dict[str, tuple[tuple[FileRef, ...], tuple[tuple[FileRef, ...], ...]]]
    linked: Linked | None = None  # records in an embeddings dataset's column (`shard-pack link`), no chunks

    def field(self, name: str) -> OutputField:
        for field in self.fields:
            if field.name == name:
                return field
        raise KeyError(name)

    def to_bytes(self) -> bytes:
        epochs = {folder: {"chunks": [c.to_json() for c in chunks], "indexes": [[i.to_json() for i in source]
                                                                               for source in indexes]}
                  for folder, (chunks, indexes) in sorted(self.epochs.items())}
        linked = {} if self.linked is None else {"linked": self.linked.to_json()}
        return json.dumps({"format": OUTPUTS_FORMAT, "version": OUTPUTS_VERSION, "of": self.of,
                           "fields": [f.to_json() for f in self.fields], "keyed": self.keyed, "epochs": epochs,
                           **linked}, sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes, url: str) -> OutputsManifest:
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise DatasetError(f"not JSON: {exc}", url=url) from exc
        if not isinstance(obj, dict) or obj.get("format") != OUTPUTS_FORMAT:
            raise DatasetError(f"not a sidecar manifest (want format {OUTPUTS_FORMAT!r})", url=url)
        if obj.get("version") != OUTPUTS_VERSION:
            raise DatasetError(f"sidecar format version {obj.get('version')!r}; this shardstream reads "
                               f"{OUTPUTS_VERSION}", url=url)
        try:
            epochs = {}
            for folder, entry in obj["epochs"].items():
                if folder != ALL_EPOCHS and not re.fullmatch(r"epoch-\d{6}", folder):
                    raise DatasetError(f"epoch folder {folder!r}")
                epochs[folder] = (tuple(FileRef.from_json(c, folder) for c in entry["chunks"]),
                                  tuple(tuple(FileRef.from_json(i, folder) for i in source)
                                        for source in entry["indexes"]))
            linked = None if obj.get("linked") is None else Linked.from_json(obj["linked"])
            if linked is not None and (set(epochs) != {ALL_EPOCHS} or epochs[ALL_EPOCHS][0]):
                raise DatasetError("a linked sidecar has one folder, all, and no chunks")
            return cls(dict(obj["of"]), tuple(OutputField.from_json(f) for f in obj["fields"]), bool(obj["keyed"]),
                       epochs, linked)
        except (KeyError, TypeError, AttributeError, DatasetError) as exc:
            raise DatasetError(f"invalid sidecar manifest: {exc}", url=url) from exc


def pack_item_index(records: np.ndarray) -> bytes:
    """One shard's item index: (chunk number, start, end) of each plan item of the shard, in item order."""
    records = np.ascontiguousarray(records, dtype="<i8").reshape(-1, 3)
    return _INDEX_HEADER.pack(_INDEX_MAGIC, OUTPUTS_VERSION, len(records)) + records.tobytes()


def item_index_items(size: int) -> int:
    """The items an item index of `size` bytes holds (0 for one too small to be one)."""
    return max(0, (size - _INDEX_HEADER.size) // 24)


def unpack_item_index(data: bytes | memoryview, items: int, sizes: Sequence[int], url: str,
                      linked: bool = False) -> np.ndarray:
    """`pack_item_index`'s array, checked: `items` rows, each a record inside a chunk (of `sizes`
    bytes each; `linked`: a shard of the linked dataset, or `MISSING`)."""
    data = memoryview(data)
    if len(data) < _INDEX_HEADER.size:
        raise DatasetError("truncated item index", url=url)
    magic, version, count = _INDEX_HEADER.unpack(data[:_INDEX_HEADER.size])
    if magic != _INDEX_MAGIC or version != OUTPUTS_VERSION or count != items \
            or len(data) != _INDEX_HEADER.size + 24 * items:
        raise DatasetError(f"not an item index of {items} items (magic {magic!r}, version {version}, {count} items, "
                           f"{len(data)} bytes)", url=url)
    table = np.frombuffer(data[_INDEX_HEADER.size:], dtype="<i8").reshape(items, 3)
    chunk, start, end = table[:, 0], table[:, 1], table[:, 2]
    missing = (table == MISSING).all(axis=1) if linked else np.zeros(len(table), dtype=bool)
    ends = np.array(sizes, dtype=np.int64)[np.clip(chunk, 0, max(len(sizes) - 1, 0))] if len(sizes) else end - 1
    ok = missing | ((chunk >= 0) & (chunk < len(sizes)) & (start >= 0) & (start < end) & (end <= ends))
    if not ok.all():
        raise DatasetError("an item index names a record outside the chunks the manifest lists", url=url)
    return table

