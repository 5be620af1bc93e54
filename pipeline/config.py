"""`LoaderConfig`: every kind-independent setting of a loader, built with keywords and validated on
construction (the kind's own options, such as `image_size`, belong to the kind: `pipeline.kinds`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pipeline.checks import is_int_at_least
from pipeline.errors import ConfigError
from pipeline.plan import shuffle_name
from pipeline.storage import Retry
from pipeline.storage.places import check_roots
from pipeline.tario import ReadLimits

__all__ = ["LoaderConfig", "DATALOADER_SETTINGS"]

# The settings of the torch DataLoader that iterates the stream (`make_stream_dataset` leaves them to its user's).
DATALOADER_SETTINGS = ("num_workers", "device", "pin_memory", "prefetch_factor", "persistent_workers",
                       "multiprocessing_context")


def _at_least(name: str, value: Any, low: int) -> None:
    if not is_int_at_least(value, low):
        raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """Loader settings (see `make_stream_loader` for what each does); `None` for `limits` and `retry`
    means their defaults."""

    batch_size: int
    num_workers: int = 0
    shuffle: bool | str = True  # True: "shards-then-window", False: "none", or a name in `plan.SHUFFLES`
    seed: int = 0
    drop_last: bool = True
    shuffle_window: int = 16384
    on_error: str = "raise"
    max_errors: int | float | None = None  # with on_error="skip": more skips in an epoch, or a larger fraction, fail
    limits: ReadLimits = None  # type: ignore[assignment]  # (None: ReadLimits())
    unit_cache_bytes: int = 256 << 20  # per worker: samples of several units kept open for their next units
    retry: Retry = None  # type: ignore[assignment]  # (None: Retry())
    cache_dir: str | None = None  # with cache_limit: whole shards kept on local disk (see storage.ShardCache)
    cache_limit: int | None = None
    # With a cache: each worker's first batch is read by range (True: sooner), or taken from the node's
    # downloads like every later one (False: no request of its own, it waits for its shards' bytes).
    first_batch_by_range: bool = True
    read_ahead: int = 1  # batches whose samples are read while the current one decodes
    # Object storage: samples read ahead in merged byte spans (`pipeline.read.merge_spans`), at most this many
    # bytes of spans held per worker (fetched or in flight, not yet used); 0: one request per sample.
    read_ahead_bytes: int = 256 << 20
    read_amplification: float = 2.0  # a span reads at most this many times the bytes of the samples it serves
    read_threads: int = 8  # per worker
    index_cache_bytes: int = 64 << 20  # per worker and dataset: shard indexes kept (least recently used dropped)
    verify: str = "size"  # or "sha256": each local shard's content checked once per loader
    rank: int | None = None  # with world_size; neither: torch.distributed's (see loader.make_stream_loader)
    world_size: int | None = None
    storage_options: dict[str, Any] | None = None  # fsspec's, for every source
    # Places outside a dataset's folder that its manifest may name (paths or URLs; see `storage.places`):
    # archives indexed in place elsewhere. Nothing else outside the folder is read.
    allowed_roots: Sequence[str] = ()
    weights: Sequence[float] | None = None  # several sources mixed in these shares
    epoch_size: int | None = None  # samples per epoch of a mix
    # Outputs attached to each batch: {batch field: the sidecar holding it} (`pipeline.outputs.attach`).
    attach: Mapping[str, str] | tuple[tuple[str, str], ...] = ()
    stats_every: int | None = None  # log `loader.stats()` (INFO, logger "pipeline.loader") every this many batches
    stats_callback: Callable[[Any], None] | None = None  # ... and hand it to this (a metrics logger's; main process)
    # Seconds without any DataLoader worker's progress before an iteration ends with a StallError naming
    # what each worker was doing (None: never). Longer than a throttled request may retry (`Retry`).
    stall_timeout: float | None = 300.0
    # The DataLoader's (DATALOADER_SETTINGS):
    device: str | torch.device | None = None
    pin_memory: bool | None = None
    prefetch_factor: int = 2
    persistent_workers: bool | None = None
    multiprocessing_context: str | None = None

    def __post_init__(self) -> None:
        if self.limits is None:
            object.__setattr__(self, "limits", ReadLimits())
        if self.retry is None:
            object.__setattr__(self, "retry", Retry())
        object.__setattr__(self, "allowed_roots", check_roots(self.allowed_roots))
        for name, low in (("batch_size", 1), ("num_workers", 0), ("seed", 0), ("shuffle_window", 1),
                          ("unit_cache_bytes", 0), ("read_ahead", 0), ("read_threads", 1),
                          ("index_cache_bytes", 0), ("read_ahead_bytes", 0)):
            _at_least(name, getattr(self, name), low)
        if not is_int_at_least(self.prefetch_factor, 1):
            raise ConfigError("prefetch_factor must be an int >= 1 (batches each worker prepares ahead), "
                              f"got {self.prefetch_factor!r}")
        shuffle_name(self.shuffle)
        amplification = self.read_amplification
        is_number = isinstance(amplification, (int, float)) and not isinstance(amplification, bool)
        if not (is_number and amplification >= 1):
            raise ConfigError("read_amplification must be a number >= 1 (bytes a span may read per byte of the "
                              f"samples it serves), got {amplification!r}")
        if self.verify not in ("size", "sha256"):
            raise ConfigError(f"verify must be 'size' or 'sha256', got {self.verify!r}")
        if self.on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        budget = self.max_errors
        if not (budget is None or is_int_at_least(budget, 0)
                or (isinstance(budget, float) and 0 < budget < 1)):
            raise ConfigError(f"max_errors must be None, an int >= 0 or a fraction in (0, 1), got {budget!r}")
        if not isinstance(self.first_batch_by_range, bool):
            raise ConfigError(f"first_batch_by_range must be True or False, got {self.first_batch_by_range!r}")
        if (self.cache_dir is None) != (self.cache_limit is None):
            raise ConfigError(f"cache_dir and cache_limit go together, got {self.cache_dir!r} and {self.cache_limit!r}")
        if (self.rank is None) != (self.world_size is None):
            raise ConfigError(f"rank and world_size go together, got rank={self.rank!r} and world_size="
                              f"{self.world_size!r}: pass both, or neither to take them from torch.distributed")
        if self.stats_every is not None:
            _at_least("stats_every", self.stats_every, 1)
        if self.stats_callback is not None and (not callable(self.stats_callback) or self.stats_every is None):
            raise ConfigError(f"stats_callback must be a function taking loader.stats(), with stats_every: how "
                              f"many batches apart it is called; got {self.stats_callback!r}, "
                              f"stats_every={self.stats_every}")
        timeout = self.stall_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < float("inf")):
            raise ConfigError(f"stall_timeout must be None or a number of seconds > 0, got {timeout!r}")
        if self.world_size is not None:
            _at_least("world_size", self.world_size, 1)
            _at_least("rank", self.rank, 0)
        attach = tuple(self.attach.items()) if isinstance(self.attach, Mapping) else self.attach
        if not isinstance(attach, tuple) or not all(isinstance(p, tuple) and len(p) == 2
                                                    and all(isinstance(x, str) for x in p) for p in attach):
            raise ConfigError(f"attach must be a dict {{batch field: sidecar place}}, got {self.attach!r}")
        object.__setattr__(self, "attach", attach)  # (picklable and hashable, in the order given)

    @classmethod
    def split(cls, settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Keywords -> (this config's settings, the rest: the kind's options)."""
        names = {f.name for f in dataclasses.fields(cls)}
        ours = {k: v for k, v in settings.items() if k in names}
        return ours, {k: v for k, v in settings.items() if k not in names}
