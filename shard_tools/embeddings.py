"""Embeddings on the packing side: a folder of row-aligned arrays -> blocks of rows.

`EmbeddingsSource.load(DIR)` reads the schema (`DIR/schema.json` by default), opens every array
without copying it (`shard_tools.arrays`: `.npy` memory-mapped with `allow_pickle=False`;
`.safetensors` memory-mapped by the safetensors library, the `embeddings` extra; BF16 included) and
checks everything before a shard is written: lengths agree, floats are finite, declared ranges and
references hold, splits are disjoint row indices. Pickle-based files (`.pt`, `.pth`, ...) are
refused. A block is `rows_per_block` consecutive rows of a split (in row order), written as one
sample of typed columns (`pipeline.format.pack_columns`) with the rows' indices as column `row`.

Schema (unknown keys are errors; paths are relative to DIR):

    {"fields": {"question_emb": {"file": "question_emb.npy"},
                "negative_embs": {"file": "embs.safetensors", "tensor": "negatives"},
                "relevance": {"file": "relevance.npy", "range": [0, 1]},
                "cluster_id": {"file": "cluster_id.npy", "index_into": 512},
                "source_row": {"file": "pair_source.npy", "index_into": "sources.npy"}},
     "splits": {"train": "train_idx.npy", "val": {"file": "splits.safetensors", "tensor": "val"}}}

`range` is inclusive; `index_into` makes the field a reference into another table of that many
rows (a number, or an array whose length is the count). Without `splits`, every row is `train`.

`PACKING` declares the kind to `shard_tools.kinds`: its subcommand (`shard-pack embeddings`), its
preview (a table of the fields over the batch's rows) and its loader option as a flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image, ImageDraw

from pipeline.kinds.embeddings import Field, value_problem
from pipeline.errors import ConfigError, InputError, RowError
from pipeline.format import EMB_DATA, EMB_ROW, EMB_TABLE, pack_columns, storage_dtype
from pipeline.storage import sha256_file
from pipeline.tario import ReadLimits
import shard_tools.flags as flags
from shard_tools.arrays import file_stamp, mapped, open_array, split_rows
from shard_tools.drawing import BACKGROUND, PAD, TEXT, Drawing, Preview, font, line_height
from shard_tools.flags import Subparsers
from shard_tools.pack import PackOptions, PackSummary, Part, SampleRef, pack
from shard_tools.plugin import KindOption, PackingKind

__all__ = ["EmbeddingsSource", "PACKING", "SourceField", "SourceSplit", "open_array", "pack_embeddings", "SCHEMA_NAME"]

log = logging.getLogger(__name__)
SCHEMA_NAME = "schema.json"
BLOCK_BYTES = 4 << 20  # the default block: the most rows, a power of two, within this many bytes
MAX_BLOCK_ROWS = 1 << 16
_CHECK_BYTES = 64 << 20  # values are checked this much at a time
_SCHEMA_KEYS = {"fields", "splits"}
_FIELD_KEYS = {"file", "tensor", "range", "index_into"}
_ARRAY_KEYS = {"file", "tensor"}
_INTEGERS = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


# -- schema --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SourceField:
    """A field as packed: where its array is, what the schema declares, and the file's SHA-256."""

    field: Field
    file: str  # as the schema names it, relative to the folder
    tensor: str | None
    sha256: str
    index_into: int | str | dict[str, Any] | None = None  # as the schema states it
    stamp: tuple[int, int, int] = (0, 0, 0)  # (inode, size, mtime) when checked: encode refuses a changed file


@dataclasses.dataclass(frozen=True)
class SourceSplit:
    name: str
    file: str | None  # None: every row (a schema without splits)
    tensor: str | None
    rows: int
    sha256: str | None
    stamp: tuple[int, int, int] = (0, 0, 0)


def _array_ref(value: Any, url: str, where: str) -> tuple[str, str | None]:
    """(file, tensor) of a schema entry naming an array: "file" or {"file": ..., "tensor": ...}."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, dict):
        unknown = sorted(set(value) - _ARRAY_KEYS)
        if unknown:
            raise InputError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_ARRAY_KEYS)}", url=url)
        if isinstance(value.get("file"), str) and isinstance(value.get("tensor"), (str, type(None))):
            return value["file"], value.get("tensor")
    raise InputError(f"{where}: want a file name or {{\"file\": ..., \"tensor\": ...}}, got {value!r}"[:300], url=url)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class EmbeddingsSource:
    """A validated folder of arrays (see the module docstring); `load` builds it, `pack` writes it."""

    root: str
    fields: tuple[SourceField, ...]
    splits: tuple[SourceSplit, ...]
    rows: int
    rows_per_block: int
    unassigned: int = 0  # rows in no split (not packed)
    kind: str = dataclasses.field(default="embeddings", init=False)

    @classmethod
    def load(cls, root: str, schema: str | None = None, rows_per_block: int | None = None) -> EmbeddingsSource:
        """Read the schema and check every array and split; raises InputError (RowError for a bad
        value: file, field, row and value) before anything is written."""
        if rows_per_block is not None and (type(rows_per_block) is not int or rows_per_block < 1):
            raise ConfigError(f"rows_per_block must be an int >= 1, got {rows_per_block!r}")
        for where in (root, schema or ""):
            if "://" in where:  # (else a URL would read as a relative path, "not a folder")
                raise ConfigError(f"{where}: embeddings are packed from a local folder (their arrays are "
                                  "memory-mapped): copy them from object storage first; OUT may be a URL")
        root = os.path.abspath(root)
        schema_path, spec = _read_schema(root, schema)
        entries = [_open_field(root, schema_path, name, entry) for name, entry in spec["fields"].items()]
        rows = _common_rows(entries, schema_path)
        checked = [_checked_field(root, schema_path, entry) for entry in entries]
        fields = [field for field, _ in checked]
        problems = [problem for _, problem in checked if problem is not None]
        splits, assigned, split_problems = _source_splits(root, schema_path, spec.get("splits"), rows)
        problems += split_problems
        if problems:
            if len(problems) == 1:
                raise problems[0]
            raise InputError(f"{len(problems)} problems; nothing was written:\n  "
                             + "\n  ".join(str(p) for p in problems), url=schema_path) from problems[0]
        if not splits:
            splits, assigned[:] = [SourceSplit("train", None, None, rows, None)], True
        rows_per_block = _block_rows(fields, rows_per_block)
        unassigned = int(rows - assigned.sum())
        if unassigned:
            log.warning("%d of %d rows are in no split and are not packed", unassigned, rows)
        return cls(root, tuple(fields), tuple(splits), rows, rows_per_block, unassigned)

    # -- the pack driver's interface -------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "rows_per_block": self.rows_per_block,
            "unassigned_rows": self.unassigned,
            "fields": [{**f.field.to_json(), "file": f.file, "tensor": f.tensor, "index_into": f.index_into,
                        "sha256": f.sha256} for f in self.fields],
            "splits": [{"name": s.name, "file": s.file, "tensor": s.tensor, "rows": s.rows, "sha256": s.sha256}
                       for s in self.splits],
        }

    def _rows(self, split: SourceSplit) -> np.ndarray:
        if split.file is None:
            return np.arange(self.rows, dtype=np.int64)
        return split_rows(os.path.join(self.root, split.file), split.tensor, split.stamp)

    def index(self, sources: Sequence[str]) -> tuple[list[SampleRef], list[dict[str, str]]]:
        """One sample per block of each split: `rows_per_block` rows, in row order."""
        if [os.path.abspath(s) for s in sources] != [self.root]:
            raise ConfigError(f"this source packs {self.root}, not {list(sources)}")
        refs = []
        for split in self.splits:
            rows = self._rows(split)
            for block, start in enumerate(range(0, len(rows), self.rows_per_block)):
                chunk = rows[start : start + self.rows_per_block]
                first, last = int(chunk[0]), int(chunk[-1])
                parts = []  # each field's rows: from the first row's byte offset, as many bytes as the rows hold
                for f in self.fields:
                    path = os.path.join(self.root, f.file)
                    row_bytes = math.prod(f.field.shape) * storage_dtype(f.field.dtype).itemsize
                    offset = getattr(mapped(path, f.tensor, f.stamp)[0], "offset", 0) + first * row_bytes
                    label = f"{f.file}[rows {first}..{last}]"
                    parts.append((f.field.name, Part(path, offset, len(chunk) * row_bytes, label)))
                refs.append(SampleRef(f"{split.name}-{block:06d}", tuple(parts), split.name, len(chunk)))
        return refs, []

    def encode(self, ref: SampleRef) -> tuple[list[tuple[str, bytes]], dict[str, int]]:
        """The block's columns: `row` (the rows' indices), then each field's rows in its exact dtype."""
        split_name, _, number = ref.key.rpartition("-")
        split = next(s for s in self.splits if s.name == split_name)
        start = int(number) * self.rows_per_block
        rows = self._rows(split)[start : start + self.rows_per_block]
        contiguous = int(rows[-1]) - int(rows[0]) + 1 == len(rows)
        columns = [(EMB_ROW, "int64", rows)]
        for f in self.fields:
            array, dtype = mapped(os.path.join(self.root, f.file), f.tensor, f.stamp)
            values = array[int(rows[0]) : int(rows[-1]) + 1] if contiguous else array[rows]
            columns.append((f.field.name, dtype, np.asarray(values, dtype=storage_dtype(dtype))))
        table, data = pack_columns(columns)
        return [(EMB_TABLE, table), (EMB_DATA, data)], {"rows": len(rows)}


def _read_schema(root: str, schema: str | None) -> tuple[str, dict[str, Any]]:
    """(its path, the schema): a JSON object with a non-empty "fields" object and no unknown key."""
    schema_path = schema or os.path.join(root, SCHEMA_NAME)
    if not os.path.isdir(root):
        raise InputError("not a folder", url=root)
    try:
        with open(schema_path, "rb") as f:
            spec = json.loads(f.read())
    except FileNotFoundError as exc:
        raise InputError("no schema file: write one (see `shard-pack embeddings --help`) or pass "
                         "--schema", url=schema_path) from exc
    except ValueError as exc:
        raise InputError(f"not valid JSON: {exc}", url=schema_path) from exc
    if not isinstance(spec, dict) or not isinstance(spec.get("fields"), dict) or not spec["fields"]:
        raise InputError("want a JSON object with a non-empty \"fields\" object", url=schema_path)
    unknown = sorted(set(spec) - _SCHEMA_KEYS)
    if unknown:
        raise InputError(f"unknown key(s) {unknown}; allowed: {sorted(_SCHEMA_KEYS)}", url=schema_path)
    return schema_path, spec


class _FieldEntry(NamedTuple):
    """A field of the schema, its array opened (not yet checked)."""

    name: str
    file: str
    tensor: str | None
    value_range: list[float] | None
    index_into: Any
    array: np.ndarray
    dtype: str
    stamp: tuple[int, int, int]


def _open_field(root: str, schema_path: str, name: str, entry: Any) -> _FieldEntry:
    """Check one field's schema entry and open its array."""
    where = f"field {name!r}"
    if not name.isidentifier() or name == EMB_ROW or len(name) > 64:
        raise InputError(f"{where}: names are identifiers of at most 64 characters, not {EMB_ROW!r}", url=schema_path)
    if not isinstance(entry, dict):
        raise InputError(f"{where}: want an object with \"file\", got {entry!r}"[:300], url=schema_path)
    unknown = sorted(set(entry) - _FIELD_KEYS)
    if unknown:
        raise InputError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_FIELD_KEYS)}", url=schema_path)
    file, tensor = _array_ref({k: entry[k] for k in _ARRAY_KEYS if k in entry}, schema_path, where)
    rng = entry.get("range")
    is_range = isinstance(rng, list) and len(rng) == 2 and all(map(_number, rng)) and rng[0] <= rng[1]
    if rng is not None and not is_range:
        raise InputError(f"{where}: range must be [low, high] (finite numbers, low <= high), got {rng!r}",
                         url=schema_path)
    path = os.path.join(root, file)
    stamp = file_stamp(path) if os.path.isfile(path) else (0, 0, 0)
    array, dtype = open_array(path, tensor, file)
    return _FieldEntry(name, file, tensor, rng, entry.get("index_into"), array, dtype, stamp)


def _common_rows(entries: Sequence[_FieldEntry], schema_path: str) -> int:
    """The number of rows every field's array has (at least one)."""
    lengths = {e.name: len(e.array) if e.array.ndim else -1 for e in entries}
    if any(n < 0 for n in lengths.values()):
        raise InputError(f"fields must be arrays with a row axis; scalars: "
                         f"{[n for n, m in lengths.items() if m < 0]}", url=schema_path)
    if len(set(lengths.values())) != 1:
        listing = ", ".join(f"{e.file} ({e.name}): {lengths[e.name]}" for e in entries)
        raise InputError(f"fields disagree on their number of rows: {listing}", url=schema_path)
    rows = next(iter(lengths.values()))
    if rows == 0:
        raise InputError("the arrays have no rows", url=schema_path)
    return rows


def _reference_bound(root: str, schema_path: str, entry: _FieldEntry) -> int | None:
    """The rows a field's values index into (its "index_into": a count, or a table's length), if any."""
    if entry.index_into is None:
        return None
    if entry.dtype not in _INTEGERS:
        raise InputError(f"field {entry.name!r} has \"index_into\" but dtype {entry.dtype}; references are integers",
                         url=entry.file)
    if type(entry.index_into) is int and entry.index_into >= 1:
        return entry.index_into
    table, table_tensor = _array_ref(entry.index_into, schema_path, f"{entry.name}.index_into")
    table_array = open_array(os.path.join(root, table), table_tensor, table)[0]
    bound = len(table_array) if table_array.ndim else 0
    if bound < 1:
        raise InputError(f"referenced by field {entry.name!r}, but holds no rows", url=table)
    return bound


def _checked_field(root: str, schema_path: str, entry: _FieldEntry) -> tuple[SourceField, RowError | None]:
    """The field as packed, and the first of its values that breaks its limits, if any."""
    bound = _reference_bound(root, schema_path, entry)
    rng = entry.value_range
    field = Field(entry.name, entry.dtype, tuple(entry.array.shape[1:]), None if rng is None else tuple(rng), bound)
    problem = _check_values(entry.array, field, entry.file)
    sha = sha256_file(os.path.join(root, entry.file))
    return SourceField(field, entry.file, entry.tensor, sha, entry.index_into, entry.stamp), problem


def _source_splits(root: str, schema_path: str, splits_spec: Any,
                   rows: int) -> tuple[list[SourceSplit], np.ndarray, list[RowError]]:
    """The schema's splits, the rows they assign, and the problems of their index files."""
    splits, assigned, problems = [], np.zeros(rows, dtype=np.bool_), []
    if splits_spec is not None and (not isinstance(splits_spec, dict) or not splits_spec):
        raise InputError(f"splits: want an object of split name -> index file, got {splits_spec!r}"[:300],
                         url=schema_path)
    for name, value in (splits_spec or {}).items():
        if not name.isidentifier() or len(name) > 40:
            raise InputError(f"split {name!r}: names are identifiers of at most 40 characters", url=schema_path)
        file, tensor = _array_ref(value, schema_path, f"split {name!r}")
        path = os.path.join(root, file)
        stamp = file_stamp(path) if os.path.isfile(path) else (0, 0, 0)
        index, dtype = open_array(path, tensor, file)
        if dtype not in _INTEGERS or index.ndim != 1:
            raise InputError(f"split {name!r}: want a 1-D array of integer row indices, got {dtype}{list(index.shape)}",
                             url=file)
        problem = _check_split(np.asarray(index), name, file, rows, assigned)
        if problem is not None:
            problems.append(problem)
        splits.append(SourceSplit(name, file, tensor, len(index), sha256_file(path), stamp))
    return splits, assigned, problems


def _block_rows(fields: Sequence[SourceField], rows_per_block: int | None) -> int:
    """Rows per block: as asked (if a reader accepts blocks that big), else a power of two near `BLOCK_BYTES`."""
    row_bytes = sum(math.prod(f.field.shape) * storage_dtype(f.field.dtype).itemsize for f in fields) + 8
    if rows_per_block is None:
        rows_per_block = min(MAX_BLOCK_ROWS, 1 << max(0, (BLOCK_BYTES // row_bytes).bit_length() - 1))
    if rows_per_block * row_bytes > ReadLimits.max_member_bytes - 4096:
        raise ConfigError(f"rows_per_block={rows_per_block} makes blocks of {rows_per_block * row_bytes} bytes, more "
                          f"than a reader accepts ({ReadLimits.max_member_bytes}); use fewer rows per block")
    return rows_per_block


def _check_values(array: np.ndarray, field: Field, file: str) -> RowError | None:
    """The first row breaking the field's limits (NaN/Inf, declared range, reference bound), if any."""
    row_bytes = max(1, math.prod(field.shape) * array.dtype.itemsize)
    step = max(1, _CHECK_BYTES // row_bytes)
    for start in range(0, len(array), step):
        chunk = np.asarray(array[start : start + step])
        if chunk.dtype.byteorder == ">":
            chunk = chunk.astype(chunk.dtype.newbyteorder("<"))
        problem = value_problem(chunk, field.dtype, field, finite=True)
        if problem is not None:
            row, value, what = problem
            return RowError(what, url=file, field=field.name, row=start + row, value=value)
    return None


def _check_split(index: np.ndarray, name: str, file: str, rows: int, assigned: np.ndarray) -> RowError | None:
    """Split indices must be rows of the arrays, each once, in no other split; marks them in `assigned`."""
    field = f"splits.{name}"
    bad = np.flatnonzero((index < 0) | (index >= rows))
    if bad.size:
        return RowError(f"not a row index in [0, {rows})",
                        url=file, field=field, row=int(bad[0]), value=str(int(index[bad[0]])))
    if not index.size:
        return RowError("the split is empty", url=file, field=field, row=0, value="none")
    index = index.astype(np.int64)
    order = np.argsort(index, kind="stable")
    repeats = np.flatnonzero(np.diff(index[order]) == 0)
    if repeats.size:
        position = int(order[repeats[0] + 1])
        return RowError("this row is listed twice in the split",
                        url=file, field=field, row=position, value=str(int(index[position])))
    taken = np.flatnonzero(assigned[index])
    if taken.size:
        return RowError("this row is in an earlier split too",
                        url=file, field=field, row=int(taken[0]), value=str(int(index[taken[0]])))
    assigned[index] = True
    return None


def pack_embeddings(root: str, out: str, *, schema: str | None = None, rows_per_block: int | None = None,
                    options: PackOptions | None = None, progress: bool = True) -> PackSummary:
    """Check the arrays of folder `root` against their schema, then pack them into blocks at `out`.
    `options.splits` must be None: the schema's split index files say which rows go where."""
    options = options or PackOptions(splits=None)
    if options.splits is not None:
        raise ConfigError("embeddings take their splits from the schema's index files: use PackOptions(splits=None)")
    source = EmbeddingsSource.load(root, schema, rows_per_block)
    return pack(source, [source.root], out, options, progress=progress)


# -- `shard-pack embeddings` ------------------------------------------------------------------------

def _add(sub: Subparsers, name: str, dask: str) -> argparse.ArgumentParser:
    parents = [flags.quiet(), flags.shards("blocks", "data"), flags.workers(skipped=None, dask=dask), flags.storage()]
    p = sub.add_parser(name, parents=parents,
                       help="pack a folder of row-aligned arrays (.npy/.safetensors) described by a schema",
                       description="Check every array against the schema (lengths, NaN/Inf, declared ranges, "
                       "references, splits), then pack blocks of rows; nothing is written if a check fails. Schema: "
                       '{"fields": {"name": {"file": "name.npy", "tensor": "(in .safetensors)", "range": [low, high], '
                       '"index_into": rows or "table.npy"}, ...}, "splits": {"train": "train_idx.npy", ...}}')
    p.add_argument("source", metavar="DIR", help="folder of the arrays (and of schema.json)")
    p.add_argument("out", metavar="OUT", help=flags.OUT)
    p.add_argument("--schema", metavar="FILE", help=f"schema file (default: DIR/{SCHEMA_NAME})")
    p.add_argument("--rows-per-block", type=int,
                   help="rows per block (default: a power of two, blocks of at most 4 MiB)")
    return p


def _run(args: argparse.Namespace) -> int:
    options = flags.pack_options(args, splits=None, max_skipped=0)
    return flags.summary(pack_embeddings(args.source, args.out, schema=args.schema, rows_per_block=args.rows_per_block,
                                         options=options, progress=not args.quiet))


# -- `shard-pack preview`: the fields' statistics -----------------------------------------------------

def _table(batch: dict[str, torch.Tensor], tile: int, columns: int, bins: int = 32) -> Preview:
    """A row per field: dtype and per-row shape, min, mean, max over the batch, and a histogram (the
    batch's rows are its keys; `tile` and `columns` do not apply)."""
    line, hist_w = line_height(), 4 * bins
    names = [name for name in batch if name != EMB_ROW]
    columns_x = [PAD, 170, 330, 420, 510, 600]
    image = Image.new("RGB", (columns_x[-1] + hist_w + PAD, (len(names) + 2) * (line + 4) + PAD), BACKGROUND)
    draw = ImageDraw.Draw(image)
    rows = [str(r) for r in batch[EMB_ROW].tolist()]
    draw.text((PAD, PAD), f"{len(rows)} rows: " + ", ".join(rows[:12]) + (" ..." if len(rows) > 12 else ""),
              fill=TEXT, font=font())
    for x, head in zip(columns_x, ("field", "dtype (per row)", "min", "mean", "max", "histogram")):
        draw.text((x, PAD + line + 4), head, fill=TEXT, font=font())
    for k, name in enumerate(names):
        y = PAD + (k + 2) * (line + 4)
        values = batch[name].detach().cpu().to(torch.float64).flatten().numpy()
        low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
        cells = [name, f"{str(batch[name].dtype).removeprefix('torch.')} {tuple(batch[name].shape[1:])}",
                 f"{low:.4g}", f"{values.mean() if values.size else 0.0:.4g}", f"{high:.4g}"]
        for x, cell in zip(columns_x, cells):
            draw.text((x, y), cell, fill=TEXT, font=font())
        counts, _ = np.histogram(values, bins=bins, range=(low, high if high > low else low + 1))
        for b, c in enumerate(counts):
            bar = round(line * c / max(counts.max(), 1))
            left = columns_x[-1] + 4 * b
            draw.rectangle([left, y + line - bar, left + 2, y + line], fill=(90, 170, 250))
    return Preview(image, tuple(rows), ())


PACKING = PackingKind(
    add=_add, run=_run, preview=Drawing(_table, shows="embeddings: field statistics"),
    options=(KindOption("--fields", "embeddings: the fields to read, e.g. question_emb,relevance",
                        lambda t: tuple(t.split(","))),),
)
