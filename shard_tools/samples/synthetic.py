"""Synthetic SA-1B datasets of any size, for the scale benchmark and tests: a real manifest and
real indexes, and one real shard of tiny samples (a real photograph's JPEG and masks, packed by
the project) linked under every shard name, so that 100M samples cost a few MB of disk."""

from __future__ import annotations

import os
import pathlib
import tempfile

from pipeline.format import IndexInfo, Manifest, ShardIndex, ShardInfo, index_name, shard_name
from pipeline.storage import read_manifest, shard_indexes
from pipeline.tario import ShardWriter, parse_sample

__all__ = ["write_synthetic"]


def _template_members() -> list[tuple[str, bytes]]:
    """The members of one real packed SA-1B sample (a 32 x 48 photograph, two masks)."""
    from shard_tools.pack import PackOptions, pack
    from shard_tools.sa1b import Sa1bSource
    from shard_tools.samples.sa1b import write_sa1b

    with tempfile.TemporaryDirectory(prefix="shardstream-synthetic-") as tmp:
        write_sa1b(pathlib.Path(tmp, "src"), images=1, size=(32, 48), masks=(2, 2), images_per_archive=1)
        out = str(pathlib.Path(tmp, "out"))
        pack(Sa1bSource(), [str(pathlib.Path(tmp, "src"))], out, PackOptions(workers=1), progress=False)
        (shard, index), = shard_indexes(out, read_manifest(out), "train")
        start, end = index.span(0)
        data = pathlib.Path(out, shard.name).read_bytes()[start:end]
        return [(ext, bytes(view)) for ext, view in parse_sample(data, shard.name, index.key(0)).items()]


def _real_shard(path: pathlib.Path, samples: int, members: list[tuple[str, bytes]]) -> ShardInfo:
    writer = ShardWriter(str(path))
    for i in range(samples):
        writer.add(f"s{i:07d}", members)
    sha = writer.close()
    index = ShardIndex.build(writer.keys, [1] * samples, writer.members).to_bytes(writer.size)
    path.with_suffix(".idx").write_bytes(index)
    return ShardInfo(path.name, samples, samples, writer.size, sha,
                     IndexInfo.of(path.name, index))


def write_synthetic(out: str | os.PathLike[str], samples: int, per_shard: int = 1000) -> Manifest:
    """An SA-1B dataset of `samples` samples in shards of `per_shard` (split `train`): every full
    shard is a symbolic link to the first (same keys, same bytes), the last one may be shorter."""
    root = pathlib.Path(out)
    root.mkdir(parents=True, exist_ok=True)
    members = _template_members()
    full, rest = divmod(samples, per_shard)
    first = _real_shard(root / shard_name("train", 0), per_shard, members) if full else None
    shards = []
    for i in range(full):
        name = shard_name("train", i)
        if i:
            os.symlink(first.name, root / name)
            os.symlink(first.index.name, root / index_name(name))
        shards.append(ShardInfo(name, per_shard, per_shard, first.bytes, first.sha256,
                                IndexInfo(index_name(name), first.index.bytes, first.index.sha256)))
    if rest:
        shards.append(_real_shard(root / shard_name("train", full), rest, members))
    manifest = Manifest("sa1b", {"train": shards}, {"synthetic": True}, f"synthetic-{samples}-{per_shard}")
    (root / "manifest.json").write_bytes(manifest.to_json())
    return manifest
