"""The kinds of datasets on the reading side: the `Kind` protocol and the registry, name -> class.

A kind object holds its options (built from the manifests and the user's options by `of`) and
turns a sample's tar members into batches. A sample may hold several units (rows of a block,
questions of an image): when `units` is true the plan orders units, the loader opens a sample once
and decodes its units one by one, or, for a `grouped` kind, all of a batch's units of a sample at
once (an array of them: the batch holds them together, samples in order of their first unit).
A new kind is one module here and one entry in `KINDS` (and its name in `format.KIND_NAMES`).
A kind declares its finished batch as data (`fields(epoch)`, of `schema.BatchField`); its `check`
is `schema.problems` (keys, dtypes, shapes) and then whatever else its values must hold.

Stats: `decode` is handed a `pipeline.stats.Clock` and may time parts of its work on it under the
names in `stages` (`clock.mark()` before a part, `clock.split(name)` after it); `loader.stats()`
shows each as "decode (name)" and the rest of the call as "decode (rest)".
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any, Protocol

from pipeline.config import LoaderConfig
from pipeline.errors import ConfigError
from pipeline.format import Manifest
from pipeline.kinds.embeddings import Embeddings
from pipeline.kinds.sa1b import Sa1b
from pipeline.kinds.vqa import Vqa
from pipeline.stats import Clock
from pipeline.tario import ReadLimits
from pipeline.kinds.webdataset import WebDataset

__all__ = ["Kind", "KINDS", "kind_of"]


class Kind(Protocol):
    """What the loader and `shard-pack verify` ask of a kind (see the module docstring)."""

    options: Any  # the kind's frozen options
    grouped: bool
    units: bool  # whether the plan orders a sample's units (else: samples)
    stages: tuple[str, ...]  # the parts of `decode` it times on its clock (see the module docstring)
    takes: frozenset[str]  # the options `of` takes from the user (the rest of its options: manifests', limits')

    @classmethod
    def of(cls, manifests: Sequence[Manifest], limits: Any, **options: Any) -> Kind:
        """The kind for these datasets and the user's options (an unknown option: TypeError)."""

    @classmethod
    def for_verify(cls, manifest: Manifest) -> Kind:
        """The kind with options that decode everything a sample holds (`shard-pack verify`)."""

    def open(self, members: dict[str, Any], *, url: str, key: str, units: int) -> Any:
        """A sample's members -> what `decode` takes (checked against the `units` the index says)."""

    def decode(self, opened: Any, *, unit: Any, seed: int, epoch: int, url: str, key: str, clock: Clock) -> Any:
        """One unit (or, grouped, an array of units) of an opened sample, as `collate` takes it; the
        time of its `stages` on `clock`."""

    def collate(self, samples: Sequence[Any], epoch: int) -> Any:
        """Decoded samples -> a batch in transit (in a worker)."""

    def finish(self, batch: Any) -> Any:
        """A batch in transit -> the batch users get (after the device copy)."""

    def unbatch(self, batch: Any) -> list[dict[str, Any]]:
        """A finished batch's samples, padding trimmed."""

    def check(self, batch: Any, epoch: int) -> list[str]:
        """Problems of a finished batch (keys, shapes, dtypes, ranges); none: []."""

    def depends(self, inputs: frozenset[str] | None) -> tuple[bool, frozenset[str]]:
        """Whether batch fields `inputs` (None: the whole sample) can change with the epoch, and the
        options that shape them: what outputs computed from them are of (`pipeline.outputs`)."""


KINDS: dict[str, type[Kind]] = {"sa1b": Sa1b, "vqa": Vqa, "embeddings": Embeddings, "webdataset": WebDataset}


def kind_of(manifests: Sequence[Manifest], limits: Any, **options: Any) -> Kind:
    """The kind of these datasets (all of one kind) with the user's options; options the kind does
    not take are refused, each named with the closest name it may have meant."""
    name = manifests[0].kind
    if name != "webdataset" and {"decode", "collate"} & set(options):
        raise ConfigError(f"decode= and collate= are for webdataset datasets (`shard-pack index webdataset`); {name} "
                          f"datasets are decoded by their kind, pipeline.kinds.{name} "
                          f"(its options: see make_stream_loader)")
    kind = KINDS[name]
    unknown = sorted(set(options) - kind.takes)
    if unknown:
        raise ConfigError(f"{name} datasets do not take {', '.join(_meant(o, kind.takes) for o in unknown)}: "
                          f"neither an option of theirs ({', '.join(sorted(kind.takes))}) nor a loader setting "
                          f"(see LoaderConfig)")
    return kind.of(manifests, limits, **options)


_LIMITS = frozenset(f.name for f in dataclasses.fields(ReadLimits))
_SETTINGS = frozenset(f.name for f in dataclasses.fields(LoaderConfig))


def _meant(option: str, takes: frozenset[str]) -> str:
    """An option no kind or setting has, with what it may have meant."""
    if option in _LIMITS:
        return f"{option!r} (a read limit: limits=ReadLimits({option}=...))"
    close = difflib.get_close_matches(option, sorted(takes | _SETTINGS), n=1)
    return f"{option!r} (did you mean {close[0]!r}?)" if close else repr(option)
