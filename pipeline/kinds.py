"""The registry of kinds on the reading side: how each decodes, collates and checks its batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pipeline import sa1b

__all__ = ["Kind", "KINDS"]


@dataclasses.dataclass(frozen=True)
class Kind:
    options: type  # frozen dataclass of the kind's decoding options
    decode: Callable[..., dict[str, Any]]  # (members, options, *, seed, epoch, url, key) -> sample
    collate: Callable[..., dict[str, Any]]  # (samples, options) -> batch in transit (in a worker)
    finish: Callable[..., dict[str, Any]]  # (batch, options) -> batch for the user (after the device copy)
    check: Callable[..., list[str]]  # (batch, options, epoch) -> problems
    verify_options: Any  # options that decode everything a sample holds, for `shard-pack verify`


KINDS: dict[str, Kind] = {
    "sa1b": Kind(sa1b.Sa1bOptions, sa1b.decode_sample, sa1b.collate, sa1b.finish, sa1b.check_batch,
                 sa1b.Sa1bOptions(image_size=256, mask_size=64, max_masks=1 << 30)),
}
