"""Any WebDataset tars indexed in place (`shard-pack index webdataset`), decoded by the user's own
function: `make_stream_loader(root, split, batch_size=..., decode=fn, collate=None)`.

`decode(sample)` gets a sample as webdataset's own pipelines give it: a dict of its members by
extension (`"jpg"`, `"seg.png"`, ...) as `bytes`, with `"__key__"` (the sample's key) and
`"__url__"` (its archive) beside them (in the dict, as webdataset puts them, not as a second
argument: a function written for a webdataset pipeline's `map` works unchanged), and returns
anything `collate` takes (by default torch's `default_collate`; the batch reaches you as torch's
DataLoader hands batches over, so a tuple comes as a list). Members come as bytes, not views, so
that what `decode` keeps (a dict of them, a lazily decoded image) never pins a shard's memory
mapping, and `json.loads` or `bytes.decode` work on them as in a webdataset pipeline. Both
functions run in the DataLoader workers; with `multiprocessing_context="spawn"` they must be
picklable (defined at a module's top level, not lambdas or local functions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from pipeline.collate import rows
from pipeline.errors import ConfigError, SampleError, ShardstreamError
from pipeline.kinds.schema import BatchField, every_option
from pipeline.stats import Clock

__all__ = ["WebDataset", "WebDatasetOptions"]


@dataclasses.dataclass(frozen=True)
class WebDatasetOptions:
    """The user's functions: `decode(members) -> sample` and `collate(samples) -> batch`."""

    decode: Callable[[dict[str, Any]], Any]
    collate: Callable[[list[Any]], Any] = default_collate

    def __post_init__(self) -> None:
        for name in ("decode", "collate"):
            if not callable(getattr(self, name)):
                raise ConfigError(f"{name} must be a function, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Decoded:
    """A decoded sample in a worker, with its place for the messages of a batch that fails to collate."""

    sample: Any
    url: str
    key: str


@dataclasses.dataclass(frozen=True)
class WebDataset:
    """The `webdataset` kind (`pipeline.kinds.Kind`): the user's functions, run in the workers."""

    options: WebDatasetOptions
    grouped = False
    units = False
    stages = ()  # the user's decode is one stage
    takes = frozenset(f.name for f in dataclasses.fields(WebDatasetOptions))

    @classmethod
    def of(cls, manifests: Sequence[Any], limits: Any, *, decode: Any = None,
           collate: Any = None) -> WebDataset:
        if decode is None:
            raise ConfigError("a webdataset dataset (indexed by `shard-pack index webdataset`) is decoded by your own "
                              "function: pass decode=fn, fn(members: dict[str, bytes]) -> sample (see "
                              "pipeline.kinds.webdataset)")
        return cls(WebDatasetOptions(decode, default_collate if collate is None else collate))

    @classmethod
    def for_verify(cls, manifest: Any) -> WebDataset:
        """Members checked only (`shard-pack verify` has no user decode): `dict` copies them."""
        return cls(WebDatasetOptions(dict))

    def open(self, members: dict[str, Any], *, url: str, key: str, units: int) -> dict[str, Any]:
        return members

    def decode(self, members: dict[str, Any], *, unit: Any, seed: int, epoch: int, url: str, key: str,
               clock: Clock) -> Decoded:
        sample = {ext: bytes(data) for ext, data in members.items()}
        sample["__key__"], sample["__url__"] = key, url
        try:
            return Decoded(self.options.decode(sample), url, key)
        except Exception as exc:  # (the user's function: any exception is this sample's)
            raise SampleError(f"decode raised {type(exc).__name__}: {exc}"[:500], url=url, key=key) from exc

    def collate(self, samples: Sequence[Decoded], epoch: int) -> Any:
        try:
            return self.options.collate([s.sample for s in samples])
        except Exception as exc:  # (the user's function, or default_collate refusing what decode returned)
            keys = ", ".join(f"{s.url}:{s.key}" for s in samples)
            raise ShardstreamError(f"collate raised {type(exc).__name__} on the batch of samples {keys}: "
                                   f"{exc}"[:2000]) from exc

    def finish(self, batch: Any) -> Any:
        return batch

    def unbatch(self, batch: Any) -> list[dict[str, Any]]:
        """Rows of a batch that is a dict of tensors and lists of one length (as default_collate makes
        from dict samples); any other batch is refused: only its collate knows its rows."""
        lengths = {len(v) for v in batch.values() if isinstance(v, (torch.Tensor, list))} \
            if isinstance(batch, dict) else set()
        if not isinstance(batch, dict) or len(lengths) != 1 or \
                not all(isinstance(v, (torch.Tensor, list)) for v in batch.values()):
            raise ConfigError(f"flatten needs batches that are a dict of tensors and lists of one length; this collate "
                              f"makes a {type(batch).__name__}: use make_stream_dataset without flatten")
        return rows(batch)

    def fields(self, epoch: int) -> tuple[BatchField, ...]:
        """None declared: the user's collate decides what a batch holds."""
        return ()

    def depends(self, inputs: frozenset[str] | None) -> tuple[bool, frozenset[str]]:
        return every_option(self.options, False)  # (`decode` is not given the epoch)

    def check(self, batch: Any, epoch: int) -> list[str]:
        """None of its own: the user's functions decide what a batch holds."""
        return [] if batch is not None else ["the batch is None"]
