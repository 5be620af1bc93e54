"""The stream: a torch IterableDataset yielding one worker's batches of a split for the epoch in
`EpochState`, as a chain of stages: plan -> read (`pipeline.read`) -> open/decode (the kind) ->
collate (into buffers lent back by the main process). Errors of ours in a worker travel back as
values (torch would re-raise them as a bare RuntimeError); with on_error="skip" a bad sample is
left out, within the skip budget."""

from __future__ import annotations

import dataclasses
import itertools
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from pipeline.decoding import Decoder
from pipeline.config import LoaderConfig
from pipeline.errors import ConfigError, ShardError, ShardstreamError
from pipeline.index import SplitIndex, Where
from pipeline.kinds import Kind
from pipeline.plan import Mix, Resume, World, epoch_samples, plan_epoch, rank_batch_count, rank_sample_count
from pipeline.read import ProcessReaders, SampleReads
from pipeline.position import Place, Position, hand_over
from pipeline.state import EpochState
from pipeline.stats import Clock, WorkerTable

__all__ = ["ShardStream", "WorkerError", "begin", "release"]

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
        # The first-batch gate (`begin`, `release`): the iteration a StreamLoader last began, and the last
        # whose first batch has reached the main process; a worker's read-ahead waits for its own.
        self.gate = torch.zeros(2, dtype=torch.int64).share_memory_()
        self.finished, self.flatten, self.split_workers = finished, flatten, split_workers
        self.decoder = Decoder(sources, kind, config, self.skipped)  # (its `leases`: set by make_stream_loader)
        self.readers = ProcessReaders(sources, config, verified)
        self.identity: dict[str, Any] = {}  # what a saved state must share with this stream (`state.resume_point`)
        self.place = Place()  # this process's own position in its iteration (`state_dict`), or a loaded one

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
        """The epoch's batches on this rank as a trainer counts them: those its history took (in any
        world) and the rest, or, when more, a whole epoch in this world. A trainer that reads `len()`
        once (Lightning, per `fit`) then never stops an epoch short: not the resumed one, not the
        next ones after a resumption in another world size."""
        return max(self.batches(()), sum(h.batches for h in self.state.history) + self.batches())

    def __len__(self) -> int:
        """Items of the epoch on this rank, as a DataLoader's `len()` counts them (whatever part of it
        was taken before a resumption, which trainers count themselves; see `epoch_batches`):
        batches, or samples with `flatten` (fewer if some are skipped)."""
        if not self.flatten:
            return self.epoch_batches()
        history, whole = self.state.history, self.rank_samples(())
        if len(history) == 1 and history[0].world_size == self.world_size:  # (the same world's epoch, whole)
            return whole
        return max(whole, sum(h.batches for h in history) * self.config.batch_size + self.rank_samples(history))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration plays, from the main process (HF Trainer and accelerate
        call this on datasets that have it)."""
        self.state.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """This process's place in its iteration, as plain data: torchdata's `StatefulDataLoader` (and
        accelerate's, with `use_stateful_dataloader`) asks it of the dataset in each worker after each
        batch, and hands it back to the same worker's `load_state_dict` (`pipeline.position`).
        (`make_stream_loader`'s own `state_dict` is the rank's, and resumes in another world size too.)"""
        return self.place.state(self.identity, self._world(), self._fresh())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start this process's next iteration where a `state_dict()` of the same worker of the same
        world left off (of any rank: they move in step): no sample yielded twice, none decoded again. A
        state of another dataset, split, order or kind options, another world size or another number of
        DataLoader workers is refused."""
        self.place.load(state, self.identity, self._world(), in_step=self.config.on_error == "raise")

    def start_at(self, items: int) -> None:
        """Start this process's next iteration of the chosen epoch after the first `items` items it
        would yield, none of them decoded (for a wrapper that counts what it took: `pipeline.hf_datasets`).
        Needs on_error="raise": with skips, items yielded no longer tell batches apart."""
        if self.config.on_error != "raise" or not self.flatten:
            raise ConfigError("start_at needs flatten=True and on_error='raise'")
        self.place.hold(dataclasses.replace(self._fresh(), **dict(zip(("batches", "rows"),
                                                                      divmod(items, self.config.batch_size)))))

    def _world(self) -> World:
        info = get_worker_info() if self.split_workers else None
        return World(self.rank, self.world_size, info.id if info else 0, info.num_workers if info else 1)

    def _fresh(self) -> Position:
        world = self._world()
        return Position(self.state.epoch, self.state.history, world.worker, world.num_workers)

    def __iter__(self) -> Iterator[Any]:
        world = self._world()
        if world.num_workers > self.skipped.shape[1]:
            raise ConfigError(f"{world.num_workers} DataLoader workers, more than this dataset was made for "
                              f"({self.skipped.shape[1]}); pass max_workers")
        return self._yield(world, self.place.start(self._fresh(), self.state, self.batches), int(self.gate[0]))

    def _yield(self, world: World, position: Position, ticket: int) -> Iterator[Any]:
        """The iteration's batches or samples from `position` on, which it keeps up to date."""
        info = get_worker_info() if self.split_workers else None
        self.skipped[1, world.worker] = 0  # this iteration's skips, counted afresh by each worker
        clock = self.times.clock()
        # Resuming inside a batch: its first rows are not decoded again, unless skips may have left out
        # some of them (then they are decoded and dropped: rows and samples no longer correspond).
        exact = self.config.on_error == "raise"
        made = self._batches(world, position.epoch, position.history, clock, ticket, position.batches,
                             position.rows if exact else 0)
        batches = self.times.timed(world.worker, clock, made)  # (each batch's making: its "active" time)
        try:
            yield from hand_over(self._checked(batches), position, self.kind.unbatch if self.flatten else None,
                                 0 if exact else position.rows)
        except ShardstreamError as exc:
            if info is None or self.finished:
                raise
            exc.add_note(f"in DataLoader worker {info.id}:\n{traceback.format_exc()}")
            yield WorkerError(exc)
        finally:
            batches.close()

    def _checked(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The batches (finished, for `make_stream_dataset`), each made only while no shard it may
        touch was rewritten in place."""
        while True:
            problem = self.readers.lease_problem()
            if problem is not None:
                batches.close()  # (its samples read ahead)
                raise problem
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield self.kind.finish(batch) if self.finished else batch

    def _batches(self, world: World, epoch: int, history: tuple[Resume, ...], clock: Clock, ticket: int,
                 start: int = 0, rows: int = 0) -> Iterator[tuple[Any, int]]:
        """plan -> read (`read_ahead` batches ahead of decoding) -> open/decode -> collate: (batch, its
        samples), from the plan's batch `start` on, less the first `rows` samples of that one; the
        read-ahead after the first batch held until iteration `ticket`'s first batch is out."""
        cfg = self.config
        budget = cfg.max_errors  # skips allowed in this iteration of the rank
        if isinstance(budget, float):
            budget = int(budget * self.rank_samples(history))
        plan = plan_epoch([s.sizes for s in self.sources], cfg.seed, epoch, world, batch_size=cfg.batch_size,
                          drop_last=cfg.drop_last, shuffle=cfg.shuffle, window=cfg.shuffle_window, mix=self.mix,
                          history=history)
        readers, opened = self.readers.get()
        reads = SampleReads(self.sources, readers, opened, cfg, self.decoder.open, clock)
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
                    _wait_first_out(self.gate, ticket)
                    reads.start_downloads()
                ahead = cfg.read_ahead if i > start or not chunks else 0
                while asked < len(plan) and (asked <= i + ahead or (chunks and ahead and i >= last)):
                    last, wheres = asked, []
                    for later in range(asked, min(asked + (next(chunks) if chunks else 1), len(plan))):
                        sources, ids = plan[later][1:]
                        cut = rows if later == start else 0
                        more, prepared[later] = self.decoder.prepare(reads, sources[cut:], ids[cut:])
                        wheres += more
                        asked += 1
                    reads.ahead(wheres)
                with clock.stage("decode"):  # (the reads' waits and opens in it are theirs: `LoaderStats.of`)
                    pieces, lost = self.decoder.decode(reads, prepared.pop(i), epoch, world.worker, budget, clock)
                if not pieces and len(items) > (rows if i == start else 0):
                    raise ShardError(f"all {len(items)} samples of batch {batch} failed; ranks "
                                     "cannot stay in step", url=self.sources[0].root)
                if not pieces:  # (resumed after the last row of a batch)
                    continue
                with clock.stage("collate"):
                    collated = self.decoder.collate(pieces, world.worker, epoch)
                yield collated, len(items) - (rows if i == start else 0) - lost
            reads.settle()
        finally:
            reads.close()


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


def begin(gate: torch.Tensor) -> int:
    """In the main process, before asking the workers for an iteration: its ticket."""
    gate[0] += 1
    return int(gate[0])


def release(gate: torch.Tensor, ticket: int) -> None:
    """In the main process: iteration `ticket`'s first batch is out (or the iteration ended)."""
    if gate[1] < ticket:
        gate[1] = ticket


def _wait_first_out(gate: torch.Tensor, ticket: int) -> None:
    """Wait (up to `FIRST_OUT_WAIT` seconds) until iteration `ticket`'s first batch has reached the
    main process: read-ahead and cache downloads would take the cores and the network from it (from
    its decoding in another worker, from its hand-over in this one). An iteration's own ticket: a
    worker still busy with an iteration left after its first batch (`validate_first_batch`) must not
    wait for the next one's, which the main process cannot begin until that worker is done."""
    deadline = time.monotonic() + FIRST_OUT_WAIT
    while gate[1] < ticket and time.monotonic() < deadline:
        time.sleep(0.002)
