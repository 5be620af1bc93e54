"""The decode stage of a worker: a batch's read samples opened and decoded by the kind, failures
counted and left out under on_error="skip" within the iteration's budget, then collated into
buffers the main process lends back (`collate.Leases`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.ma  # noqa: F401  (np.unique imports it on first use: ~0.1 s of each worker's first batch)
import torch
from torch.utils.data import get_worker_info

from pipeline.collate import Leases
from pipeline.config import LoaderConfig
from pipeline.errors import ConfigError, ShardError, ShardstreamError
from pipeline.index import SplitIndex, Where, group, locate
from pipeline.kinds import Kind
from pipeline.read import SampleReads
from pipeline.stats import Clock

__all__ = ["Decoder"]

log = logging.getLogger(__name__)


class Decoder:
    """Turns a batch's samples into a collated batch with the kind; counts skips in `skipped`
    (row 0 all epochs, row 1 this iteration, a column per worker: shared with the main process)."""

    def __init__(self, sources: list[SplitIndex], kind: Kind, config: LoaderConfig, skipped: torch.Tensor) -> None:
        self.sources, self.kind, self.config, self.skipped = sources, kind, config, skipped
        self.leases: Leases | None = None  # workers recycle batch buffers our own DataLoader hands back

    def open(self, members: dict[str, Any], url: str, key: str, units: int) -> Any:
        return self.kind.open(members, url=url, key=key, units=units)

    def prepare(self, reads: SampleReads, sources: np.ndarray,
                 items: np.ndarray) -> tuple[list[Where], list[tuple[Where, Any]]]:
        """A batch's samples in order of first use, and what to decode of each (`index.group`)."""
        samples, units = np.empty_like(items), np.zeros_like(items)
        for number in np.unique(sources).tolist():
            mine = np.flatnonzero(sources == number)
            samples[mine], units[mine] = locate(self.sources[number], items[mine],
                                                functools.partial(reads.unit_starts, number))
        return group(sources, samples, units, self.kind.grouped)

    def decode(self, reads: SampleReads, work: Sequence[tuple[Where, Any]], epoch: int, worker: int,
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

    def collate(self, samples: list[Any], worker: int, epoch: int) -> Any:
        if self.leases is None or get_worker_info() is None:
            return self.kind.collate(samples, epoch)
        with self.leases.collating(worker):
            batch = self.kind.collate(samples, epoch)
        self.leases.lend(worker, batch)
        return batch
