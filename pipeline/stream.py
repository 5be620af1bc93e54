"""The stream: a torch IterableDataset yielding one worker's batches of a split for the epoch in
`EpochState`, made by a chain of stages (`pipeline.stages`: plan -> schedule -> read -> decode ->
collate, into buffers lent back by the main process). Errors of ours in a worker travel back as
values (torch would re-raise them as a bare RuntimeError); with on_error="skip" a bad sample is
left out, within the skip budget."""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from pipeline.collate import Leases
from pipeline.decoding import Decoder
from pipeline.config import LoaderConfig
from pipeline.errors import ConfigError, ShardstreamError
from pipeline.index import SplitIndex
from pipeline.kinds import Kind
from pipeline.outputs.attach import Attachments
from pipeline.plan import Mix, Resume, World, epoch_samples, rank_batch_count, rank_sample_count
from pipeline.read import ProcessReaders
from pipeline.position import Place, Position, hand_over
from pipeline.schedule import FirstOut
from pipeline.stages import Stages
from pipeline.state import EpochState
from pipeline.stats import WorkerTable
from pipeline.watchdog import Progress

__all__ = ["Asked", "Handoff", "ShardStream", "WorkerError"]


@dataclasses.dataclass(frozen=True)
class Handoff:
    """What a StreamLoader's own DataLoader shares with its workers, made in the main process before
    they start: the batch buffers lent back (`collate.Leases`), the first batch's gate (`FirstOut`)
    and what each worker does, for the watchdog (`Progress`). None of them for a dataset that
    another's DataLoader iterates (`make_stream_dataset`), or without workers."""

    leases: Leases | None = None
    first_out: FirstOut | None = None
    progress: Progress | None = None


@dataclasses.dataclass(frozen=True)
class Asked:
    """What a StreamLoader's iteration asks of its workers: its `FirstOut` ticket, epoch and history."""

    ticket: int
    epoch: int
    history: tuple[Resume, ...]


@dataclasses.dataclass(frozen=True)
class WorkerError:
    """An error of ours raised in a worker, sent as a value: torch would re-raise it as a bare RuntimeError."""

    error: ShardstreamError


class ShardStream(IterableDataset):
    """Yields this worker's collated batches of one split for the epoch held in `state`.

    For `make_stream_dataset` (`finished`): batches as users get them (`Kind.finish`), or with
    `flatten` their samples (`Kind.unbatch`), errors raised in the worker; `split_workers=False`:
    whoever iterates reads the rank's whole share, in any DataLoader worker. `identity`: what a saved
    state must share with it (`state.resume_point`); `option_defaults`: what a kind option a saved
    state lacks meant; `attachments`: the sidecars whose outputs join each batch (and its `finish`)."""

    def __init__(self, sources: list[SplitIndex], mix: Mix | None, kind: Kind, config: LoaderConfig, world: World,
                 *, max_workers: int, identity: dict[str, Any], option_defaults: dict[str, Any],
                 handoff: Handoff = Handoff(), finished: bool = False, flatten: bool = False,
                 split_workers: bool = True, attachments: Attachments) -> None:
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
        self.first_out = handoff.first_out
        # What the StreamLoader's iteration asks for (its FirstOut ticket, epoch and history), in this
        # process's memory, not shared: workers started for it (forked or spawned) take it with them.
        self.asked: Asked | None = None
        self.finished, self.flatten, self.split_workers = finished, flatten, split_workers
        self.attachments = attachments
        decoder = Decoder(sources, kind, config, self.skipped, handoff.leases, handoff.progress, attachments)
        self.stages = Stages(sources, mix, config, decoder, ProcessReaders(sources, config, verified, attachments))
        self.identity, self.option_defaults = identity, option_defaults
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
        call this on datasets that have it). An epoch an attached sidecar lacks is refused."""
        self.attachments.check_epoch(epoch)
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
        self.place.load(state, self.identity, self._world(), in_step=self.config.on_error == "raise",
                        defaults=self.option_defaults)

    def start_at(self, items: int) -> None:
        """Start this process's next iteration of the chosen epoch after the first `items` items it
        would yield, none of them decoded (for a wrapper that counts what it took: `pipeline.hf_datasets`).
        Needs on_error="raise": with skips, items yielded no longer tell batches apart."""
        if self.config.on_error != "raise" or not self.flatten:
            raise ConfigError("start_at needs flatten=True and on_error='raise'")
        self.place.hold(dataclasses.replace(self._fresh(), **dict(zip(("batches", "rows"),
                                                                      divmod(items, self.config.batch_size)))))

    def ask(self) -> int:
        """In the main process, before a StreamLoader's iteration asks its workers: the iteration's
        `FirstOut` ticket (0: none), kept with the epoch and history it plays (`asked`)."""
        self.attachments.check_epoch(self.state.epoch)
        ticket = self.first_out.begin() if self.first_out is not None else 0
        self.asked = Asked(ticket, self.state.epoch, self.state.history)
        return ticket

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
        # A worker's first iteration is the one it was started for (`asked`), never what the shared
        # state says by the time it runs: under load it may start after the main process took the
        # iteration's batches from the others and began the next. Later ones (torch resuming
        # persistent workers, while the main process waits for them) read the shared state.
        asked, self.asked = self.asked, None
        fresh = self._fresh() if asked is None else Position(asked.epoch, asked.history, world.worker,
                                                              world.num_workers)
        self.attachments.check_epoch(fresh.epoch)  # (for a DataLoader of another's: set_epoch checks ours)
        number = asked.ticket if asked is not None else self.first_out.current() if self.first_out else 0
        ticket = None if self.first_out is None else (self.first_out, number)
        return self._yield(world, self.place.start(fresh, self.state, self.batches), ticket)

    def _yield(self, world: World, position: Position, ticket: tuple[FirstOut, int] | None) -> Iterator[Any]:
        """The iteration's batches or samples from `position` on, which it keeps up to date."""
        info = get_worker_info() if self.split_workers else None
        self.skipped[1, world.worker] = 0  # this iteration's skips, counted afresh by each worker
        if info is not None and (progress := self.stages.decoder.progress) is not None:
            progress.start(world.worker)
        clock = self.times.clock()
        # Resuming inside a batch: its first rows are not decoded again, unless skips may have left out
        # some of them (then they are decoded and dropped: rows and samples no longer correspond).
        exact, budget = self.config.on_error == "raise", self.config.max_errors  # (skips allowed in the iteration)
        if isinstance(budget, float):
            budget = int(budget * self.rank_samples(position.history))
        made = self.stages.batches(world, position if exact else dataclasses.replace(position, rows=0), clock, ticket,
                                   budget)
        batches = self.times.timed(world.worker, clock, made)  # (each batch's making: its "active" time)
        try:
            yield from hand_over(self.stages.checked(batches, self.finished), position,
                                 self.attachments.unbatch if self.flatten else None, 0 if exact else position.rows)
        except ShardstreamError as exc:
            if info is None or self.finished:
                raise
            exc.add_note(f"in DataLoader worker {info.id}:\n{traceback.format_exc()}")
            yield WorkerError(exc)
        finally:
            batches.close()
