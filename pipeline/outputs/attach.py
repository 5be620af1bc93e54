"""Attaching outputs at load time: `make_stream_loader(..., attach={"teacher": sidecar})` gives each
batch the sidecar's field beside the samples it was computed from.

Made in the main process (`Attachments.of`): each sidecar's manifest is read and compared with the
loader (`of.refusal`: dataset, split, seed, kind options) and with every epoch the loader is set
to (`check_epoch`). In each worker, for a batch's plan items (`locate`): the record of each, from
its shard's item index (fetched when the shard is first touched, kept), is located as one more
sample to read, in the same read-ahead, through the same readers (mapped local chunks, ranged
reads or the shard cache); `take` checks it (its tar members named by the sample's key, a fixed
field of its exact size) and `collate` copies the rows into the batch's shared buffers.

A linked sidecar (`shard-pack link`) has item indexes alone: its records are rows of an embeddings
dataset's column, read from that dataset's shards as they are (`SampleReads.raw`, size checked); a
sample it has no row for is a SampleError naming it (a skip counted, under on_error="skip"), found
before the sample is decoded."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pipeline.collate import empty
from pipeline.errors import ConfigError, DatasetError, SampleError
from pipeline.format import Manifest, ShardInfo, unpack_record
from pipeline.format.outputs import (
    ALL_EPOCHS, MISSING, OUTPUTS_NAME, FileRef, OutputField, OutputsManifest, epoch_folder, record_key,
    unpack_item_index,
)
from pipeline.index import Located, SplitIndex
from pipeline.outputs.of import outputs_of, refusal
from pipeline.storage import (
    Retry, filesystem, join, read_manifest, read_range, release_pages, shard_url, with_retries,
)
from pipeline.storage.places import ALLOW, within
from pipeline.storage.reader import ShardReader

__all__ = ["Attachments", "Sidecar"]

_SOURCE_BITS = 40  # (source, item) of a record packed in one int: its `where`


@dataclasses.dataclass(frozen=True, eq=False)
class Sidecar:
    """One sidecar a loader reads: its place, manifest and the fields taken from it (batch name ->
    the sidecar's field); linked, the shards of the dataset its records lie in."""

    root: str
    manifest: OutputsManifest
    fields: tuple[tuple[str, OutputField], ...]
    shards: tuple[ShardInfo, ...] = ()

    @property
    def records_root(self) -> str:
        """Where its records lie: its own folder, or the dataset it is linked to."""
        return self.root if self.manifest.linked is None else self.manifest.linked.dataset

    def sizes(self, folder: str) -> list[int]:
        """The bytes of each file an item index's chunk numbers name."""
        if self.manifest.linked is not None:
            return [s.bytes for s in self.shards]
        return [c.bytes for c in self.manifest.epochs[folder][0]]

    def chunk(self, folder: str, number: int) -> tuple[ShardInfo, str]:
        """A record's chunk (or linked shard), and its URL."""
        linked = self.manifest.linked is not None
        info = self.shards[number] if linked else _info(self.manifest.epochs[folder][0][number])
        return info, shard_url(self.records_root, info.name)

    def folder(self, epoch: int) -> str:
        return epoch_folder(epoch) if self.manifest.of["by_epoch"] else ALL_EPOCHS


def _read_manifest(root: str, storage_options: dict[str, Any] | None, retry: Retry) -> OutputsManifest:
    url = join(root, OUTPUTS_NAME)
    fs, path = filesystem(url, storage_options)
    try:
        size = with_retries(retry, url, lambda: fs.size(path))
    except FileNotFoundError as exc:
        raise DatasetError("no outputs.json: not a sidecar, or one whose writing is not finished (its manifest is "
                           "written when every rank's share of an epoch is)", url=root) from exc
    if size > 64 << 20:
        raise DatasetError(f"outputs.json is {size} bytes, more than a sidecar manifest may be", url=url)
    return OutputsManifest.from_bytes(read_range(fs, path, url, 0, size, retry=retry), url)


class Attachments:
    """The sidecars a loader attaches (see the module docstring); `names`: the batch fields they add."""

    def __init__(self, sidecars: Sequence[Sidecar], sources: Sequence[SplitIndex], kind: Any) -> None:
        self.sidecars, self.sources, self.kind = tuple(sidecars), tuple(sources), kind
        self.names = tuple(name for s in sidecars for name, _ in s.fields)
        self._indexes: collections.OrderedDict[tuple[int, str, int, int], np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_indexes": collections.OrderedDict(), "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @classmethod
    def of(cls, attach: Mapping[str, str], manifests: Sequence[Manifest], split: str, kind: Any,
           sources: Sequence[SplitIndex], config: Any) -> Attachments:
        """The sidecars of `attach` (batch field -> sidecar place), each checked against the loader
        (`config`: its seed, storage and allowed roots; the epochs each holds: when the loader is set
        to one, `check_epoch`)."""
        if not attach:
            return cls((), sources, kind)
        taken = {f.name for f in kind.fields(0)}
        by_root: dict[str, list[str]] = {}
        for name, root in attach.items():
            if name in taken:
                raise ConfigError(f"attach: {name!r} is a field the {manifests[0].kind} batch has already")
            by_root.setdefault(root, []).append(name)
        sidecars = []
        for root, names in by_root.items():
            manifest = _read_manifest(root, config.storage_options, config.retry)
            here = outputs_of(manifests, split, kind, [int(s.sizes.sum()) for s in sources], config.seed,
                              manifest.of.get("inputs"))
            problem = refusal(manifest.of, here)
            if problem:
                raise ConfigError(f"attach: {root} holds outputs of other samples than this loader's: {problem}")
            have = {f.name: f for f in manifest.fields}
            missing = [n for n in names if n not in have]
            if missing:
                raise ConfigError(f"attach: {root} has no field {missing[0]!r}; it has {sorted(have)}")
            shards = () if manifest.linked is None else _linked_shards(root, manifest, config)
            sidecars.append(Sidecar(root, manifest, tuple((n, have[n]) for n in names), shards))
        return cls(sidecars, sources, kind)

    def check_epoch(self, epoch: int) -> None:
        """Refuse an epoch a sidecar does not hold (in the main process, when the loader is set to it)."""
        for sidecar in self.sidecars:
            if sidecar.folder(epoch) not in sidecar.manifest.epochs:
                held = sorted(int(f.split("-")[1]) for f in sidecar.manifest.epochs if f != ALL_EPOCHS)
                raise ConfigError(f"attach: {sidecar.root} holds outputs of epochs {held}, not of epoch {epoch} "
                                  "(its samples change with the epoch: write that epoch's outputs too)")

    def readers(self, config: Any, cache: Any) -> list[ShardReader]:
        """The readers of the sidecars' records, then of their item indexes (in the process that reads),
        after the sources': the same one but for a linked sidecar's."""
        records = [ShardReader(s.records_root, config.storage_options, config.retry, cache, None,
                               config.index_cache_bytes) for s in self.sidecars]
        return records + [reader if s.manifest.linked is None else
                          ShardReader(s.root, config.storage_options, config.retry, cache)
                          for s, reader in zip(self.sidecars, records)]

    def _table(self, number: int, reader: ShardReader, folder: str, source: int, shard: int) -> np.ndarray:
        """A shard's item index in a sidecar's epoch folder: fetched when first asked for, then kept."""
        key = (number, folder, source, shard)
        with self._lock:
            if key in self._indexes:
                self._indexes.move_to_end(key)
                return self._indexes[key]
        sidecar = self.sidecars[number]
        ref = sidecar.manifest.epochs[folder][1][source][shard]
        url = shard_url(sidecar.root, ref.name)
        data = bytes(reader.way(_info(ref)).read(0, ref.bytes))
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise DatasetError("item index does not match the SHA-256 its sidecar's manifest lists", url=url)
        table = unpack_item_index(data, int(self.sources[source].sizes[shard]), sidecar.sizes(folder), url,
                                  sidecar.manifest.linked is not None)
        with self._lock:
            self._indexes[key] = table
            while len(self._indexes) > 256:
                self._indexes.popitem(last=False)
        return table

    def locate(self, readers: Sequence[ShardReader], epoch: int, sources: np.ndarray, items: np.ndarray,
               keys: Sequence[str]) -> list[tuple[Located | None, ...]]:
        """Each row's records (a batch's plan items, in the batch's row order, with their samples' keys):
        one per sidecar, as samples to read (their `where` after the sources'; None: a linked
        sidecar's missing row)."""
        first = len(self.sources)
        rows: list[list[Located | None]] = [[] for _ in keys]
        for number, sidecar in enumerate(self.sidecars):
            folder, reader = sidecar.folder(epoch), readers[first + len(self.sidecars) + number]
            found = np.empty((len(items), 3), dtype=np.int64)  # each row's (chunk, start, end)
            for source in np.unique(sources).tolist():
                mine = np.flatnonzero(sources == source)
                index = self.sources[source]
                shards = index.shards_of(items[mine])
                for shard in np.unique(shards).tolist():
                    at = mine[shards == shard]
                    found[at] = self._table(number, reader, folder, source, shard)[items[at] - index.first_item[shard]]
            for row, (source, item, key, (chunk, start, end)) in enumerate(zip(sources.tolist(), items.tolist(), keys,
                                                                              found.tolist())):
                if (chunk, start, end) == MISSING:
                    rows[row].append(None)
                    continue
                info, url = sidecar.chunk(folder, chunk)
                rows[row].append(Located((first + number, source << _SOURCE_BITS | item), info, url,
                                         record_key(key, source, item, sidecar.manifest.keyed), 1,
                                         ((start, end, None),)))
        return [tuple(r) for r in rows]

    def take(self, reads: Any, rows: Sequence[tuple[Located | None, ...]], key: str) -> list[dict[str, Any]]:
        """The attached values of a sample's rows (fixed fields as views of their raw bytes: copied,
        and their mapped pages released, by `collate`), checked: a record holds exactly its sidecar's
        fields, named by the sample's key (a linked sidecar's: the row's bytes, of the field's size).
        A row a linked sidecar lacks is an error before any is read."""
        for row in rows:
            for sidecar, record in zip(self.sidecars, row):
                if record is None:
                    linked = sidecar.manifest.linked
                    assert linked is not None
                    raise SampleError(f"no output: the dataset it links, {linked.dataset}, has no row whose "
                                      f"{linked.id_field} is this sample's", url=sidecar.root, key=key)
        return [_values(self.sidecars, reads, row, key) for row in rows]

    def collate(self, rows: Sequence[dict[str, Any]], batch: Any) -> None:
        """The rows' attached values into the batch in transit (fixed fields: one tensor each)."""
        if not isinstance(batch, dict):
            raise ConfigError(f"attach needs batches that are dicts; this kind's are {type(batch).__name__}s")
        for sidecar in self.sidecars:
            for name, field in sidecar.fields:
                if not field.fixed:
                    batch[name] = [row[name] for row in rows]
                    continue
                assert field.shape is not None and field.dtype is not None
                out = empty((len(rows), *field.shape), getattr(torch, field.dtype))
                flat = out.view(len(rows), -1).view(torch.uint8).numpy() if out.numel() else None
                for i, row in enumerate(rows):
                    if flat is not None:
                        flat[i] = np.frombuffer(row[name], np.uint8)
                    release_pages(row[name])  # (a mapped chunk's: out of this process's memory)
                batch[name] = out

    def finish(self, batch: Any) -> Any:
        """A batch in transit -> the batch users get: the kind's, with the attached fields."""
        if not self.names:
            return self.kind.finish(batch)
        attached = {name: batch.pop(name) for name in self.names}
        finished = self.kind.finish(batch)
        finished.update(attached)
        return finished

    def unbatch(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """A finished batch's samples, with their attached values."""
        attached = {name: batch.pop(name) for name in self.names}
        samples = self.kind.unbatch(batch)
        for i, sample in enumerate(samples):
            sample.update((name, values[i]) for name, values in attached.items())
        return samples


def _values(sidecars: Sequence[Sidecar], reads: Any, records: tuple[Located | None, ...], key: str) -> dict[str, Any]:
    """One row's attached values (see `Attachments.take`)."""
    values: dict[str, Any] = {}
    for sidecar, record in zip(sidecars, records):
        linked = sidecar.manifest.linked
        assert record is not None
        if linked is not None:
            (name, field), = sidecar.fields
            values[name] = reads.raw(record)
            reads.done(record)
            if len(values[name]) != field.nbytes:
                raise SampleError(f"{len(values[name])} bytes, {field.describe()} is {field.nbytes}",
                                  url=record.url, key=key, field=linked.field)
            continue
        members, _ = reads.take(record)
        reads.done(record)
        have = {f.name for f in sidecar.manifest.fields}
        if set(members) != have:
            raise SampleError(f"record holds {sorted(members)}, the sidecar's fields are {sorted(have)}",
                              url=record.url, key=record.key)
        for name, field in sidecar.fields:
            data = members[field.name]
            if field.fixed:
                if len(data) != field.nbytes:
                    raise SampleError(f"{len(data)} bytes, {field.describe()} is {field.nbytes}", url=record.url,
                                      key=record.key, field=field.name)
                values[name] = data
            else:
                record_map = unpack_record(bytes(data))
                if set(record_map) != {"v"}:
                    raise SampleError("not an output value (want a map {v: value})", url=record.url,
                                      key=record.key, field=field.name)
                values[name] = record_map["v"]
    return values


def _info(ref: FileRef) -> ShardInfo:
    return ShardInfo(ref.name, 0, 0, ref.bytes, ref.sha256, None)


def _linked_shards(root: str, manifest: OutputsManifest, config: Any) -> tuple[ShardInfo, ...]:
    """The shards a linked sidecar's records lie in, checked: the dataset is one the user allows
    (inside the sidecar's folder, or under `allowed_roots`), the one linked (its fingerprint), and its
    field the sidecar's dtype and shape."""
    linked = manifest.linked
    assert linked is not None
    if not any(within(linked.dataset, place) for place in (root, *config.allowed_roots)):
        raise ConfigError(f"attach: {root} is linked to {linked.dataset}, outside its folder: allow it with {ALLOW}")
    dataset = read_manifest(linked.dataset, config.storage_options, config.retry)
    if dataset.fingerprint != linked.fingerprint or linked.split not in dataset.splits:
        raise ConfigError(f"attach: {root} was linked to another version of {linked.dataset} (fingerprint "
                          f"{linked.fingerprint[:16]}, split {linked.split!r}; it has {dataset.fingerprint[:16]}, "
                          f"{sorted(dataset.splits)}): link it again")
    return tuple(dataset.splits[linked.split])
