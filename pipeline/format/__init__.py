"""The on-disk format, in one place: manifest schema, shard indexes, shard names, sample members,
array encoding.

Both the packer (`shard_tools`) and the reader (`pipeline`) import this package; any change to what
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

One module per part, each importing the others by their own names; import from this package:
`manifest` (the manifest and its schema history), `index` (shard index files), `names` (keys,
member extensions, shard names), `members` (each kind's members and record fields), `records`
(msgpack records, arrays, column blocks), `safejson` (JSON from untrusted members).
"""

from __future__ import annotations

from pipeline.format.index import (
    BLOCK_BYTES, INDEX_EXT, INDEX_MAGIC, INDEX_VERSION, MAX_INDEX_BYTES, MAX_INDEX_SAMPLES, ShardIndex, index_name,
)
from pipeline.format.manifest import (
    FORMAT, MANIFEST_NAME, ORIGINS, SCHEMA_VERSION, IndexInfo, Manifest, ShardInfo, Split,
)
from pipeline.format.members import (
    EMB_DATA, EMB_ROW, EMB_TABLE, KIND_NAMES, SA1B_ANN, SA1B_JPG, SA1B_JSON, SA1B_RECORD_FIELDS, VQA_IMAGE_EXTS,
    VQA_IMAGE_FIELDS, VQA_QUESTION_FIELDS, VQA_RECORD, VQA_RECORD_FIELDS, WEBDATASET,
)
from pipeline.format.names import check_ext, check_key, check_shard_name, shard_name
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
    "BLOCK_BYTES",
    "INDEX_MAGIC",
    "MAX_INDEX_SAMPLES",
]
