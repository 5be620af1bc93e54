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
from pipeline.state import EpochState, resume_point
from pipeline.stats import Clock, WorkerTable

__all__ = ["ShardStream", "WorkerError"]

log = logging.getLogger(__name__)
FIRST_OUT_WAIT = 10.0  # seconds a worker's read-ahead waits at most for the first batch to be handed over
_CHUNK_ITEMS = 8192  # items whose reads are asked for at once from object storage, at most (see `_chunks`)


@dataclasses.dataclass
class Position:
    """Where one process (a DataLoader worker, or the process iterating) stands in its iteration of
    the epoch: its plan (`epoch`, `history`, its place among `num_workers`), the plan's batches it
    has yielded whole and, with `flatten`, the rows of the next one it has yielded."""

    epoch: int
    history: tuple[Resume, ...]
    worker: int
    num_workers: int
    batches: int = 0
    rows: int = 0


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
        self.identity: dict[str, Any] = {}  # what a saved state must share with this stream (`state.resume_point`)
        # This process's own place (`state_dict`), and a loaded one its next iteration starts from.
        self._position: Position | None = None
        self._pending: Position | None = None

    @property
    def epoch(self) -> int:
        return self.state.epoch

    def rank_samples(self, history: tuple[Resume, ...]) -> int:
        """How many samples this rank yields after `history`."""
        c = self.config
        return rank_sample_count(self.total, self.world_size, self.rank, c.batch_size, c.drop_last, history)

    def batches(self, history: tuple[Resume, ...] | None = None) -> int:
        """How many batches this rank yields after `history` (by default the shared one: in the next
        iteration, all of the epoch or the rest)."""
        c = self.config
        history = self.state.history if history is None else history
        return rank_batch_count(self.total, self.world_size, self.rank, c.batch_size, c.drop_last, history)

    def epoch_batches(self) -> int:
        """The epoch's batches on this rank: those its history took (in any world) and the rest."""
        return sum(h.batches for h in self.state.history) + self.batches()

    def __len__(self) -> int:
        """Items of the epoch on this rank, as a DataLoader's `len()` counts them (whatever part of it
        was taken before a resumption, which trainers count themselves): batches, or samples with
        `flatten` (fewer if some are skipped)."""
        if not self.flatten:
            return self.epoch_batches()
        history = self.state.history
        if len(history) == 1 and history[0].world_size == self.world_size:  # (the same world's epoch, whole)
            return self.rank_samples(())
        return sum(h.batches for h in history) * self.config.batch_size + self.rank_samples(history)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration plays, from the main process (HF Trainer and accelerate
        call this on datasets that have it)."""
        self.state.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """This process's place in its iteration, as plain data: torchdata's `StatefulDataLoader` (and
        accelerate's, with `use_stateful_dataloader`) asks it of the dataset in each worker after each
        batch, and hands it back to the same worker's `load_state_dict`. (`make_stream_loader`'s own
        `state_dict` is the rank's, and resumes in another world size too.)"""
        p = self._position or self._pending or self._fresh()
        return {**self.identity, "epoch": p.epoch, "history": [[h.world_size, h.batches] for h in p.history],
                "rank": self.rank, "world_size": self.world_size, "num_workers": p.num_workers, "worker": p.worker,
                "batches": p.batches, "rows": p.rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start this process's next iteration where a `state_dict()` of the same worker of the same
        world left off: no sample yielded twice, none decoded again. A state of another dataset, split,
        order or kind options, another world or another number of DataLoader workers is refused."""
        epoch, history = resume_point(state, self.identity)
        try:
            world, rank, workers, worker = (int(state[k]) for k in ("world_size", "rank", "num_workers", "worker"))
            batches, rows = int(state["batches"]), int(state["rows"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"cannot resume: malformed state ({exc!r}): a state_dict() of the dataset (of "
                              "make_stream_dataset or trainer_dataset) is wanted") from exc
        if (rank, world) != (self.rank, self.world_size):
            raise ConfigError(f"cannot resume: the state is of rank {rank} of world_size {world}, this dataset is rank "
                              f"{self.rank} of world_size {self.world_size}; a DataLoader's state resumes in the same "
                              "world only (make_stream_loader's state_dict resumes in another)")
        here = self._world()
        if (workers, worker) != (here.num_workers, here.worker):
            raise ConfigError(f"cannot resume: the state is of DataLoader worker {worker} of {workers}, this is worker "
                              f"{here.worker} of {here.num_workers}: resume with num_workers={workers if workers > 1 else 0}")
        self._pending = Position(epoch, history, worker, workers, batches, rows)
        self._position = None

    def start_at(self, items: int) -> None:
        """Start this process's next iteration of the chosen epoch after the first `items` items it
        would yield, none of them decoded (for a wrapper that counts what it took: `pipeline.hf_datasets`).
        Needs on_error="raise": with skips, items yielded no longer tell batches apart."""
        if self.config.on_error != "raise" or not self.flatten:
            raise ConfigError("start_at needs flatten=True and on_error='raise'")
        world = self._world()
        batches, rows = divmod(items, self.config.batch_size)
        self._pending = Position(self.state.epoch, self.state.history, world.worker, world.num_workers, batches, rows)
        self._position = None

    def _world(self) -> World:
        info = get_worker_info() if self.split_workers else None
        return World(self.rank, self.world_size, info.id if info else 0, info.num_workers if info else 1)

    def _fresh(self) -> Position:
        world = self._world()
        return Position(self.state.epoch, self.state.history, world.worker, world.num_workers)

    def _start(self) -> Position:
        """Where this iteration starts: at the shared epoch and history (set by the main process), or
        at a position loaded in this process, unless the main process chose another epoch since:
        refused while the loaded epoch has batches left for this worker (a state at an epoch's end,
        which torchdata and accelerate save after its last batch, is no conflict)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return self._fresh()
        state = self.state
        if (state.chosen[0] and state.epoch != pending.epoch) or (state.history and state.history != pending.history):
            mine = -(-(self.batches(pending.history) - pending.worker) // pending.num_workers)  # (this worker's share)
            if pending.batches >= mine:  # (its iteration yields nothing: StatefulDataLoader drops it, then begins
                return pending           # a new one, of the chosen epoch; playing that here would decode it twice)
            raise ConfigError(f"cannot resume: the loaded state is of epoch {pending.epoch} after "
                              f"{[[h.world_size, h.batches] for h in pending.history]}, with {mine - pending.batches} "
                              f"batches of this worker left, and this dataset was set to epoch {state.epoch} after "
                              f"{[[h.world_size, h.batches] for h in state.history]} since; call "
                              f"set_epoch({pending.epoch}), or none, before iterating")
        return pending

    def __iter__(self) -> Iterator[Any]:
        world = self._world()
        if world.num_workers > self.skipped.shape[1]:
            raise ConfigError(f"{world.num_workers} DataLoader workers, more than this dataset was made for "
                              f"({self.skipped.shape[1]}); pass max_workers")
        self._position = position = self._start()
        return self._yield(world, position)

    def _yield(self, world: World, position: Position) -> Iterator[Any]:
        """The iteration's batches or samples from `position` on, which it keeps up to date."""
        info = get_worker_info() if self.split_workers else None
        self.skipped[1, world.worker] = 0  # this iteration's skips, counted afresh by each worker
        clock = self.times.clock()
        # Resuming inside a batch: its first rows are not decoded again, unless skips may have left out
        # some of them (then they are decoded and dropped: rows and samples no longer correspond).
        exact = self.config.on_error == "raise"
        made = self._batches(world, position.epoch, position.history, clock, position.batches,
                             position.rows if exact else 0)
        drop = 0 if exact else position.rows
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
                if not self.flatten:
                    position.batches += 1
                    yield batch
                    continue
                rows = self.kind.unbatch(batch)[drop:]
                drop = 0
                for i, row in enumerate(rows):  # (counted before it is handed over: a state taken then includes it)
                    position.batches, position.rows = (position.batches + 1, 0) if i == len(rows) - 1 else \
                        (position.batches, position.rows + 1)
                    yield row
                if not rows:
                    position.batches, position.rows = position.batches + 1, 0
        except ShardstreamError as exc:
            if info is None or self.finished:
                raise
            exc.add_note(f"in DataLoader worker {info.id}:\n{traceback.format_exc()}")
            yield WorkerError(exc)
        finally:
            batches.close()

    def _batches(self, world: World, epoch: int, history: tuple[Resume, ...], clock: Clock, start: int = 0,
                 rows: int = 0) -> Iterator[tuple[Any, int]]:
        """plan -> read (`read_ahead` batches ahead of decoding) -> open/decode -> collate: (batch, its
        samples), from the plan's batch `start` on, less the first `rows` samples of that one."""
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
        asked, last = start, start  # batches asked for; the first batch of the last chunk asked for
        # From object storage, the first batch's reads alone, by range (not from the shard cache's downloads);
        # read-ahead and downloads begin with the second batch (they would compete with them).
        reads.downloads = chunks is None
        try:
            for i in range(start, len(plan)):
                batch, _, items = plan[i]
                if i == start + 1:
                    _wait_first_out(self.first_out)
                    reads.start_downloads()
                ahead = cfg.read_ahead if i > start or not chunks else 0
                while asked < len(plan) and (asked <= i + ahead or (chunks and ahead and i >= last)):
                    last, wheres = asked, []
                    for later in range(asked, min(asked + (next(chunks) if chunks else 1), len(plan))):
                        sources, ids = plan[later][1:]
                        cut = rows if later == start else 0
                        more, prepared[later] = self._prepare(reads, sources[cut:], ids[cut:])
                        wheres += more
                        asked += 1
                    reads.ahead(wheres)
                with clock.stage("decode"):  # (the reads' waits and opens in it are theirs: `LoaderStats.of`)
                    pieces, lost = self._decode(reads, prepared.pop(i), epoch, world.worker, budget, clock)
                if not pieces and len(items) > (rows if i == start else 0):
                    raise ShardError(f"all {len(items)} samples of batch {batch} failed; ranks "
                                     "cannot stay in step", url=self.sources[0].root)
                if not pieces:  # (resumed after the last row of a batch)
                    continue
                with clock.stage("collate"):
                    collated = self._collate(pieces, world, epoch)
                yield collated, len(items) - (rows if i == start else 0) - lost
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
