"""The stream: a torch IterableDataset yielding one worker's batches of a split for the epoch in
`EpochState`, as a chain of stages: plan -> read (`pipeline.read`) -> open/decode (the kind) ->
collate (into buffers lent back by the main process). Errors of ours in a worker travel back as
values (torch would re-raise them as a bare RuntimeError); with on_error="skip" a bad sample is
left out, within the skip budget."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.ma  # noqa: F401  (np.unique imports it on first use: ~0.1 s of each worker's first batch)
import torch
from torch.utils.data import IterableDataset, get_worker_info

from pipeline.collate import Leases
from pipeline.config import LoaderConfig
from pipeline.errors import ConfigError, ShardError, ShardstreamError
from pipeline.index import SplitIndex, Where, group, locate
from pipeline.kinds import Kind
from pipeline.plan import Mix, Resume, World, epoch_samples, plan_epoch, rank_batch_count, rank_sample_count
from pipeline.read import ProcessReaders, SampleReads
from pipeline.state import EpochState
from pipeline.stats import Clock, WorkerTable

__all__ = ["ShardStream", "WorkerError"]

log = logging.getLogger(__name__)
FIRST_OUT_WAIT = 10.0  # seconds a worker's read-ahead waits at most for the first batch to be handed over
_CHUNK_ITEMS = 8192  # items whose reads are asked for at once from object storage, at most (see `_chunks`)


@dataclasses.dataclass(frozen=True)
class WorkerError:
    """An error of ours raised in a worker, sent as a value: torch would re-raise it as a bare RuntimeError."""

    error: ShardstreamError


class ShardStream(IterableDataset):
    """Yields this worker's collated batches of one split for the epoch held in `state`.

    For `make_stream_dataset` (`finished`): batches as users get them (`Kind.finish`), or with
    `flatten` their samples (`Kind.unbatch`), errors raised in the worker; `split_workers=False`:
    whoever iterates reads the rank's whole share, in any DataLoader worker."""

    def __init__(self, sources: list[SplitIndex], mix: Mix | None, kind: Kind, config: LoaderConfig, world: World,
                 *, max_workers: int, finished: bool = False, flatten: bool = False, split_workers: bool = True) -> None:
        self.sources, self.mix, self.kind, self.config = sources, mix, kind, config
        self.total = epoch_samples([s.sizes for s in sources], mix)  # items in an epoch, before the split over ranks
        self.rank, self.world_size = world.rank, world.world_size
        self.state = EpochState()
        # Samples skipped per worker: over all epochs (row 0) and in the current iteration (row 1).
        self.skipped = torch.zeros(2, max(1, max_workers), dtype=torch.int64).share_memory_()
        self.times = WorkerTable(kind.stages, max_workers)  # each worker's time per stage (`pipeline.stats`)
        # With verify="sha256": per shard of each source, the (inode, size, mtime) whose content matched
        # the manifest's SHA-256, shared so that a shard is hashed by one worker only.
        verified = torch.zeros(sum(len(s.split) for s in sources), 3, dtype=torch.int64).share_memory_() \
            if config.verify == "sha256" else None
        # Whether this iteration's first batch has reached the main process: a StreamLoader sets 0 before
        # asking its workers and 1 once it has it; the workers' read-ahead waits for it (`_wait_first_out`).
        self.first_out = torch.ones(1, dtype=torch.int64).share_memory_()
        self.finished, self.flatten, self.split_workers = finished, flatten, split_workers
        self.leases: Leases | None = None  # workers recycle batch buffers our own DataLoader hands back
        self.readers = ProcessReaders(sources, config, verified)

    @property
    def epoch(self) -> int:
        return self.state.epoch

    def rank_samples(self, history: tuple[Resume, ...]) -> int:
        """How many samples this rank yields after `history`."""
        c = self.config
        return rank_sample_count(self.total, self.world_size, self.rank, c.batch_size, c.drop_last, history)

    def batches(self) -> int:
        """How many batches this rank yields in the next iteration (all of the epoch, or the rest)."""
        c = self.config
        return rank_batch_count(self.total, self.world_size, self.rank, c.batch_size, c.drop_last, self.state.history)

    def __len__(self) -> int:
        """Items the next iteration yields on this rank: batches, or samples with `flatten` (fewer if some are skipped)."""
        return self.rank_samples(self.state.history) if self.flatten else self.batches()

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration plays, from the main process (HF Trainer and accelerate
        call this on datasets that have it)."""
        self.state.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info() if self.split_workers else None
        world = World(self.rank, self.world_size, info.id if info else 0, info.num_workers if info else 1)
        if world.num_workers > self.skipped.shape[1]:
            raise ConfigError(f"{world.num_workers} DataLoader workers, more than this dataset was made for "
                              f"({self.skipped.shape[1]}); pass max_workers")
        self.skipped[1, world.worker] = 0  # this iteration's skips, counted afresh by each worker
        clock = self.times.clock()
        made = self._batches(world, self.state.epoch, self.state.history, clock)
        batches = self.times.timed(world.worker, clock, made)  # (each batch's making: its "active" time)
        try:
            while True:
                problem = self.readers.lease_problem()  # before a batch touches a shard rewritten in place
                if problem is not None:
                    batches.close()  # (its samples read ahead)
                    raise problem
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                if self.finished:
                    batch = self.kind.finish(batch)
                yield from self.kind.unbatch(batch) if self.flatten else (batch,)
        except ShardstreamError as exc:
            if info is None or self.finished:
                raise
            exc.add_note(f"in DataLoader worker {info.id}:\n{traceback.format_exc()}")
            yield WorkerError(exc)
        finally:
            batches.close()

    def _batches(self, world: World, epoch: int, history: tuple[Resume, ...],
                 clock: Clock) -> Iterator[tuple[Any, int]]:
        """plan -> read (`read_ahead` batches ahead of decoding) -> open/decode -> collate: (batch, its samples)."""
        cfg = self.config
        budget = cfg.max_errors  # skips allowed in this iteration of the rank
        if isinstance(budget, float):
            budget = int(budget * self.rank_samples(history))
        plan = plan_epoch([s.sizes for s in self.sources], cfg.seed, epoch, world, batch_size=cfg.batch_size,
                          drop_last=cfg.drop_last, shuffle=cfg.shuffle, window=cfg.shuffle_window, mix=self.mix,
                          history=history)
        readers, opened = self.readers.get()
        reads = SampleReads(self.sources, readers, opened, cfg, self._open, clock)
        prepared: dict[int, list[tuple[Where, Any]]] = {}
        chunks = _chunks(cfg, self.sources, len(plan), any(reads.spanned))
        asked, last = 0, 0  # batches asked for; the first batch of the last chunk asked for
        # From object storage, the first batch's reads alone, by range (not from the shard cache's downloads);
        # read-ahead and downloads begin with the second batch (they would compete with them).
        reads.downloads = chunks is None
        try:
            for i, (batch, _, items) in enumerate(plan):
                if i == 1:
                    _wait_first_out(self.first_out)
                    reads.start_downloads()
                ahead = cfg.read_ahead if i or not chunks else 0
                while asked < len(plan) and (asked <= i + ahead or (chunks and ahead and i >= last)):
                    last, wheres = asked, []
                    for later in range(asked, min(asked + (next(chunks) if chunks else 1), len(plan))):
                        more, prepared[later] = self._prepare(reads, *plan[later][1:])
                        wheres += more
                        asked += 1
                    reads.ahead(wheres)
                with clock.stage("decode"):  # (the reads' waits and opens in it are theirs: `LoaderStats.of`)
                    pieces, lost = self._decode(reads, prepared.pop(i), epoch, world.worker, budget, clock)
                if not pieces:
                    raise ShardError(f"all {len(items)} samples of batch {batch} failed; ranks "
                                     "cannot stay in step", url=self.sources[0].root)
                with clock.stage("collate"):
                    collated = self._collate(pieces, world, epoch)
                yield collated, len(items) - lost
            reads.settle()
        finally:
            reads.close()

    def _open(self, members: dict[str, Any], url: str, key: str, units: int) -> Any:
        return self.kind.open(members, url=url, key=key, units=units)

    def _prepare(self, reads: SampleReads, sources: np.ndarray,
                 items: np.ndarray) -> tuple[list[Where], list[tuple[Where, Any]]]:
        """A batch's samples in order of first use, and what to decode of each (`index.group`)."""
        samples, units = np.empty_like(items), np.zeros_like(items)
        for number in np.unique(sources).tolist():
            mine = np.flatnonzero(sources == number)
            samples[mine], units[mine] = locate(self.sources[number], items[mine],
                                                functools.partial(reads.unit_starts, number))
        return group(sources, samples, units, self.kind.grouped)

    def _decode(self, reads: SampleReads, work: Sequence[tuple[Where, Any]], epoch: int, worker: int,
                budget: int | None, clock: Clock) -> tuple[list[Any], int]:
        """The batch's decoded samples and how many of its units failed; with on_error="skip", those
        that fail are counted and left out (more than `budget` in this iteration of the rank: an error)."""
        cfg, pieces, lost = self.config, [], 0
        for where, unit in work:
            try:
                sample, url, key = reads.take(where)
                try:
                    pieces.append(self.kind.decode(sample, unit=unit, seed=cfg.seed, epoch=epoch, url=url, key=key,
                                                   clock=clock))
                finally:
                    reads.done(where)
            except ShardstreamError as exc:
                if cfg.on_error == "raise" or isinstance(exc, ConfigError):  # (a setting's error is no sample's)
                    raise
                count = len(unit) if self.kind.grouped else 1
                self.skipped[:, worker] += count
                lost += count
                log.warning("skipped: %s", exc)
                skipped = int(self.skipped[1].sum())
                if budget is not None and skipped > budget:
                    raise ShardError(f"{skipped} samples skipped in this epoch, "
                                     f"more than max_errors={cfg.max_errors} allows ({budget}); last: {exc}",
                                     url=self.sources[where[0]].root) from exc
        return pieces, lost

    def _collate(self, samples: list[Any], world: World, epoch: int) -> Any:
        if self.leases is None or get_worker_info() is None:
            return self.kind.collate(samples, epoch)
        with self.leases.collating(world.worker):
            batch = self.kind.collate(samples, epoch)
        self.leases.lend(world.worker, batch)
        return batch


def _chunks(cfg: LoaderConfig, sources: Sequence[SplitIndex], batches: int, spanned: bool) -> Iterator[int] | None:
    """From object storage: how many batches each request for reads covers, so that spans merge many
    samples: the first batch alone (it waits for its own samples only), then each time what fits
    twice (one chunk in use, the next in flight) in `read_ahead_bytes` after `read_amplification`,
    by the sources' mean bytes per item, and at most `_CHUNK_ITEMS` items (small items: the plan's
    work per chunk stays small). None: one batch at a time, `read_ahead` ahead. (Chunks of 1, 2, 4,
    ... batches made twice the requests, and were slower: 207 against 107 requests in `make
    bench-s3`'s epoch of 256 samples, 16 a shard.)"""
    if not spanned:
        return None
    item = sum(int(s.split.shard_bytes.sum()) for s in sources) / max(1, sum(int(s.sizes.sum()) for s in sources))
    most = max(1, min(_CHUNK_ITEMS // cfg.batch_size,
                      int(cfg.read_ahead_bytes / (2 * cfg.read_amplification * cfg.batch_size * max(item, 1)))))
    return itertools.chain([1], itertools.repeat(min(most, batches)))


def _wait_first_out(first_out: torch.Tensor) -> None:
    """Wait (up to `FIRST_OUT_WAIT` seconds) until the iteration's first batch has reached the main
    process (`ShardStream.first_out`): read-ahead and cache downloads would take the cores and the
    network from it (from its decoding in another worker, from its hand-over in this one)."""
    deadline = time.monotonic() + FIRST_OUT_WAIT
    while not first_out[0] and time.monotonic() < deadline:
        time.sleep(0.002)
