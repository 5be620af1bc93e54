"""One process's chain of stages for an iteration of the stream: plan -> schedule (locate, read
ahead: `pipeline.schedule`) -> read (`pipeline.read`) -> decode (`pipeline.decoding`, the kind's, with
the records of attached sidecars) -> collate, each batch made only while no shard it may touch was
rewritten in place."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from pipeline.config import LoaderConfig
from pipeline.decoding import Decoder
from pipeline.errors import ShardError
from pipeline.index import SplitIndex
from pipeline.outputs.attach import Attachments
from pipeline.plan import Mix, World, plan_epoch
from pipeline.position import Position
from pipeline.read import ProcessReaders, SampleReads
from pipeline.schedule import FirstOut, Schedule
from pipeline.stats import Clock

__all__ = ["Stages"]


@dataclasses.dataclass(frozen=True, eq=False)
class Stages:
    """What a worker's iteration is made with: the sources, their mix, the settings, the decoder (the
    kind, with the attachments) and this process's readers."""

    sources: list[SplitIndex]
    mix: Mix | None
    config: LoaderConfig
    decoder: Decoder
    readers: ProcessReaders

    @property
    def attachments(self) -> Attachments:
        return self.decoder.attachments

    def checked(self, batches: Iterator[Any], finished: bool) -> Iterator[Any]:
        """The batches (`finished`: as users get them, for `make_stream_dataset`), each made only while
        no shard it may touch was rewritten in place."""
        while True:
            problem = self.readers.lease_problem()
            if problem is not None:
                batches.close()  # (its samples read ahead)
                raise problem
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield self.attachments.finish(batch) if finished else batch

    def batches(self, world: World, position: Position, clock: Clock, ticket: tuple[FirstOut, int] | None,
                budget: int | None) -> Iterator[tuple[Any, int]]:
        """plan -> schedule (locate, read ahead) -> decode -> collate: (batch, its samples), from
        `position`'s batch on, less its first `rows` samples; at most `budget` skips."""
        cfg, decoder, epoch = self.config, self.decoder, position.epoch
        plan = plan_epoch([s.sizes for s in self.sources], cfg.seed, epoch, world, batch_size=cfg.batch_size,
                          drop_last=cfg.drop_last, shuffle=cfg.shuffle, window=cfg.shuffle_window, mix=self.mix,
                          history=position.history)
        readers, opened = self.readers.get()
        reads = SampleReads(self.sources, readers, cfg, clock)
        attach = (self.attachments, epoch) if self.attachments.sidecars else None
        try:
            for batch, items, work in Schedule(decoder.kind.grouped, cfg, plan, reads, opened, ticket,
                                               (position.batches, position.rows), attach):
                with clock.stage("decode"):  # (the reads' waits and opens in it are theirs: `LoaderStats.of`)
                    pieces, attached, lost = decoder.decode(reads, opened, work, epoch, world.worker, budget, clock)
                if not pieces and items:
                    raise ShardError(f"all {items} samples of batch {batch} failed; ranks "
                                     "cannot stay in step", url=self.sources[0].root)
                if not pieces:  # (resumed after the last row of a batch)
                    continue
                decoder.note(world.worker, "collating")
                with clock.stage("collate"):
                    collated = decoder.collate(pieces, attached, world.worker, epoch)
                decoder.note(world.worker, "handing over a batch")
                yield collated, items - lost
            reads.settle()
            decoder.note(world.worker, "done")
        finally:
            reads.close()
