"""The decode stage of a worker: a batch's samples taken from the read stage, opened and decoded by the kind
(a sample of several units opened once and kept open for the rest: `read.Opened`), failures
counted and left out under on_error="skip" within the iteration's budget, then collated into
buffers the main process lends back (`collate.Leases`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info

from pipeline.collate import Leases
from pipeline.config import LoaderConfig
from pipeline.errors import ConfigError, ShardError, ShardstreamError, about_sample
from pipeline.index import Located, SplitIndex
from pipeline.kinds import Kind
from pipeline.outputs.attach import Attachments
from pipeline.read import Opened, SampleReads
from pipeline.stats import Clock
from pipeline.watchdog import Progress

__all__ = ["Decoder"]

log = logging.getLogger(__name__)


class Decoder:
    """Turns a batch's samples into a collated batch with the kind; counts skips in `skipped`
    (row 0 all epochs, row 1 this iteration, a column per worker: shared with the main process)."""

    def __init__(self, sources: list[SplitIndex], kind: Kind, config: LoaderConfig, skipped: torch.Tensor,
                 leases: Leases | None = None, progress: Progress | None = None,
                 attachments: Attachments | None = None) -> None:
        """`attachments`: the sidecars whose records join the samples (none by default)."""
        self.sources, self.kind, self.config, self.skipped = sources, kind, config, skipped
        self.leases = leases  # workers recycle batch buffers our own DataLoader hands back
        self.progress = progress  # in a worker of our own DataLoader: what it does, for the watchdog
        self.attachments = attachments or Attachments((), sources, kind)

    def note(self, worker: int, stage: str, sample: Located | None = None) -> None:
        """The worker moves on to `stage` (`watchdog.STAGES`), of `sample`."""
        if self.progress is not None:
            self.progress.at(worker, stage, *((sample.url, sample.key) if sample is not None else ()))

    def _open(self, reads: SampleReads, opened: Opened, sample: Located, clock: Clock) -> Any:
        """The sample opened by the kind: kept from an earlier unit, or taken from the read stage (and
        kept when more units of it are to come)."""
        found = opened.get(sample.where)
        if found is not None:
            opened.move_to_end(sample.where)
            return found[0]
        keep = sample.units > 1 and self.sources[sample.where[0]].by_units
        members, held = reads.take(sample, keep)
        clock.mark()
        result = self.kind.open(members, url=sample.url, key=sample.key, units=sample.units)
        clock.split("open")
        if keep:
            opened.keep(sample.where, (result, held))
        return result

    def _decoded(self, reads: SampleReads, opened: Opened, work: tuple[Located, Any, Any], epoch: int,
                 worker: int, clock: Clock) -> tuple[Any, list[dict[str, Any]]]:
        """One unit (or, grouped, units) of a sample decoded by the kind, and the values attached to
        each (a row each); its errors name it."""
        sample, unit, records = work
        try:
            with about_sample(sample.url, sample.key):
                self.note(worker, "reading", sample)
                taken = self._open(reads, opened, sample, clock)
                rows = (records if self.kind.grouped else (records,)) if self.attachments.sidecars else ()
                attached = self.attachments.take(reads, rows, sample.key)  # (a row missing: never decoded)
                self.note(worker, "decoding", sample)
                decoded = self.kind.decode(taken, unit=unit, seed=self.config.seed, epoch=epoch, url=sample.url,
                                           key=sample.key, clock=clock)
                return decoded, attached
        finally:
            reads.done(sample)

    def decode(self, reads: SampleReads, opened: Opened, work: Sequence[tuple[Located, Any, Any]], epoch: int,
               worker: int, budget: int | None, clock: Clock) -> tuple[list[Any], list[dict[str, Any]], int]:
        """The batch's decoded samples, the values attached to its rows, and how many of its units
        failed; with on_error="skip", those that fail are counted and left out (more than `budget` in
        this iteration of the rank: an error)."""
        cfg, pieces, attached, lost = self.config, [], [], 0
        for entry in work:
            sample, unit, _ = entry
            try:
                decoded, values = self._decoded(reads, opened, entry, epoch, worker, clock)
                pieces.append(decoded)
                attached += values
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
                                     url=self.sources[sample.where[0]].root) from exc
        return pieces, attached, lost

    def collate(self, samples: list[Any], attached: list[dict[str, Any]], worker: int, epoch: int) -> Any:
        """The kind's batch of the samples, with their attached values (into lent buffers, where lent)."""
        lending = self.leases is not None and get_worker_info() is not None
        with self.leases.collating(worker) if lending else contextlib.nullcontext():  # type: ignore[union-attr]
            batch = self.kind.collate(samples, epoch)
            if self.attachments.sidecars:
                self.attachments.collate(attached, batch)
        if lending:
            self.leases.lend(worker, batch)  # type: ignore[union-attr]
        return batch
