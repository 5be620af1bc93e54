"""`shard-pack inspect` and `shard-pack verify`: read a dataset back, report everything found."""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import numpy as np
from tqdm import tqdm

from pipeline.errors import ShardstreamError
from pipeline.format import Manifest
from pipeline.kinds import KINDS
from pipeline.storage import filesystem, join, read_manifest, read_range
from pipeline.tario import BLOCK, parse_sample

__all__ = ["describe", "verify"]


def describe(manifest: Manifest, root: str) -> list[str]:
    """A human summary of a manifest: kind, version, options, splits, skipped inputs."""
    lines = [
        f"dataset {root}",
        f"kind {manifest.kind}, fingerprint {manifest.fingerprint[:16]}",
        "options " + ", ".join(f"{k}={v}" for k, v in sorted(manifest.options.items())),
    ]
    for name, shards in sorted(manifest.splits.items()):
        size = sum(s.bytes for s in shards)
        lines.append(f"split {name}: {manifest.samples(name)} samples in {len(shards)} shards, {size / 1e6:.1f} MB")
    lines.append(f"skipped at pack time: {len(manifest.skipped)}")
    lines += [f"  {s['reason']}" for s in manifest.skipped[:20]]
    if len(manifest.skipped) > 20:
        lines.append(f"  ... and {len(manifest.skipped) - 20} more (see manifest.json)")
    return lines


def verify(root: str, *, progress: bool = True, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Every problem in the dataset (missing shards, size or checksum mismatches, undecodable samples)."""
    manifest = read_manifest(root, storage_options)
    kind = KINDS[manifest.kind]
    options = kind.verify_options(manifest)
    fs, base = filesystem(root, storage_options)
    problems: list[str] = []
    total = sum(s.samples for shards in manifest.splits.values() for s in shards)
    bar = tqdm(total=total, unit="sample", disable=not (progress and sys.stderr.isatty()))
    for shards in manifest.splits.values():
        for shard in shards:
            url, path = join(root, shard.name), join(base, shard.name)
            try:
                size = fs.size(path)
            except FileNotFoundError:
                problems.append(f"{url}: shard is missing")
                bar.update(shard.samples)
                continue
            if size != shard.bytes:
                problems.append(f"{url}: {size} bytes, the manifest says {shard.bytes}")
            digest = hashlib.sha256()
            with fs.open(path, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
            if digest.hexdigest() != shard.sha256:
                problems.append(f"{url}: SHA-256 {digest.hexdigest()}, the manifest says {shard.sha256}")
            for i, key in enumerate(shard.keys):
                bar.update(1)
                try:
                    data = read_range(fs, path, url, shard.offsets[i], shard.offsets[i + 1], key)
                    units = kind.units(shard, options)
                    every = np.arange(1 if units is None else int(units[i]))
                    sample = kind.open(parse_sample(data, url, key), options, url=url, key=key, units=len(every))
                    for unit in [every] if kind.grouped else every.tolist():
                        kind.decode(sample, options, unit=unit, seed=0, epoch=0, url=url, key=key)
                except ShardstreamError as exc:
                    problems.append(str(exc))
            tail = fs.cat_file(path, start=shard.offsets[-1], end=size) if size >= shard.offsets[-1] else b""
            if len(tail) < 2 * BLOCK or tail.strip(b"\0"):
                problems.append(f"{url}: does not end with a tar end-of-archive after its last sample")
    bar.close()
    return problems
