"""`shard-pack inspect`, `verify` and `upgrade`: read a dataset back, report everything found, and
bring an older dataset to the current schema in place."""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
from tqdm import tqdm

from pipeline.errors import ShardstreamError
from pipeline.format import BLOCK_BYTES, MANIFEST_NAME, SCHEMA_VERSION, IndexInfo, Manifest, ShardIndex, ShardInfo, index_name
from pipeline.kinds import KINDS, Kind
from pipeline.storage import Retry, ShardReader, filesystem, join, read_manifest, write_bytes
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


def verify(root: str, *, progress: bool = True, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Every problem in the dataset: missing shards or indexes, sizes or checksums that disagree
    with the manifest, indexes that disagree with their shards, undecodable samples. Samples are
    read as the loader reads them: the shard's index and each sample's bytes through a
    `ShardReader`, its members by `tario`, decoded by the kind (`Kind.for_verify`: everything)."""
    manifest = read_manifest(root, storage_options)
    kind = KINDS[manifest.kind].for_verify(manifest)
    reader = ShardReader(root, storage_options, Retry())
    problems: list[str] = []
    total = sum(split.samples for split in manifest.splits.values())
    bar = tqdm(total=total, unit="sample", disable=not (progress and sys.stderr.isatty()))
    for shards in manifest.splits.values():
        for shard in shards:
            url, path = join(root, shard.name), join(reader.base, shard.name)
            try:
                size = reader.fs.size(path)
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
            digest = hashlib.sha256()
            with reader.fs.open(path, "rb", block_size=_READ_BLOCK) as f:
                while block := f.read(_READ_BLOCK):
                    digest.update(block)
            if digest.hexdigest() != shard.sha256:
                problems.append(f"{url}: SHA-256 {digest.hexdigest()}, the manifest says {shard.sha256}")
            problems += _check_samples(reader, url, shard, index, kind, bar)
    bar.close()
    return problems


def _check_samples(reader: ShardReader, url: str, shard: ShardInfo, index: ShardIndex, kind: Kind,
                   bar: Any) -> list[str]:
    """Each sample read by range, compared with its index entry (members, offsets, sizes) and decoded whole."""
    problems = []
    for i in range(index.samples):
        bar.update(1)
        key, (start, end) = index.key(i), index.span(i)
        try:
            data = reader.read(shard.name, shard.bytes, shard.sha256, start, end, key)
            found = [(ext, start + at, size) for ext, at, size in sample_members(data, url, key)]
            if index.members is not None and found != index.sample_members(i):
                problems.append(f"{url}: sample {key!r}: members {found}, the index says {index.sample_members(i)}")
                continue
            units = int(index.units[i])
            every = np.arange(units if kind.units else 1)
            sample = kind.open(parse_sample(data, url, key), url=url, key=key, units=units)
            for unit in [every] if kind.grouped else every.tolist():
                kind.decode(sample, unit=unit, seed=0, epoch=0, url=url, key=key)
        except ShardstreamError as exc:
            problems.append(str(exc))
    end = int(index.spans[-1, 1]) if index.samples else 0
    tail = reader.fs.cat_file(join(reader.base, shard.name), start=end, end=shard.bytes) if shard.bytes >= end else b""
    if len(tail) < 2 * BLOCK_BYTES or tail.strip(b"\0"):
        problems.append(f"{url}: does not end with a tar end-of-archive after its last sample")
    return problems


def upgrade(root: str, *, progress: bool = True, storage_options: dict[str, Any] | None = None) -> str:
    """Bring a schema-1/2 dataset to the current schema in place: each shard's index is written
    (read from the shard's tar headers, checked against the old manifest), then the new manifest,
    atomically. No shard is rewritten; running it again, or after an interruption, is safe."""
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
            assert shard.inline is not None
            old, url = shard.inline, join(root, shard.name)
            members = []
            for i, data in _samples(fs, join(base, shard.name), old):
                start = old.span(i)[0]
                members.append([(ext, start + at, size) for ext, at, size in sample_members(data, url, old.key(i))])
                bar.update(1)
            index = ShardIndex.build(old.key_list(), old.units.tolist(), members)
            if not np.array_equal(index.spans, old.spans):
                raise ShardstreamError(url, "the shard's samples do not fill the ranges its manifest gives them")
            data = index.to_bytes(shard.bytes)
            write_bytes(fs, join(base, index_name(shard.name)), data)
            upgraded.append(ShardInfo(shard.name, shard.samples, shard.units, shard.bytes, shard.sha256,
                                      IndexInfo.of(shard.name, data)))
        splits[name] = upgraded
    bar.close()
    new = Manifest(manifest.kind, splits, manifest.options, manifest.fingerprint, manifest.skipped)
    write_bytes(fs, join(base, MANIFEST_NAME), new.to_json())  # last: the indexes it lists are in place
    shards = sum(len(s) for s in splits.values())
    return f"{root}: upgraded from schema {manifest.version} to {SCHEMA_VERSION}: {shards} shard indexes written, no shard changed"
