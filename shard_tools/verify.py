"""`shard-pack inspect`, `verify` and `upgrade`: read a dataset back, report everything found, and
bring an older dataset to the current schema in place."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import numpy as np
from tqdm import tqdm

from pipeline.errors import ShardError, ShardstreamError, about_sample
from pipeline.format import (
    BLOCK_BYTES, MANIFEST_NAME, SCHEMA_VERSION, IndexInfo, Manifest, ShardIndex, ShardInfo, index_name,
)
from pipeline.kinds import KINDS, Kind
from pipeline.stats import Clock
from pipeline.storage import Retry, ShardReader, filesystem, is_local, join, read_manifest, shard_url, write_bytes
from pipeline.storage.local import open_regular, regular_size
from pipeline.storage.ranged import Ranged, ranged_reader
from pipeline.tario import parse_sample, sample_members

__all__ = ["describe", "verify", "upgrade"]

log = logging.getLogger(__name__)
_READ_BLOCK = 16 << 20  # shards are read front to back in blocks of this size


def describe(manifest: Manifest, root: str) -> list[str]:
    """A human summary of a manifest: kind, version, options, splits, skipped inputs."""
    lines = [
        f"dataset {root}",
        f"kind {manifest.kind}, schema {manifest.version}, fingerprint {manifest.fingerprint[:16]}",
        "options " + ", ".join(f"{k}={v}" for k, v in sorted(manifest.options.items())),
    ]
    for name, shards in sorted(manifest.splits.items()):
        size = int(shards.shard_bytes.sum())
        units = f" ({shards.units} units)" if shards.units != shards.samples else ""
        lines.append(f"split {name}: {shards.samples} samples{units} in {len(shards)} shards, {size / 1e6:.1f} MB")
    lines.append(f"skipped at pack time: {len(manifest.skipped)}")
    lines += [f"  {s['reason']}" for s in manifest.skipped[:20]]
    if len(manifest.skipped) > 20:
        lines.append(f"  ... and {len(manifest.skipped) - 20} more (see manifest.json)")
    return lines


def _samples(fs: Any, path: str, index: ShardIndex) -> Iterator[tuple[int, bytes]]:
    """Each sample's bytes, reading the shard front to back (one open file, large sequential reads:
    `upgrade`, which has no index to read samples by)."""
    with fs.open(path, "rb", block_size=_READ_BLOCK) as f:
        for i in range(index.samples):
            start, end = index.span(i)
            f.seek(start)
            yield i, f.read(end - start)


def verify(root: str, *, progress: bool = True, storage_options: dict[str, Any] | None = None,
           retry: Retry = Retry(), allowed_roots: Sequence[str] = ()) -> list[str]:
    """Every problem in the dataset: missing shards or indexes, sizes or checksums that disagree
    with the manifest, indexes that disagree with their shards, undecodable samples. Samples are
    read as the loader reads them: the shard's index and each sample's bytes through a
    `ShardReader`, its members by `tario`, decoded by the kind (`Kind.for_verify`: everything).
    A shard on object storage is streamed once, by one request, into a temporary file (one shard
    at a time, in TMPDIR) as it is hashed, and its samples are read from that copy. A transient
    failure mid-stream (a cut, a reset, 5xx, SlowDown) is retried under `retry`, resuming from the
    bytes received; a shard that cannot be read past it is a problem naming it and the cause.
    Shards are read where the loader reads them: in the folder, or under `allowed_roots`, regular
    files only (a name elsewhere, a link out of the folder, a FIFO or a device is a problem)."""
    manifest = read_manifest(root, storage_options)
    kind_class = KINDS.get(manifest.kind)  # (None: a kind whose samples only the user decodes: members checked)
    kind = kind_class.for_verify(manifest) if kind_class is not None else None
    reader = ShardReader(root, storage_options, retry, allowed_roots=allowed_roots)
    packed = manifest.origin == "packed"
    problems: list[str] = []
    total = sum(split.samples for split in manifest.splits.values())
    bar = tqdm(total=total, unit="sample", disable=not (progress and sys.stderr.isatty()))
    for shards in manifest.splits.values():
        for shard in shards:
            url = shard_url(root, shard.name)
            try:
                url = reader.places.url(shard.name)
                shard_fs, path = filesystem(url, storage_options)
                path = reader.places.real(path, url) if is_local(shard_fs) else path
                size = regular_size(path, url) if is_local(shard_fs) else shard_fs.size(path)
                index = reader.index(shard)
            except FileNotFoundError:
                problems.append(f"{url}: shard is missing")
                bar.update(shard.samples)
                continue
            except ShardstreamError as exc:
                problems.append(str(exc))
                bar.update(shard.samples)
                continue
            if size != shard.bytes:
                problems.append(f"{url}: {size} bytes, the manifest says {shard.bytes}")
            with contextlib.ExitStack() as stack:
                copy = None
                if not is_local(shard_fs):
                    copy = stack.enter_context(tempfile.TemporaryFile(prefix="shard-pack-verify-"))
                try:
                    sha256 = _sha256(path, url) if copy is None else \
                        _download(ranged_reader(url, storage_options, retry), size, copy)
                except ShardError as exc:  # (past the retries: the shard is not checked)
                    problems.append(f"{exc}; its samples are not checked")
                    bar.update(shard.samples)
                    continue
                if sha256 != shard.sha256:
                    problems.append(f"{url}: SHA-256 {sha256}, the manifest says {shard.sha256}")
                read = reader.way(shard).read if copy is None else _copied(copy, url)
                problems += _check_samples(read, url, index, kind, bar, packed)
                if packed:  # (an original archive holds more than one split's samples, and other members)
                    problems += _check_end(read, url, shard, index)
    bar.close()
    return problems


def _sha256(path: str, url: str) -> str:
    """A local shard's SHA-256, read front to back in large blocks (a regular file only: never a
    FIFO or a device, which would never end)."""
    digest = hashlib.sha256()
    with os.fdopen(open_regular(path, url), "rb", buffering=0) as f:
        while block := f.read(_READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _download(shard: Ranged, size: int, copy: IO[bytes]) -> str:
    """The SHA-256 of a shard on object storage, streamed into `copy` as it is hashed: one request
    (`Ranged.stream`), resumed after a transient failure from the bytes already handed over; a
    ShardError naming the shard past the retries."""
    digest = hashlib.sha256()
    for chunk in shard.stream(0, size):
        digest.update(chunk)
        copy.write(chunk)
    copy.flush()
    return digest.hexdigest()


def _copied(copy: IO[bytes], url: str) -> Callable[[int, int], bytes]:
    """Bytes [start, end) of a shard from its copy in a temporary file."""
    def read(start: int, end: int) -> bytes:
        data = os.pread(copy.fileno(), end - start, start)
        if len(data) < end - start:
            raise ShardError(f"shard is {os.fstat(copy.fileno()).st_size} bytes, shorter than the "
                             f"sample's range ({start}-{end})", url=url)
        return data
    return read


def _check_samples(read: Callable[[int, int], bytes | memoryview], url: str, index: ShardIndex, kind: Kind | None,
                   bar: Any, packed: bool) -> list[str]:
    """Each sample read by range and parsed at its index's members (an original archive's may lie
    apart; a `packed` shard's must fill its span, as packing wrote them), then decoded whole (kinds
    the loader decodes itself)."""
    problems = []
    for i in range(index.samples):
        bar.update(1)
        key, (start, end) = index.key(i), index.span(i)
        recorded = index.sample_members(i) if index.members is not None else None
        try:
            with about_sample(url, key):
                data = read(start, end)
            if packed:  # (a packed sample's members fill its span: walked, they must be the index's)
                found = [(ext, start + at, size) for ext, at, size in sample_members(data, url, key)]
                if recorded is not None and found != recorded:
                    problems.append(f"{url}: sample {key!r}: members {found}, the index says {recorded}")
                    continue
            members = parse_sample(data, url, key, members=recorded, start=start)
            if kind is None:
                continue
            units = int(index.units[i])
            every = np.arange(units if kind.units else 1)
            sample = kind.open(members, url=url, key=key, units=units)
            for unit in [every] if kind.grouped else every.tolist():
                kind.decode(sample, unit=unit, seed=0, epoch=0, url=url, key=key, clock=Clock(kind.stages))
        except ShardstreamError as exc:
            problems.append(str(exc))
    return problems


def _check_end(read: Callable[[int, int], bytes | memoryview], url: str, shard: ShardInfo,
               index: ShardIndex) -> list[str]:
    """A packed shard ends with a tar end-of-archive right after its last sample."""
    end = int(index.spans[-1, 1]) if index.samples else 0
    try:
        tail = bytes(read(end, shard.bytes)) if shard.bytes >= end else b""
    except ShardstreamError:
        tail = b""
    if len(tail) < 2 * BLOCK_BYTES or tail.strip(b"\0"):
        return [f"{url}: does not end with a tar end-of-archive after its last sample"]
    return []


def upgrade(root: str, *, progress: bool = True, storage_options: dict[str, Any] | None = None) -> str:
    """Bring an older dataset to the current schema in place: each shard's index is written for
    schema 1/2 (read from the shard's tar headers, checked against the old manifest), then the new
    manifest, atomically. No shard is rewritten; running it again, or after an interruption, is safe."""
    manifest = read_manifest(root, storage_options)
    if manifest.version == SCHEMA_VERSION:
        return f"{root}: already schema {SCHEMA_VERSION}; nothing to do"
    fs, base = filesystem(root, storage_options)
    total = sum(split.samples for split in manifest.splits.values())
    bar = tqdm(total=total, unit="sample", disable=not (progress and sys.stderr.isatty()))
    splits = {}
    for name, shards in manifest.splits.items():
        upgraded = []
        for shard in shards:
            if shard.inline is None:  # (schema 3: its index file stays as it is)
                upgraded.append(shard)
                bar.update(shard.samples)
                continue
            old, url = shard.inline, join(root, shard.name)
            members = []
            for i, data in _samples(fs, join(base, shard.name), old):
                start = old.span(i)[0]
                members.append([(ext, start + at, size) for ext, at, size in sample_members(data, url, old.key(i))])
                bar.update(1)
            index = ShardIndex.build(old.key_list(), old.units.tolist(), members)
            if not np.array_equal(index.spans, old.spans):
                raise ShardstreamError("the shard's samples do not fill the ranges its manifest gives them", url=url)
            data = index.to_bytes(shard.bytes)
            write_bytes(fs, join(base, index_name(shard.name)), data)
            upgraded.append(ShardInfo(shard.name, shard.samples, shard.units, shard.bytes, shard.sha256,
                                      IndexInfo.of(shard.name, data)))
        splits[name] = upgraded
    bar.close()
    new = Manifest(manifest.kind, splits, manifest.options, manifest.fingerprint, manifest.skipped)
    write_bytes(fs, join(base, MANIFEST_NAME), new.to_json())  # last: the indexes it lists are in place
    shards = sum(s.inline is not None for split in manifest.splits.values() for s in split)
    return (f"{root}: upgraded from schema {manifest.version} to {SCHEMA_VERSION}: {shards} shard indexes written, "
            "no shard changed")
