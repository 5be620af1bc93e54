"""One worker's iteration as a schedule of reads: which batches' samples are located and asked for
when (read-ahead, by chunks from object storage), and when the shard cache's downloads may start:
after the iteration's first batch reached the main process (`FirstOut`). Nothing else on the read
path knows about the first batch."""

from __future__ import annotations

import itertools
import logging
import multiprocessing
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.ma  # noqa: F401  (np.unique imports it on first use: ~0.1 s of each worker's first batch)

from pipeline.config import LoaderConfig
from pipeline.index import Located, group, locate, resolve, row_order
from pipeline.outputs.attach import Attachments
from pipeline.plan import Item
from pipeline.read import Opened, SampleReads

__all__ = ["FIRST_OUT_WAIT", "FirstOut", "Schedule"]

log = logging.getLogger(__name__)
FIRST_OUT_WAIT = 10.0  # seconds a worker's read-ahead waits at most for the first batch to be handed over
_CHUNK_ITEMS = 8192  # items whose reads are asked for at once from object storage, at most (see `_chunks`)


class FirstOut:
    """Between a StreamLoader and its workers: each iteration the loader begins has a ticket
    (`begin`), and the loader says when that iteration's first batch is out (`release`); a worker's
    read-ahead waits for it (`wait`): read-ahead and cache downloads would take the cores and the
    network from that batch (from its decoding in another worker, its hand-over in this one).

    A condition variable of `context` (the DataLoader's multiprocessing context: it reaches the
    workers with the dataset) over two shared numbers, the last ticket begun and the last released."""

    def __init__(self, context: str | None = None) -> None:
        ctx = multiprocessing.get_context(context)
        self._tickets = ctx.RawArray("q", 2)  # (begun, released)
        self._changed = ctx.Condition(ctx.Lock())

    def begin(self) -> int:
        """In the main process, before asking the workers for an iteration: its ticket."""
        self._tickets[0] += 1
        return self._tickets[0]

    def current(self) -> int:
        """The ticket of the iteration begun last (in a worker: the one it is asked for)."""
        return self._tickets[0]

    def release(self, ticket: int) -> None:
        """In the main process: iteration `ticket`'s first batch is out (or the iteration ended)."""
        if self._tickets[1] >= ticket:
            return
        self._tickets[1] = ticket
        if self._changed.acquire(timeout=1.0):  # (never stuck on a worker killed while holding it)
            try:
                self._changed.notify_all()
            finally:
                self._changed.release()

    def wait(self, ticket: int, timeout: float) -> bool:
        """Until iteration `ticket`'s first batch is out (True), or `timeout` seconds (False). An
        iteration's own ticket: a worker still busy with an iteration left after its first batch
        (`validate_first_batch`) must not wait for the next one's, which the main process cannot
        begin until that worker is done."""
        with self._changed:
            return self._changed.wait_for(lambda: self._tickets[1] >= ticket, timeout)


class Schedule:
    """One worker's iteration from `start` (a batch of its plan, and rows of it left out): `__iter__`
    gives each batch's samples to decode, in plan order, having located and asked for the reads of
    the batches `read_ahead` ahead (a chunk ahead, from object storage), but for the samples open
    already (`opened`); the read-ahead after the first batch, and the cache's downloads, wait for
    `first_out`'s ticket (but those of the first batch itself where `first_batch_by_range` is off).
    """

    def __init__(self, grouped: bool, config: LoaderConfig, plan: Sequence[Item], reads: SampleReads, opened: Opened,
                 first_out: tuple[FirstOut, int] | None, start: tuple[int, int] = (0, 0),
                 attach: tuple[Attachments, int] | None = None) -> None:
        """`attach`: the sidecars whose records are read with the samples', and the epoch."""
        self.sources, self.grouped, self.config, self.plan, self.reads = reads.sources, grouped, config, plan, reads
        self.opened, self.first_out, (self.start, self.rows), self.attach = opened, first_out, start, attach

    def __iter__(self) -> Iterator[tuple[int, int, list[tuple[Located, Any, Any]]]]:
        """(batch number, its items taken, what to decode of each sample: (sample, unit or units, the
        records attached to it: one per sidecar, or for a grouped kind such a tuple per unit))."""
        plan, start, cfg = self.plan, self.start, self.config
        chunks = self._chunks()
        asked = last = start  # batches asked for; the first batch of the last chunk asked for
        prepared: dict[int, list[tuple[Located, Any, Any]]] = {}
        if chunks is not None and cfg.first_batch_by_range:  # (from object storage: the first batch's reads only,
            self.reads.hold_downloads()  # by range; else from the cache's downloads, started at once)
        for i in range(start, len(plan)):
            if i == start + 1:
                self._wait_first_out()
                self.reads.start_downloads()
            ahead = cfg.read_ahead if i > start or chunks is None else 0
            while asked < len(plan) and (asked <= i + ahead or (chunks is not None and ahead and i >= last)):
                last = asked
                asked = min(asked + (next(chunks) if chunks is not None else 1), len(plan))
                samples: list[Located] = []
                for batch in range(last, asked):
                    more, prepared[batch] = self._prepare(batch)
                    samples += more
                self.reads.ahead([sample for sample in samples if sample.where not in self.opened])
            cut = self.rows if i == start else 0
            yield plan[i][0], len(plan[i][2]) - cut, prepared.pop(i)

    def _prepare(self, batch: int) -> tuple[list[Located], list[tuple[Located, Any, Any]]]:
        """A batch's samples (and records attached to them) located, their shards' indexes fetched
        together, in order of first use, and what to decode of each (`index.group`)."""
        cut = self.rows if batch == self.start else 0
        sources, items = (column[cut:] for column in self.plan[batch][1:])
        samples, units = np.empty_like(items), np.zeros_like(items)
        indexes = {}
        for number in np.unique(sources).tolist():
            mine = np.flatnonzero(sources == number)
            source = self.sources[number]
            found = self.reads.indexes(number, np.unique(source.shards_of(items[mine])).tolist())
            starts = {shard: index.unit_starts for shard, index in found.items()}
            samples[mine], units[mine] = locate(source, items[mine], starts)
            indexes[number] = found
        wheres, work = group(sources, samples, units, self.grouped)
        located = {where: resolve(self.sources[where[0]], where, indexes[where[0]]) for where in wheres}
        if self.attach is None:
            return list(located.values()), [(located[where], unit, ()) for where, unit in work]
        attachments, epoch = self.attach
        rows = row_order(sources, samples, self.grouped)
        keys = [located[where].key for where in zip(sources[rows].tolist(), samples[rows].tolist())]
        records = attachments.locate(self.reads.readers, epoch, sources[rows], items[rows], keys)
        ends = np.cumsum([len(unit) if self.grouped else 1 for _, unit in work]).tolist()
        per = [tuple(records[start:end]) if self.grouped else records[start]
               for start, end in zip([0] + ends[:-1], ends)]
        return [*located.values(), *(r for row in records for r in row if r is not None)], \
            [(located[where], unit, mine) for (where, unit), mine in zip(work, per)]

    def _wait_first_out(self) -> None:
        if self.first_out is not None:
            gate, ticket = self.first_out
            if not gate.wait(ticket, FIRST_OUT_WAIT):
                log.warning("the first batch of iteration %d was not handed over in %.0f s; reading ahead",
                            ticket, FIRST_OUT_WAIT)

    def _chunks(self) -> Iterator[int] | None:
        """From object storage: how many batches each request for reads covers, so that spans merge
        many samples: the first batch alone (it waits for its own samples only), then each time what
        fits twice (one chunk in use, the next in flight) in `read_ahead_bytes` after
        `read_amplification`, by the sources' mean bytes per item, and at most `_CHUNK_ITEMS` items
        (small items: the plan's work per chunk stays small). None: one batch at a time,
        `read_ahead` ahead. (Chunks of 1, 2, 4, ... batches made twice the requests, and were slower:
        207 against 107 requests in `make bench-s3`'s epoch of 256 samples, 16 a shard.)"""
        if not any(self.reads.spanned):
            return None
        cfg, sources = self.config, self.sources
        item = sum(int(s.split.shard_bytes.sum()) for s in sources) / max(1, sum(int(s.sizes.sum()) for s in sources))
        most = max(1, min(_CHUNK_ITEMS // cfg.batch_size,
                          int(cfg.read_ahead_bytes / (2 * cfg.read_amplification * cfg.batch_size * max(item, 1)))))
        return itertools.chain([1], itertools.repeat(min(most, len(self.plan))))
