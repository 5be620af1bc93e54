"""What a kind's packing module declares to the registry (`shard_tools.kinds.KINDS`): its
subcommand, what it adds to `shard-pack index` and to `preview`, and its loader options as `tune`
and `preview` flags. The CLI, the index run and the preview look a kind up there and never name one.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from shard_tools.drawing import Drawing
from shard_tools.flags import Subparsers
from shard_tools.scan import Indexing

__all__ = ["KindOption", "PackingKind"]


@dataclasses.dataclass(frozen=True)
class KindOption:
    """One of the kind's loader options (make_stream_loader's) as a `tune`/`preview` flag, e.g.
    `--image-size`: a flag several kinds take is one flag, its type and choices the first kind's,
    its help theirs joined by ", "."""

    flag: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


@dataclasses.dataclass(frozen=True)
class PackingKind:
    """A kind on the packing side. `add(subparsers, name, dask)` adds its subcommand's parser (`dask`:
    its `--dask` help, as the CLI words it) and `run(args)` packs, returning the exit code (none: no
    subcommand); `index`: how `shard-pack index` finds its samples in archives (none: it cannot be
    indexed in place); `preview`: how `preview` draws it; `options`: its loader options' flags;
    `key_number`: the number in its samples' keys, a regular expression whose one group is it and
    its base (`shard-pack link`'s default; none: no default)."""

    add: Callable[[Subparsers, str, str], argparse.ArgumentParser] | None = None
    run: Callable[[argparse.Namespace], int] | None = None
    index: Indexing | None = None
    preview: Drawing | None = None
    options: tuple[KindOption, ...] = ()
    key_number: tuple[str, int] | None = None
