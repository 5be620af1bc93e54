"""Record encodings: msgpack records (no extension types), numpy arrays as plain msgpack maps, and
the column blocks of an embeddings sample (`pack_columns`: a column table and the columns' raw
little-endian bytes, so a reader takes zero-copy views)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from pipeline.errors import ConfigError, DatasetError, excerpt

__all__ = [
    "BFLOAT16",
    "COLUMN_DTYPES",
    "COLUMN_ALIGN",
    "column_offsets",
    "storage_dtype",
    "pack_columns",
    "unpack_columns",
    "encode_array",
    "decode_array",
    "pack_record",
    "unpack_record",
]

# Embeddings blocks. The table (msgpack map) is {"rows": n, "columns": [[name, dtype, shape, offset], ...]}:
# shape starts with n, dtype is one of COLUMN_DTYPES, and each column's bytes start at `offset` in
# the data member: the first at 0, each next one at the first multiple of COLUMN_ALIGN after the
# one before (zero padding), the data ending with the last column. Nothing else is accepted.
BFLOAT16 = "bfloat16"  # numpy has no bfloat16: stored as its little-endian 16-bit patterns, read as torch.bfloat16
COLUMN_DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                 "float16", BFLOAT16, "float32", "float64")
COLUMN_ALIGN = 64
_COLUMN_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

_ARRAY_DTYPES = frozenset({"|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8", "|b1"})


def encode_array(array: np.ndarray) -> dict[str, Any]:
    """A numpy array as a plain msgpack map (dtype, shape, little-endian bytes): no pickle, no ext types."""
    array = np.ascontiguousarray(array)
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype.str not in _ARRAY_DTYPES:
        raise ConfigError(f"dtype {array.dtype} cannot be stored; allowed: {sorted(_ARRAY_DTYPES)}")
    return {"dtype": dtype.str, "shape": list(array.shape), "data": array.astype(dtype, copy=False).tobytes()}


def decode_array(obj: Any) -> np.ndarray:
    """Inverse of `encode_array`; raises ValueError on anything that is not exactly such a map."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise DatasetError("not an encoded array (want a map with dtype, shape, data)")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if dtype not in _ARRAY_DTYPES:
        raise DatasetError(f"array dtype {dtype!r} not allowed")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise DatasetError(f"invalid array shape {shape!r}")
    if not isinstance(data, bytes) or len(data) != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
        raise DatasetError(f"array data does not match dtype {dtype} and shape {shape}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def storage_dtype(name: str) -> np.dtype:
    """The little-endian numpy dtype holding a column dtype's values (bfloat16: its uint16 bit patterns)."""
    if name not in COLUMN_DTYPES:
        raise ConfigError(f"column dtype {name!r} not allowed; allowed: {list(COLUMN_DTYPES)}")
    return _STORAGE_DTYPES[name]


_STORAGE_DTYPES = {name: np.dtype("<u2" if name == BFLOAT16 else name).newbyteorder("<") for name in COLUMN_DTYPES}


def column_offsets(columns: Sequence[tuple[str, str, tuple[int, ...]]]) -> tuple[list[int], int]:
    """(offset of each column, end of the last) for (name, dtype, shape) columns laid out as a block's data
    member is (the embeddings table comment above): what packing writes and what batches in transit use."""
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
            raise ConfigError(f"column {name!r}: want a name like a Python identifier and {n} rows, got {array.shape}")
        if array.dtype.newbyteorder("<") != storage_dtype(dtype):
            raise ConfigError(f"column {name!r}: array of {array.dtype} given for dtype {dtype}")
    offsets, end = column_offsets(layout)
    data = bytearray(end)
    for (_, dtype, array), offset in zip(columns, offsets):
        raw = np.ascontiguousarray(array, dtype=storage_dtype(dtype)).tobytes()
        data[offset : offset + len(raw)] = raw
    table_columns = [[name, dtype, list(shape), offset] for (name, dtype, shape), offset in zip(layout, offsets)]
    table = {"rows": n, "columns": table_columns}
    return pack_record(table), bytes(data)


def unpack_columns(table: bytes, data: bytes) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (dtype, read-only view into `data`)} of a block; ValueError on anything `pack_columns`
    would not have written (unknown dtypes, lengths that disagree, offsets off the layout, extra bytes)."""
    obj = unpack_record(table)
    if set(obj) != {"rows", "columns"} or type(obj["rows"]) is not int or not isinstance(obj["columns"], list):
        raise DatasetError("not a column table (want a map with rows and columns)")
    n, layout, given = obj["rows"], [], []
    for column in obj["columns"]:
        if not (isinstance(column, list) and len(column) == 4 and isinstance(column[0], str)
                and _COLUMN_NAME_RE.fullmatch(column[0]) and column[1] in COLUMN_DTYPES
                and isinstance(column[2], list) and column[2][:1] == [n]
                and all(type(d) is int and d >= 0 for d in column[2]) and type(column[3]) is int):
            raise DatasetError(f"invalid column entry {excerpt(repr(column))}")
        layout.append((column[0], column[1], tuple(column[2])))
        given.append(column[3])
    if len({name for name, _, _ in layout}) != len(layout):
        raise DatasetError("duplicate column names")
    offsets, end = column_offsets(layout)
    if given != offsets or len(data) != end:
        raise DatasetError(f"column offsets {given} and {len(data)} data bytes, expected {offsets} and {end}")
    return {
        name: (dtype, np.frombuffer(data, storage_dtype(dtype), math.prod(shape), offset).reshape(shape))
        for (name, dtype, shape), offset in zip(layout, offsets)
    }


def pack_record(record: Mapping[str, Any]) -> bytes:
    return msgpack.packb(record, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise DatasetError(f"msgpack extension type {code} is not allowed")


def unpack_record(data: bytes) -> dict[str, Any]:
    """Unpack a msgpack map; every length is bounded by the input size and extension types are refused."""
    obj = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext)  # lengths capped at len(data)
    if not isinstance(obj, dict):
        raise DatasetError(f"record is a {type(obj).__name__}, want a map")
    return obj
