"""`make_stream_loader`: shards -> (plan) -> read -> decode -> collate -> device, as a torch DataLoader."""

from __future__ import annotations

import dataclasses
import logging
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.device import prefetch_to_cuda, to_device
from pipeline.errors import ShardError, ShardstreamError
from pipeline.format import Manifest
from pipeline.kinds import KINDS
from pipeline.plan import World, plan_epoch, rank_batch_sizes
from pipeline.storage import filesystem, join, read_manifest, read_range
from pipeline.tario import parse_sample

__all__ = ["LoaderConfig", "StreamLoader", "make_stream_loader", "validate_first_batch"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """Kind-independent loader settings, validated on construction."""

    batch_size: int
    num_workers: int = 0
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = True
    shuffle_window: int = 16384
    on_error: str = "raise"

    def __post_init__(self) -> None:
        for name, low in (("batch_size", 1), ("num_workers", 0), ("seed", 0), ("shuffle_window", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")


@dataclasses.dataclass(frozen=True)
class _WorkerError:
    """An error of ours raised in a worker, sent as a value: torch would re-raise it as a bare RuntimeError."""

    error: ShardstreamError


class _ShardStream(IterableDataset):
    """Yields this worker's collated batches of one split for the epoch held in shared memory."""

    def __init__(self, root: str, manifest: Manifest, split: str, options: Any, config: LoaderConfig,
                 rank: int, world_size: int, storage_options: dict[str, Any] | None) -> None:
        shards = manifest.splits[split]
        self.root, self.names = root, [s.name for s in shards]
        self.keys = [s.keys for s in shards]
        self.offsets = [np.asarray(s.offsets, dtype=np.int64) for s in shards]
        self.sizes = [s.samples for s in shards]
        self.first_id = np.concatenate(([0], np.cumsum(self.sizes)[:-1])).astype(np.int64)
        self.kind = KINDS[manifest.kind]
        self.options, self.config = options, config
        self.rank, self.world_size = rank, world_size
        self.storage_options = storage_options
        # Shared with the workers (fork or spawn): the epoch, set by the main process, and skip counts.
        self.epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.skipped = torch.zeros(max(1, config.num_workers), dtype=torch.int64).share_memory_()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        world = World(self.rank, self.world_size, info.id if info else 0, info.num_workers if info else 1)
        try:
            yield from self._batches(world, int(self.epoch[0]))
        except ShardstreamError as exc:
            if info is None:
                raise
            exc.add_note(f"in DataLoader worker {info.id}:\n{traceback.format_exc()}")
            yield _WorkerError(exc)

    def _batches(self, world: World, epoch: int) -> Iterator[dict[str, Any]]:
        cfg = self.config
        plan = plan_epoch(self.sizes, cfg.seed, epoch, world, batch_size=cfg.batch_size, drop_last=cfg.drop_last,
                          shuffle=cfg.shuffle, window=cfg.shuffle_window)
        fs, base = filesystem(self.root, self.storage_options)
        for batch, ids in plan:
            samples = []
            for sample_id in ids:
                shard = int(np.searchsorted(self.first_id, sample_id, side="right")) - 1
                try:
                    samples.append(self._load(fs, base, shard, int(sample_id - self.first_id[shard]), epoch))
                except ShardstreamError as exc:
                    if cfg.on_error == "raise":
                        raise
                    self.skipped[world.worker] += 1
                    log.warning("skipped: %s", exc)
            if not samples:
                raise ShardError(self.root, f"all {len(ids)} samples of batch {batch} failed; ranks cannot stay in step")
            yield self.kind.collate(samples, self.options)

    def _load(self, fs: Any, base: str, shard: int, index: int, epoch: int) -> dict[str, Any]:
        name, key = self.names[shard], self.keys[shard][index]
        url = join(self.root, name)
        start, end = self.offsets[shard][index : index + 2]
        data = read_range(fs, join(base, name), url, int(start), int(end))
        members = parse_sample(data, url, key)
        return self.kind.decode(members, self.options, seed=self.config.seed, epoch=epoch, url=url, key=key)


class StreamLoader:
    """Iterable over batches of one split; `len()` is this process's exact batch count per epoch."""

    def __init__(self, stream: _ShardStream, loader: DataLoader, device: torch.device | None, batches: int,
                 manifest: Manifest) -> None:
        self._stream, self._loader, self.device, self._batches = stream, loader, device, batches
        self.manifest = manifest

    @property
    def epoch(self) -> int:
        return int(self._stream.epoch[0])

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next `iter()` plays (its shuffle and mask sampling). Call before iterating."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._stream.epoch[0] = epoch

    @property
    def skipped(self) -> int:
        """Samples skipped so far (on_error='skip'), over all epochs and workers of this process."""
        return int(self._stream.skipped.sum())

    def __len__(self) -> int:
        return self._batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches: Iterator[dict[str, Any]] = map(_raise_worker_errors, self._loader)
        if self.device is not None and self.device.type == "cuda":
            batches = prefetch_to_cuda(batches, self.device)
        elif self.device is not None:
            batches = (to_device(b, self.device) for b in batches)
        kind, options = self._stream.kind, self._stream.options
        return (kind.finish(b, options) for b in batches)


def _raise_worker_errors(batch: Any) -> dict[str, Any]:
    if isinstance(batch, _WorkerError):
        raise batch.error
    return batch


def _resolve_device(device: str | torch.device | None, pin_memory: bool | None) -> tuple[torch.device | None, bool]:
    resolved = None if device is None else torch.device(device)
    if resolved is not None and resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device={str(device)!r} but CUDA is not available (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'no'}); use device='cpu' or None"
        )
    cuda = resolved is not None and resolved.type == "cuda"
    if pin_memory and not cuda:
        raise ValueError("pin_memory=True needs device='cuda' (pinned memory only helps copies to the GPU)")
    return resolved, cuda if pin_memory is None else pin_memory


def make_stream_loader(
    source: str,
    split: str,
    *,
    batch_size: int,
    num_workers: int,
    shuffle: bool = True,
    seed: int = 0,
    device: str | torch.device | None = None,
    pin_memory: bool | None = None,
    prefetch_factor: int = 2,
    persistent_workers: bool | None = None,
    drop_last: bool = True,
    image_size: int = 1024,
    mask_size: int | None = 256,
    max_masks: int | Callable[[int], int] = 64,
    on_error: str = "raise",
    shuffle_window: int = 16384,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    multiprocessing_context: str | None = None,
) -> StreamLoader:
    """A loader over `split` of the dataset at `source` (a folder written by `shard-pack`).

    Every sample of the split is yielded exactly once per epoch across all ranks and workers
    (but for the `drop_last` remainder), every rank yields `len(loader)` batches, and the order is
    a function of (seed, epoch) only. `rank`/`world_size` default to torch.distributed's when it
    is initialised. `persistent_workers=None` keeps workers alive across epochs when there are any.
    """
    config = LoaderConfig(batch_size, num_workers, shuffle, seed, drop_last, shuffle_window, on_error)
    resolved, pin = _resolve_device(device, pin_memory)
    if rank is None and world_size is None and dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    world = World(rank or 0, world_size or 1)
    manifest = read_manifest(source, storage_options)
    if split not in manifest.splits:
        raise ValueError(f"{source}: no split {split!r}; the dataset has {sorted(manifest.splits)}")
    options = KINDS[manifest.kind].options(image_size=image_size, mask_size=mask_size, max_masks=max_masks)
    total = manifest.samples(split)
    batches = len(rank_batch_sizes(total, world.world_size, world.rank, batch_size, drop_last)[1])
    if batches == 0:
        raise ValueError(
            f"{source}: split {split!r} has {total} samples, too few for one batch of {batch_size} "
            f"on each of {world.world_size} ranks with drop_last=True"
        )
    stream = _ShardStream(source, manifest, split, options, config, world.rank, world.world_size, storage_options)
    loader = DataLoader(
        stream,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin,
        prefetch_factor=prefetch_factor if num_workers else None,
        persistent_workers=bool(num_workers) if persistent_workers is None else persistent_workers,
        multiprocessing_context=multiprocessing_context if num_workers else None,
    )
    return StreamLoader(stream, loader, resolved, batches, manifest)


def validate_first_batch(loader: StreamLoader) -> dict[str, Any]:
    """Take the loader's first batch and check keys, shapes, dtypes, finiteness and ranges; return it."""
    batch = next(iter(loader))
    stream = loader._stream
    problems = stream.kind.check(batch, stream.options, loader.epoch)
    if problems:
        raise ValueError("first batch is invalid:\n  " + "\n  ".join(problems))
    return batch
