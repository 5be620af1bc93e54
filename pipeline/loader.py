"""`make_stream_loader`: shards -> (plan) -> read -> decode -> collate -> device, as a torch DataLoader."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.ma  # noqa: F401  (np.unique imports it on first use: ~0.1 s of each worker's first batch)
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.collate import Leases
from pipeline.device import prefetch_to_cuda, to_device
from pipeline.errors import ManifestError, ShardError, ShardstreamError
from pipeline.format import Manifest, ShardIndex, ShardInfo, Split
from pipeline.kinds import KINDS, Kind
from pipeline.plan import Mix, Resume, World, epoch_samples, plan_epoch, rank_batch_count, rank_sample_count
from pipeline.storage import Retry, ShardCache, ShardReader, filesystem, is_local, read_manifest, shard_url
from pipeline.tario import ReadLimits, parse_sample

__all__ = ["LoaderConfig", "StreamLoader", "make_stream_loader", "make_stream_dataset", "validate_first_batch"]

log = logging.getLogger(__name__)
STATE_VERSION = 3  # 3: the mixed order is windowed (a state of an earlier mixed epoch would not resume exactly)
_MAX_STRETCHES = 16  # resumptions within one epoch
# Settings a saved state must share with the loader that resumes it: they decide the samples' order.
_ORDER_SETTINGS = ("seed", "batch_size", "drop_last", "shuffle", "shuffle_window")


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
    max_errors: int | float | None = None  # with on_error="skip": more skips in an epoch, or a larger fraction, fail
    limits: ReadLimits = ReadLimits()
    unit_cache_bytes: int = 256 << 20  # per worker: samples of several units kept open for their next units
    retry: Retry = Retry()
    cache_dir: str | None = None  # with cache_limit: whole shards kept on local disk (see storage.ShardCache)
    cache_limit: int | None = None
    read_ahead: int = 1  # batches whose samples are read while the current one decodes
    read_threads: int = 8  # per worker
    index_cache_bytes: int = 64 << 20  # per worker and dataset: shard indexes kept (least recently used dropped)
    verify: str = "size"  # or "sha256": each local shard's content checked once per loader (see make_stream_loader)

    def __post_init__(self) -> None:
        for name, low in (("batch_size", 1), ("num_workers", 0), ("seed", 0), ("shuffle_window", 1),
                          ("unit_cache_bytes", 0), ("read_ahead", 0), ("read_threads", 1),
                          ("index_cache_bytes", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.verify not in ("size", "sha256"):
            raise ValueError(f"verify must be 'size' or 'sha256', got {self.verify!r}")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        budget = self.max_errors
        if not (budget is None or (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0)
                or (isinstance(budget, float) and 0 < budget < 1)):
            raise ValueError(f"max_errors must be None, an int >= 0 or a fraction in (0, 1), got {budget!r}")
        if (self.cache_dir is None) != (self.cache_limit is None):
            raise ValueError(f"cache_dir and cache_limit go together, got {self.cache_dir!r} and {self.cache_limit!r}")
        if self.cache_limit is not None and (not isinstance(self.cache_limit, int) or self.cache_limit < 1):
            raise ValueError(f"cache_limit must be a positive number of bytes, got {self.cache_limit!r}")


@dataclasses.dataclass(frozen=True)
class _WorkerError:
    """An error of ours raised in a worker, sent as a value: torch would re-raise it as a bare RuntimeError."""

    error: ShardstreamError


@dataclasses.dataclass(frozen=True, eq=False)
class _Source:
    """One dataset's split, as the planner and the reader need it: per-shard counts only (each
    sample's key, span and units come from its shard's index, in the worker that reads it).

    Samples are numbered over the split's shards in order; the plan's items (units, or samples
    when the kind's options yield each sample once) likewise."""

    root: str
    split: Split
    by_units: bool  # the plan orders each sample's units (else: samples)
    sizes: np.ndarray  # the plan's items per shard
    first_sample: np.ndarray  # each shard's first sample, then the split's sample count
    first_item: np.ndarray  # each shard's first plan item, then the item count

    @classmethod
    def of(cls, root: str, manifest: Manifest, split: str, by_units: bool) -> _Source:
        shards = manifest.splits[split]
        sizes = shards.unit_counts if by_units else shards.sample_counts
        return cls(root, shards, by_units, sizes, np.concatenate(([0], np.cumsum(shards.sample_counts))),
                   np.concatenate(([0], np.cumsum(sizes))))

    def where(self, sample: int) -> tuple[int, int]:
        """(shard, index in the shard) of a sample."""
        shard = int(np.searchsorted(self.first_sample, sample, side="right")) - 1
        return shard, sample - int(self.first_sample[shard])


_Where = tuple[int, int]  # a sample: (source, sample number in the source's split)


class _Opened(collections.OrderedDict[_Where, tuple[Any, int, str, str]]):
    """Samples of several units kept open for their next units, (sample, bytes, url, key) each: the
    least recently used go past `limit` bytes or `count` samples (but the newest)."""

    def __init__(self, limit: int, count: int = 1 << 16) -> None:
        super().__init__()
        self.limit, self.count, self.held = limit, count, 0

    def keep(self, where: _Where, entry: tuple[Any, int, str, str]) -> None:
        self[where] = entry
        self.held += entry[1]
        while (self.held > self.limit or len(self) > self.count) and len(self) > 1:
            self.held -= self.popitem(last=False)[1][1]


class _ShardStream(IterableDataset):
    """Yields this worker's collated batches of one split for the epoch held in shared memory."""

    def __init__(self, sources: list[_Source], mix: Mix | None, kind: str, options: Any, config: LoaderConfig,
                 rank: int, world_size: int, storage_options: dict[str, Any] | None) -> None:
        self.sources, self.mix = sources, mix
        self.total = epoch_samples([s.sizes for s in sources], mix)  # items in an epoch, before the split over ranks
        self.kind_name = kind
        self.options, self.config = options, config
        self.rank, self.world_size = rank, world_size
        self.storage_options = storage_options
        # Shared with the workers (fork or spawn), set by the main process: the epoch, then the
        # epoch's resumption history (count, then world_size and batches per stretch).
        self.state = torch.zeros(2 + 2 * _MAX_STRETCHES, dtype=torch.int64).share_memory_()
        # Samples skipped per worker: over all epochs (row 0) and in the current iteration (row 1).
        self.skipped = torch.zeros(2, max(1, config.num_workers), dtype=torch.int64).share_memory_()
        # With verify="sha256": per shard of each source, the (inode, size, mtime) whose content matched
        # the manifest's SHA-256, shared so that a shard is hashed by one worker only.
        self.verified = torch.zeros(sum(len(s.split) for s in sources), 3, dtype=torch.int64).share_memory_() \
            if config.verify == "sha256" else None
        self.errors_as_values = True  # False when another DataLoader than ours iterates it (make_stream_dataset)
        self.finished = False  # True: yield batches as users get them (`Kind.finish`), not in transit
        self.flatten = False  # True (with `finished`): yield each batch's samples (`Kind.unbatch`)
        self.split_workers = True  # False: whoever iterates reads the rank's whole share, in any DataLoader worker
        self.leases: Leases | None = None  # workers recycle batch buffers our own DataLoader hands back
        self._reader_pid: int | None = None
        self._reader_list: list[ShardReader] = []
        self._opened = _Opened(config.unit_cache_bytes)

    @property
    def kind(self) -> Kind:
        return KINDS[self.kind_name]

    @property
    def epoch(self) -> int:
        return int(self.state[0])

    @property
    def history(self) -> tuple[Resume, ...]:
        pairs = self.state[2 : 2 + 2 * int(self.state[1])].tolist()
        return tuple(Resume(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2))

    def set_state(self, epoch: int, history: tuple[Resume, ...]) -> None:
        if len(history) > _MAX_STRETCHES:
            raise ValueError(f"an epoch can be resumed at most {_MAX_STRETCHES} times")
        values = [epoch, len(history)] + [v for h in history for v in (h.world_size, h.batches)]
        self.state.zero_()
        self.state[: len(values)] = torch.tensor(values, dtype=torch.int64)

    def rank_samples(self, history: tuple[Resume, ...]) -> int:
        """How many samples this rank yields after `history`."""
        c = self.config
        return rank_sample_count(self.total, self.world_size, self.rank, c.batch_size, c.drop_last, history)

    def batches(self) -> int:
        """How many batches this rank yields in the next iteration (all of the epoch, or the rest)."""
        c = self.config
        return rank_batch_count(self.total, self.world_size, self.rank, c.batch_size, c.drop_last, self.history)

    def __len__(self) -> int:
        """Items the next iteration yields on this rank: batches, or samples with `flatten` (fewer if some are skipped)."""
        return self.rank_samples(self.history) if self.flatten else self.batches()

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration plays, from the main process (HF Trainer and accelerate
        call this on datasets that have it)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if epoch != self.epoch:
            self.set_state(epoch, ())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info() if self.split_workers else None
        world = World(self.rank, self.world_size, info.id if info else 0, info.num_workers if info else 1)
        if world.num_workers > self.skipped.shape[1]:
            raise ValueError(f"{world.num_workers} DataLoader workers, more than this dataset was made for "
                             f"({self.skipped.shape[1]}); pass max_workers")
        self.skipped[1, world.worker] = 0  # this iteration's skips, counted afresh by each worker
        batches = self._batches(world, self.epoch, self.history)
        try:
            while True:
                self._check_leases(batches)
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                if self.finished:
                    batch = self.kind.finish(batch, self.options)
                yield from self.kind.unbatch(batch, self.options) if self.flatten else (batch,)
        except ShardstreamError as exc:
            if info is None or not self.errors_as_values:
                raise
            exc.add_note(f"in DataLoader worker {info.id}:\n{traceback.format_exc()}")
            yield _WorkerError(exc)
        finally:
            batches.close()

    def _check_leases(self, batches: Iterator[Any]) -> None:
        """Before a batch touches mapped shards: one that another process is rewriting in place is
        named, after dropping every sample read from it (see `ShardReader.check_leases`)."""
        if self._reader_pid != os.getpid():
            return
        problems = [p for reader in self._reader_list for p in reader.check_leases()]
        if problems:
            batches.close()  # (its samples read ahead)
            self._opened = _Opened(self.config.unit_cache_bytes)
            more = f" (and {len(problems) - 1} more shards)" if len(problems) > 1 else ""
            raise ShardError(problems[0][0], problems[0][1] + more)

    def _batches(self, world: World, epoch: int, history: tuple[Resume, ...]) -> Iterator[dict[str, Any]]:
        cfg = self.config
        budget = cfg.max_errors  # skips allowed in this iteration of the rank
        if isinstance(budget, float):
            budget = int(budget * self.rank_samples(history))
        plan = plan_epoch([s.sizes for s in self.sources], cfg.seed, epoch, world, batch_size=cfg.batch_size,
                          drop_last=cfg.drop_last, shuffle=cfg.shuffle, window=cfg.shuffle_window, mix=self.mix,
                          history=history)
        readers = self._readers()  # (and self._opened)
        sized: dict[tuple[int, int], concurrent.futures.Future[None]] = {}  # shards' size checks, this iteration
        opened = self._opened
        inflight: dict[_Where, concurrent.futures.Future[bytes | memoryview]] = {}
        prepared: dict[int, tuple[list[_Where], list[tuple[_Where, Any]]]] = {}
        pool = concurrent.futures.ThreadPoolExecutor(cfg.read_threads, thread_name_prefix="shardstream-read")
        try:
            for i, (batch, _, _) in enumerate(plan):
                # Reads of the next batches overlap decoding (each batch's reads are asked for once).
                for later in range(i + cfg.read_ahead if i else 0, min(i + 1 + cfg.read_ahead, len(plan))):
                    prepared[later] = self._prepare(pool, readers, *plan[later][1:])
                    for where in prepared[later][0]:
                        if where not in opened and where not in inflight:
                            self._submit(pool, readers[where[0]], where, sized, inflight)
                pieces = []
                for where, unit in prepared.pop(i)[1]:
                    try:
                        sample, url, key = self._open(pool, readers[where[0]], where, sized, opened, inflight)
                        pieces.append(self.kind.decode(sample, self.options, unit=unit, seed=cfg.seed, epoch=epoch,
                                                       url=url, key=key))
                    except ShardstreamError as exc:
                        if cfg.on_error == "raise":
                            raise
                        self.skipped[:, world.worker] += len(unit) if self.kind.grouped else 1
                        log.warning("skipped: %s", exc)
                        skipped = int(self.skipped[1].sum())
                        if budget is not None and skipped > budget:
                            raise ShardError(self.sources[where[0]].root, f"{skipped} samples skipped in this epoch, "
                                             f"more than max_errors={cfg.max_errors} allows ({budget}); last: {exc}") from exc
                if not pieces:
                    raise ShardError(self.sources[0].root, f"all {len(plan[i][2])} samples of batch {batch} failed; ranks "
                                     "cannot stay in step")
                yield self._collate(pieces, world)
                if i == 0:
                    for reader in readers:
                        reader.start_downloads()
            for reader in readers:
                reader.start_downloads()  # (an iteration of no batch)
                reader.settle()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _prepare(self, pool: concurrent.futures.ThreadPoolExecutor, readers: list[ShardReader], sources: np.ndarray,
                 ids: np.ndarray) -> tuple[list[_Where], list[tuple[_Where, Any]]]:
        """A batch's samples, in order of first use, and what to decode: (sample, unit) for each unit,
        in plan order, or for a kind that decodes by sample, (sample, its units) for each sample.
        The indexes of the shards it touches are fetched here, at the same time, when not held yet."""
        samples, units = np.empty_like(ids), np.zeros_like(ids)
        for number in np.unique(sources).tolist():
            source, reader = self.sources[number], readers[number]
            mine = np.flatnonzero(sources == number)
            shard = np.searchsorted(source.first_item, ids[mine], side="right") - 1
            local = ids[mine] - source.first_item[shard]
            touched = np.unique(shard).tolist()
            missing = [source.split[i] for i in touched if not reader.holds_index(source.split.names[i])]
            if len(missing) > 1:  # fetched at the same time
                list(pool.map(reader.index, missing))
            indexes = {i: reader.index(source.split[i]) for i in touched}
            for i in touched:
                at = shard == i
                if source.by_units:
                    starts = indexes[i].unit_starts
                    within = np.searchsorted(starts, local[at], side="right") - 1
                    units[mine[at]] = local[at] - starts[within]
                else:
                    within = local[at]
                samples[mine[at]] = source.first_sample[i] + within
        codes = sources << 40 | samples
        unique, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
        appearance = np.argsort(first)
        wheres = [(code >> 40, code & ((1 << 40) - 1)) for code in unique[appearance].tolist()]
        if not self.kind.grouped:
            return wheres, list(zip(zip(sources.tolist(), samples.tolist()), units.tolist()))
        rank = np.empty_like(appearance)
        rank[appearance] = np.arange(len(appearance))
        group = rank[inverse.reshape(-1)]
        ends = np.cumsum(np.bincount(group)).tolist()
        grouped = units[np.argsort(group, kind="stable")]
        return wheres, [(where, grouped[start:end]) for where, start, end in zip(wheres, [0] + ends, ends)]

    def _collate(self, samples: list[Any], world: World) -> Any:
        if self.leases is None or get_worker_info() is None:
            return self.kind.collate(samples, self.options)
        with self.leases.collating(world.worker):
            batch = self.kind.collate(samples, self.options)
        self.leases.lend(world.worker, batch)
        return batch

    def _readers(self) -> list[ShardReader]:
        """This process's readers and open samples: made in the process that reads (filesystems are
        not fork-safe) and kept for its later iterations (a client costs ~0.1-0.3 s to make, and a
        sample opened again costs its checks again)."""
        if self._reader_pid != os.getpid():
            cfg = self.config
            cache = ShardCache(cfg.cache_dir, cfg.cache_limit) if cfg.cache_dir is not None else None
            tables = [None] * len(self.sources)
            if self.verified is not None:
                ends = np.cumsum([len(s.split) for s in self.sources]).tolist()
                table = self.verified.numpy()
                tables = [(table[end - len(s.split) : end], s.split.names) for s, end in zip(self.sources, ends)]
            self._reader_list = [ShardReader(s.root, self.storage_options, cfg.retry, cache, verified,
                                             cfg.index_cache_bytes) for s, verified in zip(self.sources, tables)]
            self._opened = _Opened(cfg.unit_cache_bytes)
            self._reader_pid = os.getpid()
        return self._reader_list

    def __getstate__(self) -> dict[str, Any]:  # (spawned workers make their own readers)
        return {**self.__dict__, "_reader_pid": None, "_reader_list": [], "_opened": None}

    def _submit(self, pool: concurrent.futures.ThreadPoolExecutor, reader: ShardReader, where: _Where,
                sized: dict[tuple[int, int], concurrent.futures.Future[None]],
                inflight: dict[_Where, concurrent.futures.Future[bytes | memoryview]]) -> None:
        """Ask for a sample's bytes and, the first time in this iteration, beside them for its
        shard's size: a shard replaced or cut since packing is named at once (the cache checks
        cached shards' SHA-256 instead)."""
        number, sample = where
        shard, _ = self.sources[number].where(sample)
        if reader.cache is None and (number, shard) not in sized:
            sized[(number, shard)] = pool.submit(self._check_size, reader, number, shard, sample)
        inflight[where] = pool.submit(self._read, reader, where)

    def _sample(self, reader: ShardReader, where: _Where) -> tuple[int, ShardInfo, ShardIndex, int]:
        """(shard number, the shard, its index, the sample's place in it)."""
        source = self.sources[where[0]]
        shard, at = source.where(where[1])
        info = source.split[shard]
        return shard, info, reader.index(info), at

    def _check_size(self, reader: ShardReader, number: int, shard: int, sample: int) -> None:
        _, info, index, at = self._sample(reader, (number, sample))
        size = reader.size(info.name, index.key(at))
        if size != info.bytes:
            raise ShardError(shard_url(self.sources[number].root, info.name), f"sample {index.key(at)!r}: shard is {size} "
                             f"bytes, the manifest says {info.bytes}")

    def _read(self, reader: ShardReader, where: _Where) -> bytes | memoryview:
        """One sample's bytes (in a reader thread)."""
        _, info, index, at = self._sample(reader, where)
        key, (start, end) = index.key(at), index.span(at)
        limits = self.config.limits
        if end - start > limits.max_sample_bytes:
            raise ShardError(shard_url(self.sources[where[0]].root, info.name), f"sample {key!r} spans {end - start} bytes, "
                             f"more than max_sample_bytes={limits.max_sample_bytes}")
        return reader.read(info.name, info.bytes, info.sha256, start, end, key)

    def _open(self, pool: concurrent.futures.ThreadPoolExecutor, reader: ShardReader, where: _Where,
              sized: dict[tuple[int, int], concurrent.futures.Future[None]], opened: _Opened,
              inflight: dict[_Where, concurrent.futures.Future[bytes | memoryview]]) -> tuple[Any, str, str]:
        """(the opened sample, its shard's URL, its key); a sample of several units is opened once and
        kept (LRU, by bytes) for the rest."""
        if where in opened:
            opened.move_to_end(where)
            sample, _, url, key = opened[where]
            return sample, url, key
        number = where[0]
        source = self.sources[number]
        shard, info, index, at = self._sample(reader, where)
        url, key = shard_url(source.root, info.name), index.key(at)
        if where not in inflight:  # (dropped from the open samples since its read was asked for)
            self._submit(pool, reader, where, sized, inflight)
        future = inflight.pop(where)
        if (number, shard) in sized:
            sized[(number, shard)].result()
        data = future.result()
        units = int(index.units[at])
        members = index.sample_members(at) if index.members is not None else None  # (checked where the index says)
        sample = self.kind.open(parse_sample(data, url, key, self.config.limits, members, index.span(at)[0]), self.options,
                                url=url, key=key, units=units)
        if units > 1 and source.by_units:
            # What a sample holds in this process's memory: a mapped file's pages are the page cache's.
            opened.keep(where, (sample, len(data) if isinstance(data, bytes) else 0, url, key))
        return sample, url, key


class StreamLoader:
    """Iterable over batches of one split; `len()` is the exact number of batches the next `iter()` yields."""

    def __init__(self, stream: _ShardStream, loader: DataLoader, device: torch.device | None,
                 manifests: list[Manifest], split: str) -> None:
        self._stream, self._loader, self.device = stream, loader, device
        self.manifests, self.split = manifests, split
        self.manifest = manifests[0]
        # What a saved state must match: the datasets and, when mixing, each one's share.
        mix = stream.mix.counts if stream.mix else None
        self._fingerprint = manifests[0].fingerprint if len(manifests) == 1 else hashlib.sha256(
            json.dumps([[m.fingerprint for m in manifests], mix]).encode()).hexdigest()
        self._taken: tuple[Resume, ...] = ()  # the epoch's history as of the last iteration, this one included
        self._generation = 0  # of the current iteration: an iterator of an earlier one is no longer valid

    @property
    def epoch(self) -> int:
        return self._stream.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next `iter()` plays (its shuffle and mask sampling). Call before iterating.

        After `load_state_dict`, setting the saved epoch keeps the resumption point; any other epoch
        starts from its beginning (and an iterator still open is no longer valid)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if epoch != self.epoch:
            self._generation += 1
            self._stream.set_state(epoch, ())
            self._taken = ()

    @property
    def skipped(self) -> int:
        """Samples skipped so far (on_error='skip'), over all epochs and workers of this process."""
        return int(self._stream.skipped[0].sum())

    def __len__(self) -> int:
        return self._stream.batches()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The epoch's batches (or the rest of them, after `load_state_dict`). A new iterator, like
        `load_state_dict` and `set_epoch` to another epoch, ends the validity of any earlier one
        still open: using that again raises, so it never counts batches in `state_dict()`."""
        self._generation += 1
        return self._iterate(self._generation)

    def _check_current(self, generation: int) -> None:
        if generation != self._generation:
            raise RuntimeError("this iterator of the loader is no longer valid: load_state_dict(), set_epoch() or a "
                               "newer iter() came after it began; iterate the loader again")

    def _pulled(self, generation: int) -> Iterator[Any]:
        """The DataLoader's batches, each taken only while `generation` is current (persistent workers
        serve whichever iteration asks: a stale one must not take a batch of the next)."""
        self._check_current(generation)
        batches = iter(self._loader)
        while True:
            self._check_current(generation)
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (ConnectionResetError, EOFError) as exc:  # (torch's own message comes at the SIGCHLD, wherever)
                raise RuntimeError("a DataLoader worker ended while handing over a batch (killed, or out of "
                                   f"memory?): {_describe(exc)}") from exc
            yield batch

    def _iterate(self, generation: int) -> Iterator[dict[str, Any]]:
        stream = self._stream
        history, world_size = stream.history, stream.world_size
        batches: Iterator[dict[str, Any]] = map(_raise_worker_errors, self._pulled(generation))
        if self.device is not None and self.device.type == "cuda":
            batches = prefetch_to_cuda(batches, self.device)
        elif self.device is not None:
            batches = (to_device(b, self.device) for b in batches)
        stream.skipped[1] = 0
        done = history[-1].batches if history and history[-1].world_size == world_size else 0
        past = history[:-1] if done else history
        self._taken = (*past, Resume(world_size, done))
        for batch in batches:
            self._check_current(generation)  # (the device stage takes a batch ahead)
            done += 1  # counted as handed over: a checkpoint taken while the batch is in use includes it
            self._taken = (*past, Resume(world_size, done))
            yield stream.kind.finish(batch, stream.options)
        if generation == self._generation:
            stream.set_state(stream.epoch, ())  # the epoch is complete: iterating it again plays all of it

    def _identity(self) -> dict[str, Any]:
        """What a saved state must share with the loader that resumes it."""
        config = self._stream.config
        return {"version": STATE_VERSION, "fingerprint": self._fingerprint, "split": self.split,
                "units": [int(s.sizes.sum()) for s in self._stream.sources],
                **{name: getattr(config, name) for name in _ORDER_SETTINGS}}

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch stands, as plain data (no samples): save it with the model's checkpoint.

        In DDP the ranks move in step, so every rank's state is the same but for `rank`; save rank
        0's and load it on every rank, in a world of any size."""
        taken = self._taken or self._stream.history
        return {
            **self._identity(),
            "epoch": self.epoch,
            "history": [[t.world_size, t.batches] for t in taken],
            "rank": self._stream.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`: the rest of its epoch, then the following epochs.

        In the same world the remaining batches equal those of an uninterrupted run; with another
        world size, the samples no rank had taken are split over the new world. A state of another
        dataset, split or ordering settings is refused. An iterator still open is no longer valid."""
        for name, value in self._identity().items():
            if state.get(name) != value:
                raise ValueError(f"cannot resume: the state's {name} is {state.get(name)!r}, this loader's is {value!r}")
        try:
            history = tuple(Resume(int(w), int(b)) for w, b in state["history"])
            epoch = int(state["epoch"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"cannot resume: malformed state ({exc})") from exc
        self._stream.set_state(epoch, history)
        self._taken = ()
        self._generation += 1  # an iterator still open would play the old position
        self._stream.batches()  # refuse now a history this dataset cannot have


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


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


def _world(rank: int | None, world_size: int | None) -> World:
    """This process's place among the ranks: `rank` and `world_size` as given, or both from
    torch.distributed when it is initialised (else a single process).

    Given ones that disagree with an initialised torch.distributed are refused, but for
    `world_size=1` (every process reads the whole split) and a `world_size` dividing the process
    group's (data-parallel replicas under model parallelism, `rank` the replica's index)."""
    if (rank is None) != (world_size is None):
        raise ValueError(f"rank and world_size go together, got rank={rank!r} and world_size={world_size!r}: pass "
                         "both, or neither to take them from torch.distributed")
    initialised = dist.is_available() and dist.is_initialized()
    if rank is None or world_size is None:
        return World(dist.get_rank(), dist.get_world_size()) if initialised else World()
    for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    world = World(rank, world_size)
    if initialised and world_size != 1:
        group_rank, group_size = dist.get_rank(), dist.get_world_size()
        if group_size % world_size or (world_size == group_size and rank != group_rank):
            raise ValueError(
                f"rank={rank}, world_size={world_size} disagree with torch.distributed (rank {group_rank} of "
                f"{group_size}): pass neither to use torch.distributed's, world_size=1 for every process to read the whole split, or "
                f"for data-parallel replicas a world_size dividing {group_size} with rank the replica's index")
    return world


def make_stream_loader(
    source: str | Sequence[str],
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
    on_error: str = "raise",
    shuffle_window: int = 16384,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    multiprocessing_context: str | None = None,
    weights: Sequence[float] | None = None,
    epoch_size: int | None = None,
    max_errors: int | float | None = None,
    limits: ReadLimits | None = None,
    unit_cache_bytes: int = 256 << 20,
    cache_dir: str | None = None,
    cache_limit: int | None = None,
    retry: Retry | None = None,
    read_ahead: int = 1,
    verify: str = "size",
    **options: Any,
) -> StreamLoader:
    """A loader over `split` of the dataset at `source` (a folder written by `shard-pack`), or
    of several datasets of one kind: a list of sources, concatenated or, with `weights`, mixed in
    exact shares (`epoch_size` samples per epoch; by default the most that exhausts no source).

    Every sample of the split is yielded exactly once per epoch across all ranks and workers
    (but for the `drop_last` remainder), every rank yields `len(loader)` batches, and the order is
    a function of (seed, epoch) only. `rank` and `world_size` go together; without them, they are
    torch.distributed's when it is initialised (given ones that disagree with it are refused, but
    for `world_size=1` and data-parallel replicas: see `_world`). `persistent_workers=None` keeps
    workers alive across epochs when there are any. `limits` caps what an (untrusted) shard can
    make the reader do; with `on_error="skip"`, `max_errors` (a count, or a fraction of the
    rank's samples) bounds the skips per epoch.

    `**options` are the kind's (the manifest says which kind): for SA-1B `image_size=1024`,
    `mask_size=256`, `max_masks=64` (an int, or a function of the epoch); for VQA
    `per="question"` (or "image") and `image_size=448` (or None: as stored). Kinds whose samples
    hold several units (rows of a block, questions of an image) yield units; each worker keeps up
    to `unit_cache_bytes` of such samples open for their next units (read from a mapped local
    file, a sample counts as none: its bytes are the page cache's).

    Storage: `source` is a local folder or any fsspec URL (`s3://bucket/prefix`, `gs://`,
    `https://`), opened in each worker with `storage_options` (e.g. s3fs's `endpoint_url`, `key`,
    `secret`, `anon`). Samples are read by byte range, `read_ahead` batches ahead of decoding;
    transient failures are retried as `retry` says. With `cache_dir` and `cache_limit` (bytes),
    remote shards are kept whole on local disk, least recently used evicted (`storage.ShardCache`).

    Checks of shard content: `verify="size"` (the default) compares each shard's size with the
    manifest's, one stat (or HEAD) per shard per iteration beside its first read: a shard cut or
    replaced by one of another size is named. `verify="sha256"` also hashes each local shard the
    first time the loader reads it (by whichever worker comes first; the others wait for that
    check), again only if its inode, size or mtime change: a shard replaced by one of the same
    size, or a wrong manifest, is named before any of its samples is used. It costs reading each
    shard whole once per loader, workers fresh each epoch or not (~1 s per GiB on a core of this
    VM, from the page cache), on the path of the first batches that use it. Shards on object
    storage are refused with it: cached ones are always checked when downloaded, and
    `shard-pack verify` checks a whole dataset.
    """
    limits = limits or ReadLimits()
    config = LoaderConfig(batch_size, num_workers, shuffle, seed, drop_last, shuffle_window, on_error, max_errors, limits,
                          unit_cache_bytes, retry or Retry(), cache_dir, cache_limit, read_ahead, verify=verify)
    resolved, pin = _resolve_device(device, pin_memory)
    if not isinstance(prefetch_factor, int) or isinstance(prefetch_factor, bool) or prefetch_factor < 1:
        raise ValueError(f"prefetch_factor must be an int >= 1 (batches each worker prepares ahead), got {prefetch_factor!r}")
    world = _world(rank, world_size)
    roots = [source] if isinstance(source, str) else list(source)
    if verify == "sha256":
        remote = [root for root in roots if not is_local(filesystem(root, storage_options)[0])]
        if remote:
            raise ValueError(f"verify='sha256' checks shards on local disk; {remote[0]} is on object storage (cached "
                             "shards are always checked when downloaded; `shard-pack verify` checks a whole dataset)")
    cache = ShardCache(cache_dir, cache_limit) if cache_dir is not None and cache_limit is not None else None
    manifests = [read_manifest(root, storage_options, config.retry, cache) for root in roots]
    for root, manifest in zip(roots, manifests):
        if split not in manifest.splits:
            raise ValueError(f"{root}: no split {split!r}; the dataset has {sorted(manifest.splits)}")
        if manifest.kind != manifests[0].kind:
            raise ValueError(f"cannot mix kinds: {roots[0]} is {manifests[0].kind}, {root} is {manifest.kind}")
        shards = manifest.splits[split]
        if len(shards) and shards.shard_bytes.max() > limits.max_shard_bytes:
            name = shards.names[int(shards.shard_bytes.argmax())]
            raise ManifestError(shard_url(root, name), f"{shards.shard_bytes.max()} bytes, more than "
                                f"max_shard_bytes={limits.max_shard_bytes}")
    if cache_limit is not None:
        largest = max((int(m.splits[split].shard_bytes.max(initial=0)) for m in manifests), default=0)
        if cache_limit < largest:
            raise ValueError(f"cache_limit={cache_limit} cannot hold the largest shard of split {split!r} ({largest} bytes)")
    if manifests[0].kind not in KINDS:  # (`webdataset`: indexed by `shard-pack index`, its reading side comes later)
        raise ValueError(f"{roots[0]}: the loader cannot read kind {manifests[0].kind!r} yet; it reads {sorted(KINDS)}")
    kind = KINDS[manifests[0].kind]
    try:
        kind_options = kind.options(manifests, limits, **options)
    except TypeError as exc:  # an option this kind does not have
        raise ValueError(f"{manifests[0].kind} datasets do not take these options {sorted(options)}: {exc}") from exc
    sources = [_Source.of(root, manifest, split, kind.units(kind_options)) for root, manifest in zip(roots, manifests)]
    mix = None if len(sources) == 1 and weights is None and epoch_size is None else \
        Mix.of([int(s.sizes.sum()) for s in sources], weights, epoch_size)
    stream = _ShardStream(sources, mix, manifests[0].kind, kind_options, config, world.rank, world.world_size,
                          storage_options)
    if stream.batches() == 0:
        raise ValueError(
            f"{', '.join(roots)}: split {split!r} gives {stream.total} samples per epoch, too few for one batch of "
            f"{batch_size} on each of {world.world_size} ranks with drop_last=True"
        )
    if num_workers:
        stream.leases = Leases(num_workers)
    loader = DataLoader(
        stream,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin,
        prefetch_factor=prefetch_factor if num_workers else None,
        persistent_workers=bool(num_workers) if persistent_workers is None else persistent_workers,
        multiprocessing_context=multiprocessing_context if num_workers else None,
    )
    return StreamLoader(stream, loader, resolved, manifests, split)


def make_stream_dataset(source: str | Sequence[str], split: str, *, batch_size: int, max_workers: int = 16,
                        flatten: bool = False, split_workers: bool = True, **kwargs: Any) -> IterableDataset:
    """The loader's dataset itself, for loops that wrap a dataset in their own DataLoader: a torch
    IterableDataset of the kind's batches of `batch_size`, as `make_stream_loader` yields them (keys,
    dtypes, shapes: see the kind), or with `flatten`, of their samples: row i of each batch, same keys.

    It is split exactly over the ranks and over the workers (at most `max_workers`) of the DataLoader
    that iterates it; each worker takes whole batches of `batch_size` in turn. `split_workers=False`:
    whoever iterates it reads the rank's whole share, in any worker (for a wrapper that splits the
    work itself). It has `set_epoch(epoch)`, `skipped` and `len()`: the batches, or with `flatten` the
    samples, that an iteration yields on this rank (fewer samples when some are skipped). A DataLoader
    that batches the samples again counts `ceil(len / its batch size)` batches, which is what it yields
    only when `batch_size` is a multiple of its batch size: `pipeline.trainer_dataset` sees to that.
    Errors raise in the worker (the DataLoader re-raises them as RuntimeError with the message).
    Other arguments as `make_stream_loader`'s, but for the DataLoader's own.
    """
    if not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1:
        raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
    theirs = sorted(set(kwargs) & {"num_workers", "device", "pin_memory", "prefetch_factor", "persistent_workers",
                                   "multiprocessing_context"})
    if theirs:
        raise ValueError(f"make_stream_dataset does not take {theirs}: the DataLoader that iterates it decides those")
    stream = make_stream_loader(source, split, batch_size=batch_size, num_workers=0, **kwargs)._stream
    stream.skipped = torch.zeros(2, max_workers, dtype=torch.int64).share_memory_()
    stream.errors_as_values, stream.finished = False, True
    stream.flatten, stream.split_workers = flatten, split_workers
    return stream


def validate_first_batch(loader: StreamLoader) -> dict[str, Any]:
    """Take the loader's first batch and check keys, shapes, dtypes, finiteness and ranges; return it."""
    batch = next(iter(loader))
    stream = loader._stream
    problems = stream.kind.check(batch, stream.options, loader.epoch)
    if problems:
        raise ValueError("first batch is invalid:\n  " + "\n  ".join(problems))
    return batch
