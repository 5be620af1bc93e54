"""`shard-pack link`: vectors an `embeddings` dataset holds already (a teacher's, packed earlier by
`shard-pack embeddings`) attached to another dataset's samples by key, without repacking.

The join is made once, here, never by a loader: each block's id column is read (its column table
and the id bytes, by range; never the vectors), each sample's key gives its id (`--key-pattern`'s
one group, a number), and a linked sidecar (`pipeline.format.outputs`, `Linked`) is written: per
shard of the dataset, the (shard, start, end) of each plan item's row in the vectors' column, or
`MISSING`. The loader attaches it as any sidecar (`attach={name: OUT}`) and reads each row's bytes
straight from the embeddings' shards: mapped, by range or through the shard cache."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from pipeline.errors import ConfigError, DatasetError, ShardError, ShardstreamError
from pipeline.format import EMB_DATA, EMB_ROW, EMB_TABLE, Manifest, ShardInfo, column_offsets, storage_dtype, \
    unpack_record
from pipeline.format.outputs import (
    ALL_EPOCHS, MISSING, OUTPUT_DTYPES, OUTPUTS_NAME, FileRef, Linked, OutputField, OutputsManifest, check_field_name,
    item_index_name, pack_item_index,
)
from pipeline.index import SplitIndex
from pipeline.kinds.embeddings import Embeddings
from pipeline.outputs.of import KEYS, outputs_of
from pipeline.storage import Retry, ShardReader, filesystem, join, read_manifest, shard_url, write_bytes
from pipeline.tario import BLOCK
from pipeline.kinds import KINDS as READING
from shard_tools.flags import Subparsers, quiet, storage
from shard_tools.kinds import KINDS

__all__ = ["LinkSummary", "link", "add_link", "run_link", "linked_shards", "check_rows"]

_IDS = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


@dataclasses.dataclass(frozen=True)
class LinkSummary:
    """What a link found: rows scanned, samples (and plan items) matched and missing, a few missing keys."""

    out: str
    rows: int
    samples: int
    matched: int
    missing_keys: tuple[str, ...]

    def lines(self) -> list[str]:
        missing = self.samples - self.matched
        lines = [f"link: {self.out}: {self.matched} of {self.samples} samples matched to a row of {self.rows}"]
        if missing:
            lines.append(f"link: {missing} samples have no row (attaching them is an error naming the sample, or a "
                         f"skip counted under on_error='skip'), e.g. {', '.join(self.missing_keys)}")
        return lines


@dataclasses.dataclass(frozen=True)
class _Rows:
    """The rows of the embeddings' split, sorted by id: each one's id, shard, and start of its vector."""

    ids: np.ndarray  # uint64, sorted
    shards: np.ndarray
    starts: np.ndarray
    nbytes: int  # a vector's bytes


def _field(embeddings: Manifest, name: str, url: str, integer: bool) -> Any:
    schema = Embeddings.for_verify(embeddings).options.schema
    field = next((f for f in schema if f.name == name), None)
    if field is None:
        raise ConfigError(f"{url}: no field {name!r}; its fields are {[f.name for f in schema]}")
    if integer and (field.dtype not in _IDS or field.shape):
        raise ConfigError(f"{url}: id field {name!r} is {field.dtype}{list(field.shape)}: want one integer per row")
    if not integer and field.dtype not in OUTPUT_DTYPES:
        raise ConfigError(f"{url}: field {name!r} is {field.dtype}: a sidecar field is one of {OUTPUT_DTYPES}")
    return field


def _block(reader: ShardReader, info: ShardInfo, members: Sequence[tuple[str, int, int]], fields: tuple[Any, Any],
           key: str) -> tuple[np.ndarray, int, int]:
    """A block's ids (as stored) and its vectors' column: (ids, offset in the shard, rows), from its
    column table (its layout, and the two fields' dtypes and shapes, checked) and its id bytes alone."""
    url, by_ext = shard_url(reader.root, info.name), {ext: (at + BLOCK, size) for ext, at, size in members}
    if set(by_ext) != {EMB_TABLE, EMB_DATA}:
        raise ShardError(f"members {sorted(by_ext)}, expected {sorted([EMB_TABLE, EMB_DATA])}", url=url, key=key)
    way = reader.way(info)
    (table_at, table_size), (data_at, data_size) = by_ext[EMB_TABLE], by_ext[EMB_DATA]
    try:
        table = unpack_record(bytes(way.read(table_at, table_at + table_size)))
        rows, given = int(table["rows"]), table["columns"]
        layout = [(c[0], c[1], tuple(c[2])) for c in given]
        offsets, end = column_offsets(layout)
        at = {name: (offset, dtype, shape) for (name, dtype, shape), offset in zip(layout, offsets)}
        if [c[3] for c in given] != offsets or end != data_size or layout[0][0] != EMB_ROW \
                or any(at[f.name][1:] != (f.dtype, (rows, *f.shape)) for f in fields):
            raise ValueError(f"columns {[c[:3] for c in given]!r:.300}, offsets {[c[3] for c in given]}, "
                             f"{data_size} data bytes")
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ShardError(f"invalid column table, or one other than the manifest's schema: {exc}", url=url,
                         key=key) from exc
    (id_at, id_dtype, _), (vector_at, _, _) = at[fields[0].name], at[fields[1].name]
    dtype = storage_dtype(id_dtype)
    ids = np.frombuffer(way.read(data_at + id_at, data_at + id_at + rows * dtype.itemsize), dtype)
    return ids, data_at + vector_at, rows


def _rows(embeddings: str, manifest: Manifest, split: str, fields: tuple[Any, Any], nbytes: int,
          reader: ShardReader, progress: bool) -> _Rows:
    """Every row of the split: its id, shard and vector's start (blocks read 8 at a time)."""
    shards = manifest.splits[split]
    blocks = [(number, info, index, i) for number, info in enumerate(shards)
              for index in [reader.index(info)] for i in range(index.samples)]
    ids, where, starts = [], [], []
    with concurrent.futures.ThreadPoolExecutor(8) as pool, \
            tqdm(total=len(blocks), unit="block", disable=not (progress and sys.stderr.isatty())) as bar:
        found = pool.map(lambda b: _block(reader, b[1], b[2].sample_members(b[3]), fields, b[2].key(b[3])), blocks)
        for (number, info, index, i), (block_ids, vectors, rows) in zip(blocks, found):
            if block_ids.dtype.kind == "i" and (block_ids < 0).any():
                raise ShardError(f"negative {fields[0].name}: a key's number is never negative",
                                 url=shard_url(embeddings, info.name), key=index.key(i))
            ids.append(block_ids.astype(np.uint64))
            where.append(np.full(rows, number, dtype=np.int64))
            starts.append(vectors + np.arange(rows, dtype=np.int64) * nbytes)
            bar.update()
    all_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint64)
    order = np.argsort(all_ids, kind="stable")
    rows = _Rows(all_ids[order], np.concatenate(where or [np.zeros(0, np.int64)])[order],
                 np.concatenate(starts or [np.zeros(0, np.int64)])[order], nbytes)
    twice = np.flatnonzero(rows.ids[1:] == rows.ids[:-1])
    if len(twice):
        same = rows.ids[twice[0]]
        raise DatasetError(f"{fields[0].name} {int(same)} is in {int((rows.ids == same).sum())} rows of split "
                           f"{split!r}: a sample would match several", url=embeddings)
    return rows


def _number(key: str, pattern: re.Pattern[str], base: int, url: str) -> int:
    found = pattern.search(key)
    try:
        value = int(found.group(1), base) if found else -1
    except (IndexError, ValueError):
        value = -1
    if not 0 <= value < 1 << 64:
        raise ConfigError(f"{url}: key {key!r}: --key-pattern {pattern.pattern!r} finds no number in it (base {base}) "
                          "in [0, 2**64)")
    return value


def _find(ordered: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Where each wanted value is in `ordered` (sorted, distinct), or -1."""
    at = np.clip(np.searchsorted(ordered, wanted), 0, max(len(ordered) - 1, 0))
    return np.where(ordered[at] == wanted, at, -1) if len(ordered) else np.full(len(wanted), -1)


def _table(keys: list[str], units: np.ndarray, rows: _Rows, pattern: re.Pattern[str], base: int,
           url: str) -> tuple[np.ndarray, np.ndarray]:
    """A shard's item index (a row per plan item: each sample's, repeated per unit where `units`) and
    which of its samples have a row."""
    at = _find(rows.ids, np.array([_number(k, pattern, base, url) for k in keys], dtype=np.uint64))
    found = at >= 0
    table = np.tile(np.array(MISSING, dtype=np.int64), (len(keys), 1))
    table[found] = np.stack([rows.shards[at], rows.starts[at], rows.starts[at] + rows.nbytes], axis=1)[found]
    return np.repeat(table, units, axis=0), found


def link(embeddings: str, dataset: str, split: str, out: str, *, id_field: str, field: str, name: str | None = None,
         key_pattern: str | None = None, key_base: int = 10, embeddings_split: str | None = None,
         storage_options: dict[str, Any] | None = None, retry: Retry = Retry(), progress: bool = True) -> LinkSummary:
    """Link the vectors of `field` of the `embeddings` dataset to the samples of `dataset`'s `split`:
    a linked sidecar at `out` (a new folder or prefix), its field `name` (default: `field`). Each
    sample's key gives a number (`key_pattern`: a regular expression whose one group is it, in
    `key_base`; default: the kind's `key_number`), matched to the row whose `id_field`
    holds it."""
    source = read_manifest(embeddings, storage_options, retry)
    target = read_manifest(dataset, storage_options, retry)
    if source.kind != "embeddings":
        raise ConfigError(f"{embeddings}: a {source.kind} dataset; link reads an embeddings dataset's vectors")
    if target.kind == "embeddings":
        raise ConfigError(f"{dataset}: an embeddings dataset's samples (blocks of rows) have no keys to link by")
    splits = sorted(source.splits)
    emb_split = embeddings_split or (splits[0] if len(splits) == 1 else None)
    if emb_split not in source.splits:
        raise ConfigError(f"{embeddings}: split {emb_split!r}: it has {splits} (--embeddings-split picks one)")
    if split not in target.splits:
        raise ConfigError(f"{dataset}: no split {split!r}; it has {sorted(target.splits)}")
    pattern, base = _pattern(key_pattern, key_base, target.kind)
    ids, vectors = _field(source, id_field, embeddings, True), _field(source, field, embeddings, False)
    output = OutputField(check_field_name(name or field), vectors.dtype, vectors.shape)
    fs, base_path = filesystem(out, storage_options)
    if fs.exists(base_path) and (fs.isfile(base_path) or fs.ls(base_path)):
        raise ConfigError(f"{out}: exists and is not empty: link writes a new sidecar")
    root = embeddings if "://" in embeddings else os.path.abspath(embeddings)
    rows = _rows(embeddings, source, emb_split, (ids, vectors), output.nbytes,
                 ShardReader(embeddings, storage_options, retry), progress)
    index = SplitIndex.of(dataset, target, split, READING[target.kind].units)
    try:
        refs, matched, missing = _indexes(fs, base_path, ShardReader(dataset, storage_options, retry), index, rows,
                                          (pattern, base), retry)
        if not matched:
            raise DatasetError(f"no sample of split {split!r} matched a row (of {len(rows.ids)}; first keys "
                               f"{', '.join(missing)}): is {id_field!r} the field of the keys' numbers, and "
                               f"{pattern.pattern!r} the pattern?", url=embeddings)
        of = outputs_of([target], split, None, [int(index.sizes.sum())], 0, KEYS)
        linked = Linked(root, source.fingerprint, emb_split, vectors.name, ids.name, pattern.pattern, base)
        manifest = OutputsManifest(of, (output,), True, {ALL_EPOCHS: ((), (tuple(refs),))}, linked)
        write_bytes(fs, join(base_path, OUTPUTS_NAME), manifest.to_bytes(), retry)
    except BaseException:
        if fs.exists(base_path):  # (it was not there, or empty: nothing of anyone else's is removed)
            fs.rm(base_path, recursive=True)
        raise
    return LinkSummary(out, len(rows.ids), int(index.first_sample[-1]), matched, tuple(missing))


def _indexes(fs: Any, base_path: str, reader: ShardReader, index: SplitIndex, rows: _Rows,
             pattern: tuple[re.Pattern[str], int], retry: Retry) -> tuple[list[FileRef], int, list[str]]:
    """Each shard's item index written: their files, the samples matched, the first 5 keys missing."""
    refs: list[FileRef] = []
    matched, missing = 0, []
    fs.makedirs(join(base_path, f"{ALL_EPOCHS}/index"), exist_ok=True)
    for number, info in enumerate(index.split):
        shard = reader.index(info)
        keys = shard.key_list()
        table, found = _table(keys, shard.units if index.by_units else np.ones(len(keys), np.int64), rows,
                              *pattern, shard_url(index.root, info.name))
        matched += int(found.sum())
        missing += [k for k, ok in zip(keys, found.tolist()) if not ok][: 5 - len(missing)]
        data, name = pack_item_index(table), item_index_name(ALL_EPOCHS, 0, number)
        write_bytes(fs, join(base_path, name), data, retry)
        refs.append(FileRef(name, len(data), hashlib.sha256(data).hexdigest()))
    return refs, matched, missing


def _pattern(text: str | None, base: int, kind: str) -> tuple[re.Pattern[str], int]:
    """`--key-pattern` compiled, with its base; default: the kind's (`PackingKind.key_number`)."""
    if text is None:
        default = KINDS[kind].key_number
        if default is None:
            raise ConfigError(f"{kind} keys have no default --key-pattern: give one (a regular expression whose one "
                              "group is the number in each key)")
        text, base = default
    if base not in (10, 16):
        raise ConfigError(f"--key-base {base}: want 10 or 16")
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise ConfigError(f"--key-pattern {text!r}: {exc}") from exc
    if pattern.groups != 1:
        raise ConfigError(f"--key-pattern {text!r}: want exactly one group (the number), it has {pattern.groups}")
    return pattern, base


def add_link(sub: Subparsers, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, parents=[quiet(), storage()], help="attach vectors an embeddings dataset holds (a "
                       "teacher's) to another dataset's samples by key: a linked sidecar, no repacking")
    p.add_argument("embeddings", metavar="EMBEDDINGS", help="the embeddings dataset (folder or URL)")
    p.add_argument("dataset", metavar="DATASET", help="the dataset whose samples the vectors are of")
    p.add_argument("out", metavar="OUT", help="the linked sidecar to write (a new folder or URL prefix)")
    p.add_argument("--split", required=True, help="DATASET's split")
    p.add_argument("--id-field", required=True, help="EMBEDDINGS's integer field holding each row's sample number")
    p.add_argument("--field", required=True, help="EMBEDDINGS's field of the vectors")
    p.add_argument("--name", help="the sidecar's field, attach={NAME: OUT} (default: --field)")
    defaults = "; ".join(f"{name}: {kind.key_number[0]} in base {kind.key_number[1]}" for name, kind in KINDS.items()
                         if kind.key_number)
    p.add_argument("--key-pattern", help="a regular expression whose one group is the number in a sample's key "
                   f"(default {defaults})")
    p.add_argument("--key-base", type=int, default=10, choices=(10, 16), help="--key-pattern's number's base (10)")
    p.add_argument("--embeddings-split", help="EMBEDDINGS's split (default: its only one)")
    return p


def run_link(args: argparse.Namespace) -> int:
    done = link(args.embeddings, args.dataset, args.split, args.out, id_field=args.id_field, field=args.field,
                name=args.name, key_pattern=args.key_pattern, key_base=args.key_base,
                embeddings_split=args.embeddings_split,
                storage_options=args.storage_options, progress=not args.quiet)
    print("\n".join(done.lines()))
    root = args.embeddings if "://" in args.embeddings else os.path.abspath(args.embeddings)
    print("attach: make_stream_loader(" + json.dumps(args.dataset) + ", " + json.dumps(args.split)
          + ", attach={" + json.dumps(args.name or args.field) + ": " + json.dumps(args.out) + "}, allowed_roots=["
          + json.dumps(root) + "], ...)")
    return 0


def linked_shards(manifest: OutputsManifest, storage_options: dict[str, Any] | None,
                  retry: Retry) -> tuple[Manifest | None, list[str]]:
    """The embeddings dataset a linked sidecar's records lie in (`shard-pack verify`), or None and why
    it is not the one linked."""
    linked = manifest.linked
    assert linked is not None
    try:
        source = read_manifest(linked.dataset, storage_options, retry)
    except (ShardstreamError, OSError) as exc:
        return None, [f"the embeddings linked, {linked.dataset}: {exc}"]
    if source.fingerprint != linked.fingerprint or linked.split not in source.splits:
        return None, [f"{linked.dataset}: fingerprint {source.fingerprint[:16]}, splits {sorted(source.splits)}: the "
                      f"sidecar was linked to {linked.fingerprint[:16]}, split {linked.split!r}: link it again"]
    return source, []


def check_rows(manifest: OutputsManifest, source: Manifest, table: np.ndarray, keys: Sequence[str | None] | None,
               storage_options: dict[str, Any] | None, retry: Retry) -> list[str]:
    """A linked sidecar's records (rows: shard, source, item, start, end) against the embeddings'
    rows, read again (`_rows`): each is the vector of a row, and with the samples' `keys`, the row
    whose id the key names; a record `MISSING` only where no row has that id."""
    linked, field = manifest.linked, manifest.fields[0]
    assert linked is not None
    fields = (_field(source, linked.id_field, linked.dataset, True),
              _field(source, linked.field, linked.dataset, False))
    rows = _rows(linked.dataset, source, linked.split, fields, field.nbytes,
                 ShardReader(linked.dataset, storage_options, retry), False)
    places = rows.shards << 40 | rows.starts  # (a vector's place: shard and start, one int)
    order = np.argsort(places)
    shards, starts = table[:, 0], table[:, 3]
    at = _find(places[order], shards << 40 | starts)
    said = np.where((shards >= 0) & (at >= 0), order[np.maximum(at, 0)], -1)  # the row each record is, or -1
    wrong = (shards >= 0) & ((said < 0) | (table[:, 4] - starts != field.nbytes))
    problems = [f"{linked.dataset}: item {item}'s record (shard {shard}, bytes {start}-{end}) is no row's "
                f"{linked.field}" for shard, _, item, start, end in table[wrong].tolist()]
    if keys is None:
        return problems
    pattern = re.compile(linked.key_pattern)
    checked = ~wrong & np.array([key is not None for key in keys], dtype=bool)
    wants = np.array([_number(key, pattern, linked.key_base, linked.dataset) if ok else 0
                      for key, ok in zip(keys, checked.tolist())], dtype=np.uint64)
    has = _find(rows.ids, wants)  # the row each key names, or -1
    for i in np.flatnonzero(checked & (said != has)).tolist():
        problems.append(f"sample {keys[i]!r} (item {int(table[i, 2])}): the link says " + (
            "no row" if said[i] < 0 else f"row of {linked.id_field} {int(rows.ids[said[i]])}") + ", the embeddings "
            "have " + (f"the row of {linked.id_field} {int(wants[i])}" if has[i] >= 0 else "none"))
    return problems
