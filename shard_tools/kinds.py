"""The kinds on the packing side, name -> what the kind's packing module declares (`PackingKind`):
its subcommand, what it adds to `shard-pack index` and to `preview`, its loader options as flags.
`shard_tools.cli`, `shard_tools.index` and `shard_tools.preview` look kinds up here and name none.

A new kind is its reading module (`pipeline/kinds/`, one entry in `pipeline.kinds.KINDS`), its
packing module here (`shard_tools/NEW.py`, declaring `PACKING`) and one entry below. The order is
`--help`'s.
"""

from __future__ import annotations

from shard_tools import embeddings, sa1b, vqa, webdataset
from shard_tools.plugin import KindOption, PackingKind

__all__ = ["KINDS", "KindOption", "PackingKind"]

KINDS: dict[str, PackingKind] = {
    "sa1b": sa1b.PACKING,
    "vqa": vqa.PACKING,
    "embeddings": embeddings.PACKING,
    "webdataset": webdataset.PACKING,
}
