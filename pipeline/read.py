"""The read stage: samples' bytes fetched in reader threads ahead of their use, each by the way its
shard is read (`storage.ShardReader.way`), checked (shard size, sample size, tar members), and
the samples of several units that the decode stage keeps open (`Opened`) for their next units.

It takes samples located already (`index.Located`), gives their tar members, and knows nothing of kinds."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline.config import LoaderConfig
from pipeline.errors import ShardError, about_sample
from pipeline.format import ShardIndex
from pipeline.index import Located, Members, SplitIndex, Where
from pipeline.stats import Clock
from pipeline.storage import ShardCache, ShardReader, is_local, release_pages
from pipeline.storage.reader import Way
from pipeline.storage.retry import describe
from pipeline.tario import ReadLimits, parse_sample

__all__ = ["Opened", "ProcessReaders", "SampleReads", "merge_spans"]

Pieces = list[tuple[int, bytes | memoryview, Members | None]]  # a sample's ranges read: (start, bytes, members)

log = logging.getLogger(__name__)


def merge_spans(ranges: Sequence[tuple[int, int]], amplification: float) -> list[tuple[int, int, list[int]]]:
    """Byte ranges [start, end) of one shard (disjoint) merged into spans, each (start, end, the numbers
    of the ranges it covers), in order of start: a range joins the span before it while the span
    stays within `amplification` times the bytes of the ranges it serves."""
    spans: list[tuple[int, int, list[int]]] = []
    used = 0
    for number in sorted(range(len(ranges)), key=lambda n: ranges[n][0]):
        start, end = ranges[number]
        if spans:
            first, last, members = spans[-1]
            if max(last, end) - first <= amplification * (used + end - start):
                spans[-1] = (first, max(last, end), [*members, number])
                used += end - start
                continue
        spans.append((start, end, [number]))
        used = end - start
    return spans


def checked(sample: Located, limits: ReadLimits) -> Located:
    """The sample, if its members and bytes are within `limits` (else a ShardError)."""
    members = sum(len(group) for _, _, group in sample.ranges if group is not None)
    if members > limits.max_members:
        raise ShardError(f"more than {limits.max_members} members", url=sample.url)
    size = sum(end - start for start, end, _ in sample.ranges)
    if size > limits.max_sample_bytes:
        raise ShardError(f"spans {size} bytes, more than max_sample_bytes={limits.max_sample_bytes}", url=sample.url)
    return sample


class Opened(collections.OrderedDict[Where, tuple[Any, int]]):
    """Samples of several units kept open for their next units, (sample, bytes) each: the
    least recently used go past `limit` bytes or `count` samples (but the newest)."""

    def __init__(self, limit: int, count: int = 1 << 16) -> None:
        super().__init__()
        self.limit, self.count, self.held = limit, count, 0

    def keep(self, where: Where, entry: tuple[Any, int]) -> None:
        self[where] = entry
        self.held += entry[1]
        while (self.held > self.limit or len(self) > self.count) and len(self) > 1:
            self.held -= self.popitem(last=False)[1][1]


class ProcessReaders:
    """A process's shard readers (one per source) and open samples: made in the process that reads
    (filesystems are not fork-safe) and kept for its later iterations (a client costs ~0.1-0.3 s to
    make, and a sample opened again costs its checks again)."""

    def __init__(self, sources: Sequence[SplitIndex], config: LoaderConfig, verified: torch.Tensor | None,
                 attachments: Any = None) -> None:
        """`attachments`: sidecars (`pipeline.outputs.attach`) whose readers follow the sources'."""
        self.sources, self.config, self.verified, self.attachments = sources, config, verified, attachments
        self.pid: int | None = None
        self.readers: list[ShardReader] = []
        self.opened = Opened(config.unit_cache_bytes)

    def get(self) -> tuple[list[ShardReader], Opened]:
        if self.pid != os.getpid():
            cfg = self.config
            cache = ShardCache(cfg.cache_dir, cfg.cache_limit) if cfg.cache_dir is not None else None
            tables: list[Any] = [None] * len(self.sources)
            if self.verified is not None:
                ends = np.cumsum([len(s.split) for s in self.sources]).tolist()
                table = self.verified.numpy()
                tables = [(table[end - len(s.split) : end], s.split.names) for s, end in zip(self.sources, ends)]
            self.readers = [ShardReader(s.root, cfg.storage_options, cfg.retry, cache, verified, cfg.index_cache_bytes,
                                        cfg.allowed_roots) for s, verified in zip(self.sources, tables)]
            if self.attachments is not None:
                self.readers += self.attachments.readers(cfg, cache)
            self.opened = Opened(cfg.unit_cache_bytes)
            self.pid = os.getpid()
        return self.readers, self.opened

    def lease_problem(self) -> ShardError | None:
        """A mapped shard that another process is rewriting in place, named (see
        `MappedFiles.check_leases`); the samples opened from any shard are dropped then."""
        if self.pid != os.getpid():
            return None
        problems = [p for reader in self.readers for p in reader.mapped.check_leases()]
        if not problems:
            return None
        self.opened = Opened(self.config.unit_cache_bytes)
        more = f" (and {len(problems) - 1} more shards)" if len(problems) > 1 else ""
        return ShardError(problems[0][1] + more, url=problems[0][0])

    def __getstate__(self) -> dict[str, Any]:  # (spawned workers make their own readers)
        return {**self.__dict__, "pid": None, "readers": [], "opened": None}


class _Spans:
    """The spans of one shard's samples asked for together (`SampleReads._read_spans`): `read` reads one
    (in a thread of its own) and sets the future of each sample once all its ranges arrived; a span
    that fails fails each of its samples with the span's error."""

    def __init__(self, way: Way, samples: list[Located], futures: list[concurrent.futures.Future[Pieces]],
                 items: list[tuple[int, int, tuple[int, int, Members | None]]]) -> None:
        """`items`: (sample, range number, range) of each range to read."""
        self.way, self.futures, self.items = way, futures, items
        self.pieces: list[list[Any]] = [[None] * len(s.ranges) for s in samples]
        self.left = [len(s.ranges) for s in samples]  # ranges still to come of each sample (-1: failed)
        self.lock = threading.Lock()

    def read(self, first: int, last: int, members: list[int]) -> None:
        """Read bytes [first, last), the ranges `members` (numbers in `items`)."""
        items = self.items
        try:
            data = memoryview(self.way.read(first, last))
        except Exception as exc:
            for i in dict.fromkeys(items[m][0] for m in members):
                with self.lock:
                    first_failure, self.left[i] = self.left[i] >= 0, -1  # (its other spans then set nothing)
                if first_failure:  # (an error of its own for each sample: each is named by its key)
                    error = ShardError(exc.message if isinstance(exc, ShardError) else describe(exc), url=self.way.url)
                    error.__cause__ = exc
                    self.futures[i].set_exception(error)
            return
        for m in members:
            i, j, (start, end, group) = items[m]
            self.pieces[i][j] = (start, data[start - first : end - first], group)
            with self.lock:
                self.left[i] -= 1
                done = self.left[i] == 0
            if done:
                self.futures[i].set_result(self.pieces[i])


class SampleReads:
    """One iteration's reads: each sample's bytes asked for once (`ahead`), in `read_threads` threads,
    with its shard's size checked beside the first one; `take` waits for a sample's bytes (the time
    on `clock`: "read") and gives its members.

    From object storage (with `read_ahead_bytes`), the samples asked for together are read by
    shard in merged byte spans (`merge_spans`): one request serves many samples. Local shards are
    mapped, so each sample is a view of its own."""

    def __init__(self, sources: Sequence[SplitIndex], readers: list[ShardReader], config: LoaderConfig,
                 clock: Clock | None = None) -> None:
        self.sources, self.readers, self.limits = sources, readers, config.limits
        self.clock = clock or Clock(("read",))
        self.pool = concurrent.futures.ThreadPoolExecutor(config.read_threads, thread_name_prefix="shardstream-read")
        self.on_error = config.on_error
        self.sized: dict[str, concurrent.futures.Future[None]] = {}  # shards' size checks, by URL
        self.inflight: dict[Where, concurrent.futures.Future[Pieces]] = {}
        self.taken: dict[Where, list[bytes | memoryview]] = {}  # taken and not kept open: released when `done`
        self.amplification = config.read_amplification
        self.spanned = [config.read_ahead_bytes > 0 and not is_local(r.fs) for r in readers]  # by source

    def close(self) -> None:
        if not sys.is_finalizing():  # (an iterator left open at exit: the interpreter ends the threads itself)
            self.pool.shutdown(wait=False, cancel_futures=True)

    def indexes(self, number: int, shards: list[int]) -> dict[int, ShardIndex]:
        """The indexes of these shards of source `number` (those not held yet fetched at the same time)."""
        split, reader = self.sources[number].split, self.readers[number]
        missing = [split[i] for i in shards if not reader.holds_index(split.names[i])]
        if len(missing) > 1:
            list(self.pool.map(reader.index, missing))
        return {i: reader.index(split[i]) for i in shards}

    def ahead(self, samples: list[Located]) -> None:
        """Ask for these samples' bytes, but for those asked for already; from object storage, those of
        one shard together (`_read_spans`)."""
        by_shard: dict[tuple[int, str], list[Located]] = {}
        for sample in samples:
            if sample.where in self.inflight:
                continue
            self._check_size(sample)
            if self.spanned[sample.where[0]]:
                by_shard.setdefault((sample.where[0], sample.shard.name), []).append(sample)
            else:
                self.inflight[sample.where] = self.pool.submit(self._read, sample)
        for group in by_shard.values():
            futures: list[concurrent.futures.Future[Pieces]] = [concurrent.futures.Future() for _ in group]
            self.inflight.update((s.where, f) for s, f in zip(group, futures))
            self.pool.submit(self._read_spans, group, futures)

    def _way(self, sample: Located) -> Way:
        return self.readers[sample.where[0]].way(sample.shard)

    def _check_size(self, sample: Located) -> None:
        """The sample's shard's size checked, the first time in this iteration: a shard replaced or cut
        since packing is named before any of its samples is used (a shard the cache holds was checked
        whole: its SHA-256; a way whose reads say the size checks it on each read)."""
        if sample.url not in self.sized:
            self.sized[sample.url] = self.pool.submit(self._size_is, sample)

    def _size_is(self, sample: Located) -> None:
        way = self._way(sample)
        if not way.checks_size() and (size := way.size()) != sample.shard.bytes:
            raise ShardError(f"shard is {size} bytes, the manifest says {sample.shard.bytes}", url=sample.url)

    def _read(self, sample: Located) -> Pieces:
        """One sample's bytes (in a reader thread), a request per range: (start, bytes, its members) each."""
        way = self._way(checked(sample, self.limits))
        return [(start, way.read(start, end), group) for start, end, group in sample.ranges]

    def _read_spans(self, samples: list[Located], futures: list[concurrent.futures.Future[Pieces]]) -> None:
        """Samples of one shard (in a reader thread): their ranges merged into spans (`merge_spans`),
        each read by one request in a thread of its own, each sample's future set once all its ranges
        arrived."""
        try:
            way = self._way(samples[0])
        except Exception as exc:
            for future in futures:
                future.set_exception(exc)
            return
        items = []  # (sample, range number, range) of each range of each sample within the limits
        for i, (sample, future) in enumerate(zip(samples, futures)):
            try:
                items += [(i, j, r) for j, r in enumerate(checked(sample, self.limits).ranges)]
            except ShardError as exc:
                future.set_exception(exc)
        spans = _Spans(way, samples, futures, items)
        for first, last, members in merge_spans([r[:2] for _, _, r in items], self.amplification):
            self.pool.submit(spans.read, first, last, members)

    def take(self, sample: Located, keep: bool = False) -> tuple[dict[str, Any], int]:
        """The sample's members, checked where the index says (`tario.parse_sample`), and the bytes
        they hold in this process's memory (a mapped file's pages are the page cache's); its pages
        are released at `done` unless the caller `keep`s the sample. Its errors name it (`about_sample`)."""
        with about_sample(sample.url, sample.key):
            pieces = self._pieces(sample)
            members: dict[str, Any] = {}
            for start, data, group in pieces:
                members.update(parse_sample(data, sample.url, sample.key, self.limits, group, start))
        if not keep:
            self.taken[sample.where] = [data for _, data, _ in pieces]
        return members, sum(len(data) for _, data, _ in pieces if isinstance(data, bytes))

    def raw(self, sample: Located) -> memoryview:
        """The bytes of a sample read as one range, as they are (a row of a linked dataset's column:
        `pipeline.outputs.attach`); its pages are released at `done`."""
        with about_sample(sample.url, sample.key):
            pieces = self._pieces(sample)
        self.taken[sample.where] = [data for _, data, _ in pieces]
        return memoryview(pieces[0][1])

    def _pieces(self, sample: Located) -> Pieces:
        if sample.where not in self.inflight:  # (asked for again: dropped from the open samples since)
            self.ahead([sample])
        future = self.inflight.pop(sample.where)
        self.clock.mark()
        self.sized[sample.url].result()
        pieces = future.result()
        self.clock.split("read")
        return pieces

    def done(self, sample: Located) -> None:
        """A sample taken is decoded: its mapped pages leave this process's memory (`release_pages`)."""
        for data in self.taken.pop(sample.where, ()):
            release_pages(data)

    def hold_downloads(self) -> None:
        """New downloads into the shard cache wait for `start_downloads` (reads go by range meanwhile)."""
        for reader in self.readers:
            if reader.downloads is not None:
                reader.downloads.held = True

    def start_downloads(self) -> None:
        for reader in self.readers:
            if reader.downloads is not None:
                reader.downloads.start_held()

    def settle(self) -> None:
        """The end of an iteration: the shard cache's downloads finished. One that found another object
        than its shard (`cache.Mismatch`) raises with on_error="raise" (samples of it were used before
        its check ended), else is logged as an error."""
        mismatched = [exc for reader in self.readers if reader.downloads for exc in reader.downloads.settle()]
        for exc in mismatched[1:] if self.on_error == "raise" else mismatched:
            log.error("%s; samples read from it before its download was checked were used", exc)
        if mismatched and self.on_error == "raise":
            raise ShardError(f"{mismatched[0].message}; samples read from it before its download "
                             "was checked were used", url=mismatched[0].url) from mismatched[0]
