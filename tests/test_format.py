"""pipeline.format as a module: arrays, column blocks, keys and msgpack records."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from pipeline.format import (
    BFLOAT16, COLUMN_ALIGN, KIND_NAMES, check_key, column_offsets, decode_array, encode_array, pack_columns,
    pack_record, unpack_columns, unpack_record,
)

ARRAYS = [np.arange(12, dtype=np.int64).reshape(3, 4), np.array([True, False]), np.zeros((0, 5), np.float32),
          np.array([1.5, -0.0], dtype=">f8"), np.arange(7, dtype=np.uint16), np.float16(3.0) * np.ones((2, 2, 2))]


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype.str}{a.shape}")
def test_encode_decode_array_round_trip(array):
    obj = encode_array(array)
    assert set(obj) == {"dtype", "shape", "data"} and obj["dtype"][0] in "<|"  # little-endian on disk
    back = decode_array(unpack_record(pack_record({"a": obj}))["a"])
    assert back.shape == array.shape and np.array_equal(back, array) and back.dtype.byteorder != ">"


@pytest.mark.parametrize(("obj", "message"), [
    ([1, 2], "not an encoded array"),
    ({"dtype": "<i8", "shape": [1]}, "not an encoded array"),
    ({"dtype": "|O", "shape": [1], "data": b"x" * 8}, "not allowed"),
    ({"dtype": "<i8", "shape": [-1], "data": b""}, "invalid array shape"),
    ({"dtype": "<i8", "shape": [2], "data": b"x" * 8}, "does not match"),
])
def test_decode_array_refuses_anything_else(obj, message):
    with pytest.raises(ValueError, match=message):
        decode_array(obj)


def test_encode_array_refuses_objects_and_complex():
    for array in (np.array([object()]), np.array([1j])):
        with pytest.raises(ValueError, match="cannot be stored"):
            encode_array(array)


def test_pack_unpack_columns_round_trip_aligned():
    columns = [("row", "int64", np.arange(5, dtype=np.int64)), ("flag", "bool", np.ones(5, bool)),
               ("emb", BFLOAT16, np.arange(15, dtype=np.uint16).reshape(5, 3)),
               ("x", "float32", np.linspace(0, 1, 10, dtype=np.float32).reshape(5, 2))]
    table, data = pack_columns(columns)
    out = unpack_columns(table, data)
    assert list(out) == [name for name, _, _ in columns]
    for name, dtype, array in columns:
        assert out[name][0] == dtype and np.array_equal(out[name][1], array)
    offsets, end = column_offsets([(name, dtype, array.shape) for name, dtype, array in columns])
    assert all(offset % COLUMN_ALIGN == 0 for offset in offsets) and end == len(data)
    assert [column[3] for column in unpack_record(table)["columns"]] == offsets


def test_unpack_columns_refusals():
    table, data = pack_columns([("a", "int32", np.arange(3, dtype=np.int32)), ("b", "uint8", np.ones(3, np.uint8))])
    with pytest.raises(ValueError, match="data bytes"):
        unpack_columns(table, data + b"\0")
    obj = unpack_record(table)
    obj["columns"][1][3] += 1
    with pytest.raises(ValueError, match="column offsets"):
        unpack_columns(pack_record(obj), data)
    obj = unpack_record(table)
    obj["columns"][0][1] = "complex64"
    with pytest.raises(ValueError, match="invalid column entry"):
        unpack_columns(pack_record(obj), data)
    obj = unpack_record(table)
    obj["columns"][1][0] = "a"
    with pytest.raises(ValueError, match="duplicate column names"):
        unpack_columns(pack_record(obj), data)
    with pytest.raises(ValueError, match="not a column table"):
        unpack_columns(pack_record({"rows": 3}), data)


def test_pack_columns_refusals():
    with pytest.raises(ValueError, match="3 rows"):
        pack_columns([("a", "int32", np.zeros(3, np.int32)), ("b", "int32", np.zeros(2, np.int32))])
    with pytest.raises(ValueError, match="array of int64 given for dtype int32"):
        pack_columns([("a", "int32", np.zeros(3, np.int64))])
    with pytest.raises(ValueError, match="want a name like a Python identifier"):
        pack_columns([("no-dash", "int32", np.zeros(3, np.int32))])


@pytest.mark.parametrize("key", ["a", "sa_1", "A-b_9", "x" * 80])
def test_check_key_accepts_flat_names(key):
    assert check_key(key) == key


@pytest.mark.parametrize("key", ["", "a/b", "../x", "a.b", "a b", "é", "x" * 81])
def test_check_key_refuses_the_rest(key):
    with pytest.raises(ValueError, match="invalid sample key"):
        check_key(key)


def test_unpack_record_refuses_extension_types():
    data = msgpack.packb({"a": msgpack.ExtType(5, b"xyz")}, use_bin_type=True)
    with pytest.raises(ValueError, match="extension type 5"):
        unpack_record(data)


def test_records_round_trip_and_kind_names():
    record = {"a": 1, "b": [1.5, "x"], "c": b"\0\1"}
    assert unpack_record(pack_record(record)) == record
    assert set(KIND_NAMES) == {"sa1b", "vqa", "embeddings", "webdataset"}
