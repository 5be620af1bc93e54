"""`shard-pack inspect` and `verify` of a sidecar of outputs (`pipeline.format.outputs`, written by
`pipeline.OutputWriter`): what it is of, its fields and its epochs (one still being written: each
rank's commits); every chunk, item index and record checked against the manifest (an epoch still
being written: its committed chunks against their commits), and, where given, against the datasets
the outputs are of."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from pipeline.errors import ConfigError, DatasetError, SampleError, ShardError, ShardstreamError, excerpt
from pipeline.format import MANIFEST_NAME, ShardInfo, check_key, unpack_record
from pipeline.format.outputs import (
    ALL_EPOCHS, OUTPUTS_NAME, Commit, FileRef, OutputField, OutputsManifest, chunk_name, item_index_items,
    record_key, unpack_item_index,
)
from pipeline.index import SplitIndex, locate
from pipeline.outputs.epochs import COMMIT_RE, committed, listing, read_outputs
from pipeline.storage import Retry, ShardReader, filesystem, join, read_manifest, shard_url
from pipeline.tario import BLOCK, parse_sample
from shard_tools.link import check_rows, linked_shards

__all__ = ["describe_sidecar", "is_sidecar", "verify_sidecar"]

_FOLDER_RE = re.compile(rf"{ALL_EPOCHS}|epoch-\d{{6}}")


# -- what a sidecar's folder holds --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Sidecar:
    """A sidecar as found: its manifest (None until an epoch is complete) and, per epoch folder the
    manifest does not list (still being written), each rank's commits."""

    root: str
    manifest: OutputsManifest | None
    writing: dict[str, dict[int, list[Commit]]]


def is_sidecar(root: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether `root` is a sidecar of outputs rather than a dataset: it has no dataset manifest, and
    has an `outputs.json` or epoch folders holding commits (a sidecar still being written)."""
    fs, base = filesystem(root, storage_options)
    if fs.exists(join(base, MANIFEST_NAME)):
        return False
    if fs.exists(join(base, OUTPUTS_NAME)):
        return True
    return any(COMMIT_RE.fullmatch(name) for folder in listing(fs, base) if _FOLDER_RE.fullmatch(folder)
               for name in listing(fs, join(base, folder)))


def _read(root: str, storage_options: dict[str, Any] | None, retry: Retry) -> _Sidecar:
    """The sidecar at `root`: its manifest, and the commits of the epochs it does not list yet."""
    fs, base = filesystem(root, storage_options)
    manifest = read_outputs(fs, base, root, retry)
    writing = {}
    for folder in sorted(listing(fs, base)):
        if _FOLDER_RE.fullmatch(folder) and (manifest is None or folder not in manifest.epochs):
            ranks = committed(fs, base, root, folder, None, retry)
            assert isinstance(ranks, dict)
            if ranks:
                writing[folder] = ranks
    if manifest is None and not writing:
        raise DatasetError("not a sidecar of outputs: no outputs.json, and no epoch folder holding commits", url=root)
    return _Sidecar(root, manifest, writing)


# -- inspect ------------------------------------------------------------------------------------------

def describe_sidecar(root: str, storage_options: dict[str, Any] | None = None, retry: Retry = Retry()) -> list[str]:
    """A human summary of a sidecar: what it is of, its fields, and per epoch whether it is complete
    (chunks, bytes, records) or, still being written, each rank's committed batches and whether it
    is done. It reads the manifest and the commits of epochs still being written, never a chunk."""
    sidecar = _read(root, storage_options, retry)
    manifest = sidecar.manifest
    if manifest is not None:
        lines = [f"sidecar {root}", *_of_lines(manifest.of), _keys_line(manifest.keyed), *_field_lines(manifest.fields)]
        if (linked := manifest.linked) is not None:
            lines.append(f"linked to {linked.dataset} (fingerprint {linked.fingerprint[:16]}, split "
                         f"{linked.split}): each sample's record is the row of its field {linked.field} whose "
                         f"{linked.id_field} is the number {linked.key_pattern!r} finds in the sample's key (base "
                         f"{linked.key_base})")
        for folder, (chunks, indexes) in sorted(manifest.epochs.items()):
            records = sum(item_index_items(ref.bytes) for source in indexes for ref in source)
            held = f"{records} records in the linked dataset's shards" if linked else \
                f"{len(chunks)} chunks, {sum(c.bytes for c in chunks)} bytes, {records} records"
            lines.append(f"{_label(folder)}: complete, {held}")
    else:
        first = next(iter(next(iter(sidecar.writing.values())).values()))[0]
        lines = [f"sidecar {root}: no outputs.json yet (written once every rank's share of an epoch is committed)",
                 *_of_lines(first.of), _keys_line(first.keyed), *_field_lines(first.fields)]
    for folder, ranks in sidecar.writing.items():
        lines += _writing_lines(folder, ranks)
    return lines


def _label(folder: str) -> str:
    return f"{folder} (every epoch)" if folder == ALL_EPOCHS else folder


def _options(options: Any) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in sorted(dict(options or {}).items()))
    return f"options {shown or '(none)'}"


def _of_lines(of: dict[str, Any]) -> list[str]:
    """The manifest's `of`: the datasets (fingerprints), split, items per source, kind, inputs, seed, options."""
    datasets = ", ".join(str(f)[:16] for f in of.get("datasets") or ())
    items = ", ".join(str(n) for n in of.get("items") or ())
    inputs = "the whole sample" if of.get("inputs") is None else ", ".join(map(str, of["inputs"]))
    seed = f"seed {of.get('seed')} (they change with the epoch)" if of.get("by_epoch") else \
        "no seed (they do not change with the epoch: one pass serves every epoch)"
    return [f"of datasets {datasets} (fingerprints), split {of.get('split')}, {items} items, kind {of.get('kind')}",
            f"outputs of {inputs}; {seed}", _options(of.get("options"))]


def _keys_line(keyed: bool) -> str:
    return "records named by their samples' keys" if keyed else \
        "records named by their plan items (written without keys: x<source>-<item>)"


def _field_lines(fields: Sequence[OutputField]) -> list[str]:
    return [f"field {f.name}: {f.describe()}" for f in fields]


def _writing_lines(folder: str, ranks: dict[int, list[Commit]]) -> list[str]:
    """An epoch still being written: each rank's committed batches, chunks, bytes and records, and
    whether it is done."""
    world = max(c.world_size for commits in ranks.values() for c in commits)
    lines = [f"{_label(folder)}: being written by {world} ranks, not complete"]
    for rank in sorted(set(range(world)) | set(ranks)):
        commits = ranks.get(rank, [])
        if not commits:
            lines.append(f"  rank {rank}: nothing committed")
            continue
        last = commits[-1]
        lines.append(f"  rank {rank}: {last.batches} batches committed in {len(commits)} chunks, "
                     f"{sum(c.bytes for c in commits)} bytes, {sum(len(c.records) for c in commits)} records; "
                     + ("done" if last.last else "not done"))
    return lines


# -- verify -------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Samples:
    """The datasets a sidecar is of: per source its split's index, and a reader of its shard indexes
    (each record's sample key, as the loader finds it)."""

    sources: tuple[SplitIndex, ...]
    readers: tuple[ShardReader, ...]

    def keys(self, sources: np.ndarray, items: np.ndarray) -> list[str | None]:
        """The key of the sample of each (source, plan item); None for an item the datasets lack."""
        keys: list[str | None] = [None] * len(items)
        for source in np.unique(sources).tolist():
            if not 0 <= source < len(self.sources):
                continue
            index, reader = self.sources[source], self.readers[source]
            at = np.flatnonzero((sources == source) & (items >= 0) & (items < index.first_item[-1]))
            shard_indexes = {k: reader.index(index.split[k]) for k in np.unique(index.shards_of(items[at])).tolist()}
            numbers, _ = locate(index, items[at], {k: i.unit_starts for k, i in shard_indexes.items()})
            for row, number in zip(at.tolist(), numbers.tolist()):
                shard, within = index.where(number)
                keys[row] = shard_indexes[shard].key(within)
        return keys


@dataclasses.dataclass(frozen=True)
class _Records:
    """How records are checked: the fields each holds, and the name its members carry (its sample's
    key, looked up in the datasets where given; its plan item's where written without keys; else
    the key it carries)."""

    fields: tuple[OutputField, ...]
    keyed: bool
    samples: _Samples | None

    def names(self, rows: np.ndarray) -> list[str | None]:
        """The name each record (row: source, item, start, end) must carry (None: any key)."""
        if not self.keyed:
            return [record_key("", s, i, False) for s, i in rows[:, :2].tolist()]
        if self.samples is None:
            return [None] * len(rows)
        return self.samples.keys(rows[:, 0], rows[:, 1])

    def check(self, url: str, record: bytes | memoryview, where: str, expected: str | None) -> list[str]:
        """One record: members `<key>.<field>` named as `expected`, exactly the fields, in their order."""
        name = bytes(record[:100]).split(b"\0", 1)[0].decode("utf-8", "replace")
        key = name.partition(".")[0]
        try:
            check_key(key)
        except ConfigError:
            message = f"its first member's name, {excerpt(name, 40)}, is not <key>.<field>"
            return [f"{url}: {where}: {message}" if expected is None else
                    str(SampleError(f"its record ({where}): {message}", url=url, key=expected))]
        problems = []
        if expected is not None and key != expected:
            problems.append(str(SampleError(f"its record ({where}) is named {key!r}", url=url, key=expected)))
        try:
            members = parse_sample(record, url, key)
        except ShardstreamError as exc:  # (its byte offsets are the record's)
            return problems + [str(SampleError(f"in its record ({where}): {exc.message}", url=url, key=key))]
        wanted = [f.name for f in self.fields]
        if list(members) != wanted:
            return problems + [str(SampleError(f"members {list(members)}, the sidecar's fields are {wanted}",
                                               url=url, key=key))]
        return problems + [p for f in self.fields for p in _field_problems(f, members[f.name], url, key)]


def _field_problems(field: OutputField, data: memoryview, url: str, key: str) -> list[str]:
    """A fixed field of its exact size; a variable one a msgpack map {v: value}."""
    message = None
    if field.fixed:
        if len(data) != field.nbytes:
            message = f"{len(data)} bytes, {field.describe()} is {field.nbytes}"
    else:
        try:
            if set(unpack_record(bytes(data))) != {"v"}:
                message = "not an output value (want a map {v: value})"
        except (ValueError, TypeError) as exc:
            message = f"not an output value (want a msgpack map {{v: value}}): {excerpt(str(exc), 80)}"
    return [] if message is None else [str(SampleError(message, url=url, key=key, field=field.name))]


def verify_sidecar(root: str, *, datasets: Sequence[str] = (), progress: bool = True,
                   storage_options: dict[str, Any] | None = None, retry: Retry = Retry(),
                   allowed_roots: Sequence[str] = ()) -> list[str]:
    """Every problem in a sidecar: chunks and item indexes missing, or of another size or SHA-256 than
    the manifest lists; item indexes that do not cover each item of their shard once, or records
    that overlap or leave bytes of a chunk to no item; records whose tar members are not exactly the
    fields (`<key>.<field>`, a fixed field of its exact size, a variable one a map {v: value}). An
    epoch still being written is a problem, and its committed chunks are checked against their
    commits. With `datasets` (the roots the outputs are of, in order): their manifests' fingerprints
    are the sidecar's, and each record is named by its sample's key. Each chunk is read once, whole."""
    sidecar = _read(root, storage_options, retry)
    manifest = sidecar.manifest
    if datasets and manifest is None:
        raise ConfigError(f"--dataset: {root} has no outputs.json yet (records are checked against the dataset "
                          "once an epoch is complete); verify it without --dataset")
    problems: list[str] = []
    samples = None
    if manifest is not None and datasets:
        samples, problems = _samples(manifest.of, datasets, storage_options, retry, allowed_roots)
    reader = ShardReader(root, storage_options, retry)
    epochs = sorted(manifest.epochs) if manifest is not None else []
    total = len(epochs) * sum(manifest.of.get("items") or ()) if manifest is not None else 0
    total += sum(len(c.records) for ranks in sidecar.writing.values() for commits in ranks.values() for c in commits)
    bar = tqdm(total=total, unit="record", disable=not (progress and sys.stderr.isatty()))
    if manifest is None:
        problems.append(f"{join(root, OUTPUTS_NAME)}: missing: no epoch is complete yet")
    for folder in epochs:
        assert manifest is not None
        problems += _check_linked(reader, manifest, samples, storage_options, retry) if manifest.linked else \
            _check_epoch(reader, manifest, folder, _Records(manifest.fields, manifest.keyed, samples), bar)
    for folder, ranks in sidecar.writing.items():
        problems += _check_writing(reader, folder, ranks, bar)
    bar.close()
    return problems


def _samples(of: dict[str, Any], datasets: Sequence[str], storage_options: dict[str, Any] | None, retry: Retry,
             allowed_roots: Sequence[str]) -> tuple[_Samples | None, list[str]]:
    """The datasets given, checked against the sidecar's `of` (fingerprint, split, items); None and
    what differs where one is not what the outputs are of."""
    fingerprints, items, split = list(of.get("datasets") or ()), list(of.get("items") or ()), of.get("split")
    if len(datasets) != len(fingerprints):
        raise ConfigError(f"--dataset given {len(datasets)} times: the sidecar is of {len(fingerprints)} datasets "
                          "(give each, in the loader's order)")
    problems, sources = [], []
    for number, dataset in enumerate(datasets):
        manifest, url = read_manifest(dataset, storage_options, retry), join(dataset, MANIFEST_NAME)
        want = items[number] if number < len(items) else None
        if manifest.fingerprint != fingerprints[number]:
            problems.append(f"{url}: fingerprint {manifest.fingerprint[:16]}, the sidecar's outputs are of "
                            f"{str(fingerprints[number])[:16]}: another dataset (or another version of it); the "
                            "records' keys are not checked against it")
        elif split not in manifest.splits:
            problems.append(f"{url}: no split {split!r}, which the sidecar's outputs are of")
        elif want not in (manifest.splits[split].samples, manifest.splits[split].units):
            shards = manifest.splits[split]
            problems.append(f"{url}: split {split!r} has {shards.samples} samples ({shards.units} units), the "
                            f"sidecar's outputs are of {want} items")
        else:
            sources.append(SplitIndex.of(dataset, manifest, split, want != manifest.splits[split].samples))
    if problems:
        return None, problems
    readers = tuple(ShardReader(d, storage_options, retry, allowed_roots=allowed_roots) for d in datasets)
    return _Samples(tuple(sources), readers), []


def _read_file(reader: ShardReader, ref: FileRef, says: str) -> tuple[bytes | memoryview | None, list[str]]:
    """A file of the sidecar, whole, checked against the size and SHA-256 `says` (the manifest, or a
    commit) lists: (its bytes, or None where missing or of another size; the problems)."""
    url = shard_url(reader.root, ref.name)
    try:
        way = reader.way(_info(ref))
        size = way.size()
        if size != ref.bytes:
            return None, [f"{url}: {size} bytes, {says} says {ref.bytes}"]
        data = way.read(0, size)
    except (ShardError, FileNotFoundError) as exc:
        missing = isinstance(exc, FileNotFoundError) or isinstance(exc.__cause__, FileNotFoundError)
        return None, [f"{url}: missing" if missing else str(exc)]
    digest = hashlib.sha256(data).hexdigest()
    return data, [] if digest == ref.sha256 else [f"{url}: SHA-256 {digest}, {says} says {ref.sha256}"]


def _info(ref: FileRef) -> ShardInfo:
    return ShardInfo(ref.name, 0, 0, ref.bytes, ref.sha256, None)


def _check_epoch(reader: ShardReader, manifest: OutputsManifest, folder: str, records: _Records,
                 bar: Any) -> list[str]:
    """A complete epoch: its item indexes, then each chunk with the records they place in it."""
    chunks, indexes = manifest.epochs[folder]
    items = list(manifest.of.get("items") or ())
    problems = []
    if len(indexes) != len(items):
        problems.append(f"{join(reader.root, folder)}: item indexes of {len(indexes)} sources, the sidecar's "
                        f"outputs are of {len(items)}")
    tables = [np.zeros((0, 5), dtype=np.int64)]
    for source, refs in enumerate(indexes):
        found, table, count = _check_indexes(reader, folder, refs, [c.bytes for c in chunks], records.samples, source)
        problems += found
        tables.append(table)
        if source < len(items) and count != items[source]:
            problems.append(f"{join(reader.root, folder)}: the item indexes of source {source} hold {count} items, "
                            f"the sidecar's outputs are of {items[source]}")
    rows = np.concatenate(tables)
    rows = rows[np.lexsort((rows[:, 3], rows[:, 0]))]  # (by chunk, then start)
    bounds = np.searchsorted(rows[:, 0], np.arange(len(chunks) + 1))
    for number, ref in enumerate(chunks):
        problems += _check_chunk(reader, ref, rows[bounds[number]:bounds[number + 1], 1:], records, bar)
    return problems


def _check_indexes(reader: ShardReader, folder: str, refs: Sequence[FileRef], sizes: Sequence[int],
                   samples: _Samples | None, source: int, linked: bool = False) -> tuple[list[str], np.ndarray, int]:
    """A source's item indexes, each read whole and checked (SHA-256, `unpack_item_index` with the
    chunks' `sizes`; with the datasets, one per shard, of its shard's items): its rows (chunk,
    source, item, start, end), and the items they hold as the manifest lists them."""
    problems, tables, first = [], [np.zeros((0, 5), dtype=np.int64)], 0
    split = samples.sources[source] if samples is not None and source < len(samples.sources) else None
    if split is not None and len(refs) != len(split.sizes):
        problems.append(f"{join(reader.root, folder)}: item indexes of {len(refs)} shards of source {source}, the "
                        f"dataset's split has {len(split.sizes)}")
    for shard, ref in enumerate(refs):
        url = shard_url(reader.root, ref.name)
        count = item_index_items(ref.bytes)
        if split is not None and shard < len(split.sizes) and count != split.sizes[shard]:
            problems.append(f"{url}: {count} items, the dataset's shard {split.split.names[shard]} has "
                            f"{int(split.sizes[shard])}")
        data, found = _read_file(reader, ref, "the manifest")
        problems += found
        if data is not None:
            try:
                table = unpack_item_index(data, count, sizes, url, linked)
            except DatasetError as exc:
                problems.append(str(exc))
            else:
                tables.append(np.column_stack([table[:, 0], np.full(count, source), np.arange(first, first + count),
                                               table[:, 1], table[:, 2]]).astype(np.int64))
        first += count
    return problems, np.concatenate(tables), first


def _check_linked(reader: ShardReader, manifest: OutputsManifest, samples: _Samples | None,
                  storage_options: dict[str, Any] | None, retry: Retry) -> list[str]:
    """A linked sidecar: its embeddings the ones linked, its item indexes, and each record the row
    its sample's key names (`shard_tools.link.check_rows`)."""
    source, problems = linked_shards(manifest, storage_options, retry)
    if source is None:
        return problems
    assert manifest.linked is not None
    sizes = [s.bytes for s in source.splits[manifest.linked.split]]
    refs = manifest.epochs[ALL_EPOCHS][1]
    found, table, _ = _check_indexes(reader, ALL_EPOCHS, refs[0] if refs else (), sizes, samples, 0, True)
    keys = samples.keys(table[:, 1], table[:, 2]) if samples is not None else None
    return found + check_rows(manifest, source, table, keys, storage_options, retry)


def _check_chunk(reader: ShardReader, ref: FileRef, rows: np.ndarray, records: _Records, bar: Any,
                 says: str = "the manifest") -> list[str]:
    """A chunk: its size and SHA-256; its records (rows: source, item, start, end, by start) cover
    it once, up to a tar end-of-archive; each record checked (`_Records.check`)."""
    url = shard_url(reader.root, ref.name)
    data, problems = _read_file(reader, ref, says)
    if data is None:
        bar.update(len(rows))
        return [f"{p}; its {len(rows)} records are not checked" for p in problems]
    problems += _coverage(url, data, rows)
    for (source, item, start, end), expected in zip(rows.tolist(), records.names(rows)):
        bar.update(1)
        if 0 <= start < end <= len(data):
            problems += records.check(url, data[start:end], f"item {item} of source {source}, bytes {start}-{end}",
                                      expected)
    return problems


def _coverage(url: str, data: bytes | memoryview, rows: np.ndarray) -> list[str]:
    """Records (by start) that tile the chunk from its first byte, each byte once, then its end-of-archive."""
    problems, at, last = [], 0, (0, 0)
    for source, item, start, end in rows.tolist():
        if start < at:
            problems.append(f"{url}: the record of item {item} of source {source} (bytes {start}-{end}) overlaps "
                            f"that of item {last[1]} of source {last[0]}")
        elif start > at:
            problems.append(f"{url}: bytes {at}-{start} are no item's record")
        at, last = (end, (source, item)) if end > at else (at, last)
    tail = bytes(data[at:])
    if len(tail) < 2 * BLOCK or tail.strip(b"\0"):
        problems.append(f"{url}: bytes {at}-{len(data)} are no item's record, and not a tar end-of-archive")
    return problems


def _check_writing(reader: ShardReader, folder: str, ranks: dict[int, list[Commit]], bar: Any) -> list[str]:
    """An epoch still being written: a problem (it cannot be attached); its committed chunks checked
    against their commits."""
    world = max(c.world_size for commits in ranks.values() for c in commits)
    done = sorted(rank for rank, commits in ranks.items() if commits[-1].last)
    problems = [f"{join(reader.root, folder)}: not complete: {len(done)} of its {world} ranks have committed their "
                "whole share (the writer lists the epoch in outputs.json once every rank has)"]
    for rank, commits in sorted(ranks.items()):
        records = _Records(commits[0].fields, commits[0].keyed, None)
        for commit in commits:
            ref = FileRef(chunk_name(folder, rank, commit.number), commit.bytes, commit.sha256)
            rows = commit.records[np.argsort(commit.records[:, 2], kind="stable")]
            problems += _check_chunk(reader, ref, rows, records, bar, says="its commit")
    return problems
