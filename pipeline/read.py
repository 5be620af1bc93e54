"""The read stage: samples' bytes fetched in reader threads ahead of their use, checked (shard size,
sample size, tar members), and samples of several units kept open for their next units.

It knows nothing of kinds: it parses a sample's tar members and hands them to the `open` function
it is given (the kind's), and keeps what that returns."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pipeline.config import LoaderConfig
from pipeline.errors import ShardError
from pipeline.format import ShardIndex, ShardInfo
from pipeline.index import SplitIndex, Where
from pipeline.stats import Clock
from pipeline.storage import ShardCache, ShardReader, is_local, release_pages, shard_url
from pipeline.storage.retry import describe
from pipeline.tario import BLOCK, parse_sample

__all__ = ["MEMBER_GAP", "Opened", "ProcessReaders", "SampleReads", "member_ranges", "merge_spans"]

Open = Callable[[dict[str, Any], str, str, int], Any]  # (members, url, key, units) -> an opened sample
Members = list[tuple[str, int, int]]  # (extension, header offset, data bytes) of each, in shard order

log = logging.getLogger(__name__)
_CHECKED: concurrent.futures.Future[None] = concurrent.futures.Future()  # (a check done: nothing to wait for)
_CHECKED.set_result(None)

# Members of a sample this far apart or more are read by separate ranges. A range request costs
# about as much as 1 MiB of transfer from object storage (~10-20 ms of latency at ~50-100 MB/s),
# so a sample costs at most its own bytes plus a gap under 1 MiB between two members read together.
MEMBER_GAP = 1 << 20


def member_ranges(members: Members, gap: int = MEMBER_GAP) -> list[tuple[int, int, Members]]:
    """The byte ranges [start, end) that read a sample's members (in shard order), each with the
    members it holds: neighbours less than `gap` bytes apart share a range, others get their own."""
    ranges: list[tuple[int, int, Members]] = []
    for member in members:
        start, end = member[1], member[1] + BLOCK + member[2] + (-member[2] % BLOCK)
        if ranges and start - ranges[-1][1] < gap:
            ranges[-1] = (ranges[-1][0], end, [*ranges[-1][2], member])
        else:
            ranges.append((start, end, [member]))
    return ranges


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


class Opened(collections.OrderedDict[Where, tuple[Any, int, str, str]]):
    """Samples of several units kept open for their next units, (sample, bytes, url, key) each: the
    least recently used go past `limit` bytes or `count` samples (but the newest)."""

    def __init__(self, limit: int, count: int = 1 << 16) -> None:
        super().__init__()
        self.limit, self.count, self.held = limit, count, 0

    def keep(self, where: Where, entry: tuple[Any, int, str, str]) -> None:
        self[where] = entry
        self.held += entry[1]
        while (self.held > self.limit or len(self) > self.count) and len(self) > 1:
            self.held -= self.popitem(last=False)[1][1]


class ProcessReaders:
    """A process's shard readers (one per source) and open samples: made in the process that reads
    (filesystems are not fork-safe) and kept for its later iterations (a client costs ~0.1-0.3 s to
    make, and a sample opened again costs its checks again)."""

    def __init__(self, sources: Sequence[SplitIndex], config: LoaderConfig, verified: torch.Tensor | None) -> None:
        self.sources, self.config, self.verified = sources, config, verified
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
    that fails fails each of its samples, by its own key, with the span's error."""

    def __init__(self, reader: ShardReader, info: ShardInfo, url: str,
                 wanted: list[tuple[ShardInfo, str, list[tuple[int, int, Members | None]]]],
                 items: list[tuple[int, int, tuple[int, int, Members | None]]], futures: list[concurrent.futures.Future],
                 downloads: bool) -> None:
        """`wanted`: each sample's (shard, key, ranges); `items`: (sample, range number, range) of each range."""
        self.reader, self.info, self.url, self.downloads = reader, info, url, downloads
        self.wanted, self.items, self.futures = wanted, items, futures
        self.pieces: list[list[Any]] = [[None] * len(ranges) for _, _, ranges in wanted]
        self.left = [len(ranges) for _, _, ranges in wanted]  # ranges still to come of each sample (-1: failed)
        self.lock = threading.Lock()

    def read(self, first: int, last: int, members: list[int]) -> None:
        """Read bytes [first, last), the ranges `members` (numbers in `items`)."""
        info, items = self.info, self.items
        try:
            data = memoryview(self.reader.read(info.name, info.bytes, info.sha256, first, last, None, self.downloads))
        except Exception as exc:
            for i in dict.fromkeys(items[m][0] for m in members):
                with self.lock:
                    first_failure, self.left[i] = self.left[i] >= 0, -1  # (its other spans then set nothing)
                if first_failure:
                    error = ShardError(f"sample {self.wanted[i][1]!r}: "
                                       f"{exc.message if isinstance(exc, ShardError) else describe(exc)}", url=self.url)
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
    with its shard's size checked beside the first one; `take` waits for a sample and opens it (the
    time of each on `clock`: "read", "open").

    From object storage (with `read_ahead_bytes`), the samples asked for together are read by
    shard in merged byte spans (`merge_spans`): one request serves many samples. Local shards are
    mapped, so each sample is a view of its own."""

    def __init__(self, sources: Sequence[SplitIndex], readers: list[ShardReader], opened: Opened,
                 config: LoaderConfig, open: Open, clock: Clock | None = None) -> None:
        self.sources, self.readers, self.opened, self.limits, self.open = sources, readers, opened, config.limits, open
        self.clock = clock or Clock(("read", "open"))
        self.pool = concurrent.futures.ThreadPoolExecutor(config.read_threads, thread_name_prefix="shardstream-read")
        self.on_error = config.on_error
        self.sized: dict[tuple[int, int], concurrent.futures.Future[None]] = {}  # shards' size checks
        self.inflight: dict[Where, concurrent.futures.Future[list[tuple[int, bytes | memoryview, Members | None]]]] = {}
        self.taken: dict[Where, list[bytes | memoryview]] = {}  # taken and not kept open: released when `done`
        self.amplification = config.read_amplification
        self.downloads = True  # into the shard cache (False: the reads of the first batch, until `start_downloads`)
        self.spanned = [config.read_ahead_bytes > 0 and not is_local(r.fs) for r in readers]  # by source

    def close(self) -> None:
        if not sys.is_finalizing():  # (an iterator left open at exit: the interpreter ends the threads itself)
            self.pool.shutdown(wait=False, cancel_futures=True)

    def unit_starts(self, number: int, shards: list[int]) -> dict[int, np.ndarray]:
        """The first unit of each sample of these shards of source `number`, from their indexes
        (fetched at the same time when not held yet)."""
        source, reader = self.sources[number], self.readers[number]
        missing = [source.split[i] for i in shards if not reader.holds_index(source.split.names[i])]
        if len(missing) > 1:
            list(self.pool.map(reader.index, missing))
        return {i: reader.index(source.split[i]).unit_starts for i in shards}

    def ahead(self, wheres: list[Where]) -> None:
        """Ask for these samples' bytes, but for those open or asked for already; from object storage,
        those of one shard together (`_read_spans`)."""
        by_shard: dict[tuple[int, int], list[Where]] = {}
        for where in dict.fromkeys(wheres):
            if where in self.opened or where in self.inflight:
                continue
            if not self.spanned[where[0]]:
                self._submit(where)
                continue
            shard = self._check(where)
            by_shard.setdefault((where[0], shard), []).append(where)
        for group in by_shard.values():
            futures = [concurrent.futures.Future() for _ in group]
            self.inflight.update(zip(group, futures))
            self.pool.submit(self._read_spans, group, futures)

    def _check(self, where: Where) -> int:
        """The sample's shard, its size checked the first time in this iteration: a shard replaced or cut
        since packing is named before any of its samples is used (a shard the cache holds was checked
        whole: its SHA-256; a client whose answers say the size checks it on each read)."""
        number, sample = where
        shard, _ = self.sources[number].where(sample)
        if (number, shard) not in self.sized:
            reader, split = self.readers[number], self.sources[number].split
            checked = reader.reads_check_size(split.names[shard]) or \
                (reader.cache is not None and reader.cache.holds(split.sha256[shard]))
            self.sized[(number, shard)] = _CHECKED if checked else self.pool.submit(self._check_size, number, sample)
        return shard

    def _submit(self, where: Where) -> None:
        """Ask for one sample's bytes (and for its shard's size: `_check`)."""
        self._check(where)
        self.inflight[where] = self.pool.submit(self._read, where)

    def _sample(self, where: Where) -> tuple[int, ShardInfo, ShardIndex, int]:
        """(shard number, the shard, its index, the sample's place in it)."""
        source = self.sources[where[0]]
        shard, at = source.where(where[1])
        info = source.split[shard]
        return shard, info, self.readers[where[0]].index(info), at

    def _check_size(self, number: int, sample: int) -> None:
        _, info, index, at = self._sample((number, sample))
        size = self.readers[number].size(info.name, index.key(at))
        if size != info.bytes:
            raise ShardError(f"sample {index.key(at)!r}: shard is {size} "
                             f"bytes, the manifest says {info.bytes}",
                             url=shard_url(self.sources[number].root, info.name))

    def _ranges(self, where: Where) -> tuple[ShardInfo, str, list[tuple[int, int, Members | None]]]:
        """(the shard, the sample's key, the byte ranges that read it: a range per run of its members
        (`member_ranges`), each with its members, or None for an index without members, then one range)."""
        _, info, index, at = self._sample(where)
        key, url = index.key(at), shard_url(self.sources[where[0]].root, info.name)
        members = index.sample_members(at) if index.members is not None else None
        if members is not None and len(members) > self.limits.max_members:
            raise ShardError(f"sample {key!r}: more than {self.limits.max_members} members", url=url)
        ranges = member_ranges(members) if members is not None else [(*index.span(at), None)]
        size = sum(end - start for start, end, _ in ranges)
        if size > self.limits.max_sample_bytes:
            raise ShardError(f"sample {key!r} spans {size} bytes, more than max_sample_bytes="
                             f"{self.limits.max_sample_bytes}", url=url)
        return info, key, ranges

    def _read(self, where: Where) -> list[tuple[int, bytes | memoryview, Members | None]]:
        """One sample's bytes (in a reader thread), a request per range: (start, bytes, its members) each."""
        info, key, ranges = self._ranges(where)
        reader = self.readers[where[0]]
        return [(start, reader.read(info.name, info.bytes, info.sha256, start, end, key, self.downloads), group)
                for start, end, group in ranges]

    def _read_spans(self, wheres: list[Where], futures: list[concurrent.futures.Future]) -> None:
        """Samples of one shard (in a reader thread): their ranges merged into spans (`merge_spans`),
        each read by one request in a thread of its own, each sample's future set once all its ranges
        arrived. A span that fails fails each of its samples, by its own key, with the span's error."""
        try:
            _, info, _, _ = self._sample(wheres[0])  # (the shard's index, fetched once for all)
        except Exception as exc:
            for future in futures:
                future.set_exception(exc)
            return
        wanted: list[tuple[ShardInfo, str, list[tuple[int, int, Members | None]]]] = []
        items = []  # (sample, range number, range) of each range of each sample whose ranges pass the checks
        for i, (where, future) in enumerate(zip(wheres, futures)):
            try:
                wanted.append(self._ranges(where))
            except Exception as exc:
                future.set_exception(exc)
                wanted.append((None, "", []))  # type: ignore[arg-type]
            items += [(i, j, r) for j, r in enumerate(wanted[-1][2])]
        spans = _Spans(self.readers[wheres[0][0]], info, shard_url(self.sources[wheres[0][0]].root, info.name),
                       wanted, items, futures, self.downloads)
        for first, last, members in merge_spans([r[:2] for _, _, r in items], self.amplification):
            self.pool.submit(spans.read, first, last, members)

    def take(self, where: Where) -> tuple[Any, str, str]:
        """(the opened sample, its shard's URL, its key); a sample of several units is opened once and
        kept (LRU, by bytes) for the rest."""
        opened = self.opened
        if where in opened:
            opened.move_to_end(where)
            sample, _, url, key = opened[where]
            return sample, url, key
        number = where[0]
        source = self.sources[number]
        shard, info, index, at = self._sample(where)
        url, key = shard_url(source.root, info.name), index.key(at)
        if where not in self.inflight:  # (dropped from the open samples since its read was asked for)
            self._submit(where)
        future = self.inflight.pop(where)
        self.clock.mark()
        if (number, shard) in self.sized:
            self.sized[(number, shard)].result()
        pieces = future.result()
        self.clock.split("read")
        units, members = int(index.units[at]), {}
        for start, data, group in pieces:  # (members checked where the index says)
            members.update(parse_sample(data, url, key, self.limits, group, start))
        sample = self.open(members, url, key, units)
        self.clock.split("open")
        if units > 1 and source.by_units:
            # What a sample holds in this process's memory: a mapped file's pages are the page cache's.
            held = sum(len(data) for _, data, _ in pieces if isinstance(data, bytes))
            opened.keep(where, (sample, held, url, key))
        else:
            self.taken[where] = [data for _, data, _ in pieces]
        return sample, url, key

    def done(self, where: Where) -> None:
        """A sample taken is decoded: its mapped pages leave this process's memory (`release_pages`)."""
        for data in self.taken.pop(where, ()):
            release_pages(data)

    def start_downloads(self) -> None:
        self.downloads = True
        for reader in self.readers:
            reader.start_downloads()

    def settle(self) -> None:
        """The end of an iteration: the shard cache's downloads finished. One that found another object
        than its shard (`cache.Mismatch`) raises with on_error="raise" (samples of it were used before
        its check ended), else is logged as an error."""
        self.start_downloads()  # (an epoch of one batch)
        mismatched = [exc for reader in self.readers for exc in reader.settle()]
        for exc in mismatched[1:] if self.on_error == "raise" else mismatched:
            log.error("%s; samples read from it before its download was checked were used", exc)
        if mismatched and self.on_error == "raise":
            raise ShardError(f"{mismatched[0].message}; samples read from it before its download "
                             "was checked were used", url=mismatched[0].url) from mismatched[0]
