"""Embeddings on the reading side: blocks of rows opened once, rows gathered into typed batches.

A sample is a block of rows (`pipeline.format.pack_columns`); the loader opens it once per worker
(`Embeddings.open`: zero-copy views, dtypes, shapes and row count checked against the manifest, declared
ranges and references checked), `decode` returns a light reference to the batch's rows of the
block, and `collate` gathers them block by block with `take` straight into one shared-memory
buffer, the blocks' rows side by side. `finish` cuts that buffer into one tensor per field (views,
exact dtypes, bfloat16 included).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack.exceptions
import numpy as np
import torch

from pipeline.collate import empty, rows as rows_of
from pipeline.errors import ConfigError, DatasetError, ManifestError, SampleError
from pipeline.format import (
    BFLOAT16, COLUMN_DTYPES, EMB_DATA, EMB_ROW, EMB_TABLE, Manifest, column_offsets, storage_dtype,
    unpack_columns,
)
from pipeline.kinds.schema import BatchField, every_option, problems
from pipeline.stats import Clock

__all__ = ["Field", "EmbeddingsOptions", "Block", "TORCH_DTYPES", "value_problem", "Embeddings"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "uint16": torch.uint16,
    "int32": torch.int32, "uint32": torch.uint32, "int64": torch.int64, "uint64": torch.uint64,
    "float16": torch.float16, BFLOAT16: torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
}
_FLOATS = ("float16", BFLOAT16, "float32", "float64")


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of the dataset: its dtype, its shape per row, and what its values may be."""

    name: str
    dtype: str
    shape: tuple[int, ...] = ()  # per row
    range: tuple[float, float] | None = None  # declared, inclusive
    bound: int | None = None  # the values index another table of `bound` rows: each in [0, bound)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier() or self.name == EMB_ROW:
            raise ConfigError(f"field name must be an identifier other than {EMB_ROW!r}, got {self.name!r}")
        if self.dtype not in COLUMN_DTYPES:
            raise ConfigError(f"field {self.name!r}: dtype {self.dtype!r} not allowed; allowed: {list(COLUMN_DTYPES)}")
        if not isinstance(self.shape, tuple) or not all(type(d) is int and d >= 0 for d in self.shape):
            raise ConfigError(f"field {self.name!r}: shape must be a tuple of ints >= 0, got {self.shape!r}")
        if self.range is not None and not (
                isinstance(self.range, tuple) and len(self.range) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                        for v in self.range)
                and self.range[0] <= self.range[1]):
            raise ConfigError(f"field {self.name!r}: range must be (low, high) finite numbers, low <= high; "
                              f"got {self.range!r}")
        if self.bound is not None and (type(self.bound) is not int or self.bound < 1
                                       or self.dtype in _FLOATS + ("bool",)):
            raise ConfigError(f"field {self.name!r}: a reference bound must be an int >= 1 on an integer field, "
                              f"got {self.bound!r} on {self.dtype}")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "range": None if self.range is None else list(self.range), "bound": self.bound}


_ROW_FIELD = ("int64", ())
_SMALL_BYTES = 16  # per row: fields this small are gathered together


@dataclasses.dataclass(frozen=True)
class EmbeddingsOptions:
    """How blocks are read: the dataset's schema (from the manifest) and the user's choices.

    `fields` picks the fields batches hold (default: all; `row`, each row's index in the packed
    input arrays, is always there). `take` is a per-epoch schedule (curriculum): for a field with
    per-row shape (K, ...), the number of leading entries kept, e.g. `{"negative_embs": lambda
    epoch: min(1 + epoch, 7)}`; an int is the same for every epoch. `check_values` checks every
    opened block's floats for NaN/Inf (`shard-pack verify` does; declared ranges and references
    are always checked)."""

    schema: tuple[Field, ...]
    rows: int  # rows of the packed input arrays: `row` values lie in [0, rows)
    fields: tuple[str, ...] | None = None
    take: Mapping[str, int | Callable[[int], int]] | tuple[tuple[str, Any], ...] = ()
    check_values: bool = False

    def __post_init__(self) -> None:
        if not self.schema or not all(isinstance(f, Field) for f in self.schema):
            raise ConfigError("schema must be a non-empty tuple of Field")
        names = [f.name for f in self.schema]
        if len(set(names)) != len(names):
            raise ConfigError(f"schema has duplicate field names: {names}")
        if type(self.rows) is not int or self.rows < 1:
            raise ConfigError(f"rows must be an int >= 1, got {self.rows!r}")
        if self.fields is not None:
            fields = (self.fields,) if isinstance(self.fields, str) else tuple(self.fields)
            unknown = [f for f in fields if f not in names]
            if unknown or not fields or len(set(fields)) != len(fields):
                raise ConfigError(f"fields {list(fields)}: want distinct names among {names} (unknown: {unknown})")
            object.__setattr__(self, "fields", fields)
        take = tuple(sorted(dict(self.take).items()))  # picklable and hashable, whatever mapping was given
        object.__setattr__(self, "take", take)
        for name, value in take:
            field = self.field(name) if name in names else None
            if field is None or name not in self.selected:
                raise ConfigError(f"take: {name!r} is not a field batches hold ({list(self.selected)})")
            if not field.shape:
                raise ConfigError(f"take: field {name!r} has no axis to take from (one value per row)")
            if not callable(value):
                self._take(name, value, 0)
        if not isinstance(self.check_values, bool):
            raise ConfigError(f"check_values must be a bool, got {self.check_values!r}")

    def field(self, name: str) -> Field:
        return next(f for f in self.schema if f.name == name)

    @functools.cached_property
    def selected(self) -> tuple[str, ...]:
        return self.fields if self.fields is not None else tuple(f.name for f in self.schema)

    def _take(self, name: str, value: Any, epoch: int) -> int:
        count = self.field(name).shape[0]
        if type(value) is not int or not 0 <= value <= count:
            raise ConfigError(f"take[{name!r}] must be an int in [0, {count}] (or a function of the epoch giving one); "
                              f"got {value!r} for epoch {epoch}")
        return value

    def takes(self, epoch: int) -> dict[str, int]:
        """The leading entries each scheduled field keeps in `epoch`."""
        return {name: self._take(name, value(epoch) if callable(value) else value, epoch) for name, value in self.take}

    @functools.cached_property
    def small(self) -> np.dtype:
        """The record of a row's small fields (a few bytes each: `row` and the scalars), which a block
        keeps side by side so that a batch gathers them with one `take` per block, not one per field."""
        fields = [(EMB_ROW, *_ROW_FIELD)] + [(f.name, f.dtype, f.shape) for f in self.schema if f.name in self.selected]
        return np.dtype([(name, storage_dtype(dtype), shape) for name, dtype, shape in fields
                         if math.prod(shape) * storage_dtype(dtype).itemsize <= _SMALL_BYTES])

    def layout(self, epoch: int) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """(name, dtype, shape per row) of each field of a batch in `epoch`, `row` first."""
        takes = self.takes(epoch)
        out = [(EMB_ROW, *_ROW_FIELD)]
        for name in self.selected:
            field = self.field(name)
            shape = (takes[name], *field.shape[1:]) if name in takes else field.shape
            out.append((name, field.dtype, shape))
        return tuple(out)


def _parse_field(obj: Any, url: str) -> Field:
    try:
        rng = obj["range"]
        return Field(obj["name"], obj["dtype"], tuple(obj["shape"]), None if rng is None else tuple(rng), obj["bound"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"invalid embeddings field entry {obj!r}: {exc}"[:300], url=url) from exc


def _schema(manifest: Manifest, url: str) -> tuple[tuple[Field, ...], int]:
    kind_options = manifest.options.get("kind_options") if isinstance(manifest.options, Mapping) else None
    if not isinstance(kind_options, Mapping) or not isinstance(kind_options.get("fields"), list) \
            or type(kind_options.get("rows")) is not int:
        raise ManifestError("embeddings manifest without kind_options.fields and kind_options.rows", url=url)
    return tuple(_parse_field(f, url) for f in kind_options["fields"]), kind_options["rows"]


def _merge(a: Field, b: Field) -> Field:
    """One field of two datasets being mixed: the same dtype and shape; the looser declared limits."""
    if (a.dtype, a.shape) != (b.dtype, b.shape):
        raise DatasetError(f"cannot mix datasets whose field {a.name!r} differs: {a.dtype}{list(a.shape)} vs "
                           f"{b.dtype}{list(b.shape)}")
    rng = None if a.range is None or b.range is None else (min(a.range[0], b.range[0]), max(a.range[1], b.range[1]))
    bound = None if a.bound is None or b.bound is None else max(a.bound, b.bound)
    return Field(a.name, a.dtype, a.shape, rng, bound)


@dataclasses.dataclass(frozen=True, eq=False)
class Block:
    """An opened block: read-only views of its columns (the selected fields and `row`)."""

    url: str
    key: str
    rows: int
    columns: Mapping[str, np.ndarray]
    small: np.ndarray  # (rows, bytes): each row's small fields side by side (`EmbeddingsOptions.small`), a copy


class _Rows(NamedTuple):
    """What `decode` returns: rows of an opened block, and the epoch their batch is for."""

    block: Block
    units: np.ndarray
    epoch: int


def value_problem(values: np.ndarray, dtype: str, field: Field, finite: bool) -> tuple[int, str, str] | None:
    """(row, value, what is wrong) of the first row of `values` (rows first) that breaks the field's
    declared limits, or holds NaN/Inf with `finite`; None if all hold. bfloat16 comes as bit patterns."""
    if values.size == 0:
        return None
    flat = values.reshape(len(values), -1)
    numbers = (flat.astype(np.uint32) << 16).view(np.float32) if dtype == BFLOAT16 else flat
    checks = []
    if finite and dtype in _FLOATS:
        checks.append((~np.isfinite(numbers), "NaN or infinite"))
    if field.range is not None:
        low, high = field.range
        checks.append(((numbers < low) | (numbers > high), f"outside the declared range [{low}, {high}]"))
    if field.bound is not None:
        checks.append(((numbers < 0) | (numbers >= field.bound),
                       f"a reference outside [0, {field.bound}) (the referenced table's rows)"))
    for bad, what in checks:
        rows = bad.any(axis=1)
        if rows.any():
            row = int(rows.argmax())
            column = int(bad[row].argmax())
            value = numbers[row, column]
            shown = repr(float(value)) if dtype in _FLOATS else str(int(value))
            if values.ndim > 1:
                shown += f" at {[int(i) for i in np.unravel_index(column, values.shape[1:])]}"
            return row, shown, what
    return None




def _row_indices(columns: Mapping[str, Any], options: EmbeddingsOptions, units: int | None, url: str,
                 key: str) -> np.ndarray:
    """A block's `row` column, checked: int64 indices of at least one row, in [0, rows), `units` of them."""
    dtype, rows = columns[EMB_ROW]
    n = len(rows)
    if n < 1 or dtype != "int64" or rows.ndim != 1:
        raise SampleError(f"want int64 row indices of at least one row, got {dtype}{list(rows.shape)}",
                          url=url, key=key, field=EMB_ROW)
    if units is not None and n != units:
        raise SampleError(f"{n} rows, the manifest says {units}", url=url, key=key, field=EMB_ROW)
    if rows.min() < 0 or rows.max() >= options.rows:
        raise SampleError(f"row indices outside [0, {options.rows})", url=url, key=key, field=EMB_ROW)
    return rows


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    return tensor.view(torch.int16).numpy().view(np.uint16) if tensor.dtype == torch.bfloat16 else tensor.numpy()


def _value_problems(batch: dict[str, Any], options: EmbeddingsOptions) -> list[str]:
    """What is wrong with the values of a batch of the right keys, dtypes and shapes: row indices,
    NaN/Inf, declared ranges and references."""
    found = []
    rows = _numpy(batch[EMB_ROW])
    if rows.size and (rows.min() < 0 or rows.max() >= options.rows):
        found.append(f"{EMB_ROW}: indices outside [0, {options.rows})")
    if len(np.unique(rows)) != len(rows):
        found.append(f"{EMB_ROW}: a row appears twice in the batch")
    for name in options.selected:
        field = options.field(name)
        problem = value_problem(_numpy(batch[name]), field.dtype, field, finite=True)
        if problem is not None:
            row, value, what = problem
            found.append(f"{name}: row {int(rows[row])}: value {value}: {what}")
    return found


@dataclasses.dataclass(frozen=True)
class Embeddings:
    """The embeddings kind (`pipeline.kinds.Kind`): its options, and how its blocks become batches.
    Grouped: a batch's rows of one block are decoded together."""

    options: EmbeddingsOptions
    grouped = True
    units = True  # a block's rows
    stages = ()  # decode is one stage
    takes = frozenset(f.name for f in dataclasses.fields(EmbeddingsOptions)) - {"schema", "rows"}  # (the manifest's)

    @classmethod
    def of(cls, manifests: Sequence[Manifest], limits: Any, **options: Any) -> Embeddings:
        """The kind for one dataset, or several mixed (same fields, dtypes and shapes required)."""
        url = "manifest.json"
        schema, rows = _schema(manifests[0], url)
        for manifest in manifests[1:]:
            other, other_rows = _schema(manifest, url)
            if [f.name for f in other] != [f.name for f in schema]:
                raise DatasetError(f"cannot mix datasets with fields {[f.name for f in schema]} and "
                                   f"{[f.name for f in other]}")
            schema, rows = tuple(_merge(a, b) for a, b in zip(schema, other)), max(rows, other_rows)
        return cls(EmbeddingsOptions(schema, rows, **options))

    @classmethod
    def for_verify(cls, manifest: Manifest) -> Embeddings:
        """Every field of every row read and checked (`shard-pack verify`)."""
        schema, rows = _schema(manifest, "manifest.json")
        return cls(EmbeddingsOptions(schema, rows, check_values=True))

    def open(self, members: dict[str, bytes], *, url: str, key: str, units: int | None = None) -> Block:
        """A block's columns as views, after checking them against the schema (fields, dtypes, shapes,
        declared ranges and references; NaN/Inf too with `check_values`) and its rows against the
        `units` the manifest says it has (None: unchecked)."""
        options = self.options
        if set(members) != {EMB_TABLE, EMB_DATA}:
            raise SampleError(f"members {sorted(members)}, expected {sorted([EMB_TABLE, EMB_DATA])}", url=url, key=key)
        try:
            columns = unpack_columns(members[EMB_TABLE], members[EMB_DATA])
        except (ValueError, msgpack.exceptions.UnpackException) as exc:
            raise SampleError(f"invalid column table: {exc}", url=url, key=key, field=EMB_TABLE) from exc
        expected = [EMB_ROW] + [f.name for f in options.schema]
        if list(columns) != expected:
            raise SampleError(f"columns {list(columns)}, expected {expected}", url=url, key=key)
        rows = _row_indices(columns, options, units, url, key)
        kept = {EMB_ROW: rows}
        for field in options.schema:
            dtype, values = columns[field.name]
            if dtype != field.dtype or values.shape[1:] != field.shape:
                raise SampleError(f"{dtype}{list(values.shape[1:])} per row, the manifest says "
                                  f"{field.dtype}{list(field.shape)}", url=url, key=key, field=field.name)
            if field.range is not None or field.bound is not None or (options.check_values and field.dtype in _FLOATS):
                problem = value_problem(values, dtype, field, options.check_values)
                if problem is not None:
                    row, value, what = problem
                    raise SampleError(f"row {int(rows[row])}: value {value}: {what}", url=url, key=key,
                                      field=field.name)
            if field.name in options.selected:
                kept[field.name] = values
        small = np.empty(len(rows), options.small)
        for name in options.small.names:
            small[name] = kept[name]
        return Block(url, key, len(rows), kept, small.view(np.uint8).reshape(len(rows), options.small.itemsize))

    def decode(self, block: Block, *, unit: np.ndarray, seed: int, epoch: int, url: str, key: str,
               clock: Clock) -> _Rows:
        """The batch's rows of one block, as a reference: `collate` gathers them. (The plan gives rows
        below the manifest's count, which `open` checked against the block's.)"""
        return _Rows(block, unit, epoch)

    def collate(self, pieces: Sequence[_Rows], epoch: int) -> dict[str, Any]:
        """The batch in transit: one shared-memory byte buffer holding every field, and its layout.

        Each block's rows are gathered with one `take` per field into a contiguous stretch of the
        batch: a batch holds its rows grouped by block (~2x faster than scattering them to plan order)."""
        options = self.options
        b = sum(len(p.units) for p in pieces)
        layout = options.layout(pieces[0].epoch)  # (the epoch `decode` was given)
        offsets, total = column_offsets([(name, dtype, (b, *shape)) for name, dtype, shape in layout])
        flat = empty((total,), torch.uint8)
        array = flat.numpy()
        ends = np.cumsum([len(p.units) for p in pieces]).tolist()
        spans = list(zip([0] + ends[:-1], ends))
        small = np.empty((b, options.small.itemsize), np.uint8)  # (plain bytes: a structured dtype's take is slow)
        for (block, units, _), (start, stop) in zip(pieces, spans):
            block.small.take(units, 0, small[start:stop], "clip")
        shipped = []
        for (name, dtype, shape), offset in zip(layout, offsets):
            size = b * math.prod(shape) * storage_dtype(dtype).itemsize
            out = array[offset : offset + size].view(storage_dtype(dtype)).reshape(b, *shape)
            shipped.append((name, dtype, (b, *shape), offset))
            if name in options.small.names:
                at = options.small.fields[name][1]
                out[...] = small[:, at : at + out[0].nbytes].view(storage_dtype(dtype)).reshape(out.shape)
                continue
            cut = shape[:1] != options.field(name).shape[:1]  # a scheduled `take`
            for (block, units, _), (start, stop) in zip(pieces, spans):
                source = block.columns[name]
                # mode="clip": take's fast path (with "raise" it buffers `out`); `decode` checked the indices
                (source[:, : shape[0]] if cut else source).take(units, 0, out[start:stop], "clip")
        return {"buffer": flat, "layout": tuple(shipped)}

    def finish(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The batch users get: {field: tensor (B, ...)} in its exact dtype, views of the transit buffer
        on whatever device it was moved to."""
        buffer = batch["buffer"]
        out = {}
        for name, dtype, shape, offset in batch["layout"]:
            size = math.prod(shape) * storage_dtype(dtype).itemsize
            out[name] = buffer[offset : offset + size].view(TORCH_DTYPES[dtype]).view(shape)
        return out

    def unbatch(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        return rows_of(batch)

    def fields(self, epoch: int) -> tuple[BatchField, ...]:
        """A finished batch's fields in `epoch`: `row` and the selected fields, B rows each."""
        return tuple(BatchField(name, TORCH_DTYPES[dtype], ("B", *shape)) for name, dtype, shape
                     in self.options.layout(epoch))

    def depends(self, inputs: frozenset[str] | None) -> tuple[bool, frozenset[str]]:
        return every_option(self.options, any(callable(value) for _, value in self.options.take))

    def check(self, batch: dict[str, Any], epoch: int) -> list[str]:
        """What is wrong with a finished batch (empty if nothing): keys, dtypes and shapes (`fields`),
        then row indices, NaN/Inf, declared ranges and references."""
        return problems(batch, self.fields(epoch)) or _value_problems(batch, self.options)
