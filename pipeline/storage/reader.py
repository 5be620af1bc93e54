"""The reader that picks, per shard, among mapped local files, the shard cache and ranged reads."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import fsspec

from pipeline.errors import ShardError
from pipeline.format import ShardIndex, ShardInfo
import pipeline.storage.locks as locks
from pipeline.storage.cache import CacheFull, Mismatch, ShardCache
from pipeline.storage.fs import filesystem, is_local, join
from pipeline.storage.local import MappedFiles, open_regular, regular_size
from pipeline.storage.meta import read_index
from pipeline.storage.places import Places
from pipeline.storage.ranged import Ranged, client_for, ranged_reader
from pipeline.storage.retry import Retry, describe

__all__ = ["DOWNLOADS", "ShardReader"]

log = logging.getLogger("pipeline.storage")
DOWNLOADS = 8  # shards a process downloads into the cache at once


class _Hashed:
    """verify="sha256": local shards' SHA-256 checked against the manifest's, once per file as it is
    now for all the processes reading: `table` has a row per shard (inode, size, mtime of the file
    checked; an int64 array shared between the processes), `names` the shards' names."""

    def __init__(self, table: Any, names: Sequence[str]) -> None:
        self.table, self.names = table, names
        self.rows: dict[str, int] | None = None  # shard name -> row of `table` (made when first needed)

    def check(self, name: str, path: str, url: str, sha256: str, size: int) -> None:
        """Check a local shard's SHA-256 against the manifest's, unless the shared table says the file
        as it is now (inode, size, mtime) was checked: by one process at a time (a lock on the shard,
        so that the others wait for its answer instead of hashing it again; never held by a process
        forked meanwhile: `locks`). Only a regular file of the manifest's size is read, and no further."""
        if self.rows is None:
            self.rows = {n: i for i, n in enumerate(self.names)}
        row = self.table[self.rows[name]]

        def checked() -> bool:
            stat = os.stat(path)
            return row.tolist() == [stat.st_ino, stat.st_size, stat.st_mtime_ns]

        if checked():
            return
        fd = open_regular(path, url, size)
        try:
            with contextlib.suppress(OSError):  # (no lock where the filesystem has none: hash it here too)
                locks.lock(fd)
            if checked():
                return
            stat = os.fstat(fd)
            digest, left = hashlib.sha256(), size
            while left and (block := os.read(fd, min(left, 1 << 22))):
                digest.update(block)
                left -= len(block)
            if digest.hexdigest() != sha256:
                raise ShardError(f"content has SHA-256 {digest.hexdigest()}, the manifest says {sha256}: the "
                                 "shard was changed since it was packed, or the manifest was edited (verify='sha256')",
                                 url=url)
            row[:] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            log.debug("%s: SHA-256 checked", url)
        finally:
            locks.close(fd)  # (and the lock)


def _read_mapped(mapped: MappedFiles, verified: _Hashed | None, name: str, path: str, url: str, size: int, sha256: str,
                 start: int, end: int, key: str | None) -> memoryview:
    """Bytes [start, end) of a local shard, a view of the file mapped in memory (its SHA-256 checked
    first where `verified`)."""
    try:
        if verified is not None:
            verified.check(name, path, url, sha256, size)
        data = mapped.read(path, url, start, end)
    except FileNotFoundError as exc:
        raise ShardError(f"sample {key!r}: shard is missing", url=url) from exc
    except (OSError, ValueError) as exc:
        raise ShardError(f"sample {key!r}: cannot read the shard: {describe(exc)}", url=url) from exc
    if len(data) < end - start:
        actual: int | str = "now fewer"
        with contextlib.suppress(OSError):
            actual = os.stat(path).st_size
        raise ShardError(f"sample {key!r}: shard is {actual} bytes, shorter than the sample's range "
                         f"({start}-{end})", url=url)
    return data


class ShardReader:
    """Reads samples of one dataset's shards by byte range, with retries, from storage or the cache.

    With a cache, a shard not cached yet is downloaded whole in the background, by one process of
    the node (`DOWNLOADS` at a time per process), and its samples are taken from the download as
    they arrive (in any process): no sample waits for a whole shard, and a shard's bytes cross the
    network once per node. Build it in the process that reads (a DataLoader worker).

    Local shards (in place or cached) are memory-mapped under read leases (`local.MappedFiles`).

    Names resolve inside the dataset's folder, or under `allowed_roots` (`places.Places`); with a
    cache, a shard whose download found another object than the manifest's (`cache.Mismatch`) is
    an error for each sample asked for afterwards, in every process sharing the cache."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None, retry: Retry,
                 cache: ShardCache | None = None, verified: tuple[Any, Sequence[str]] | None = None,
                 index_bytes: int = 64 << 20, allowed_roots: Sequence[str] = ()) -> None:
        """`verified`: to check local shards' SHA-256, a table of one row per shard (an int64 array
        of shape (shards, 3), shared between the processes reading) and the shards' names.
        `index_bytes`: shard indexes kept (least recently used dropped past it). `allowed_roots`:
        places outside the folder that its manifest may name (the user's choice)."""
        self.root, self.retry = root, retry
        self.places = Places(root, tuple(allowed_roots))
        self.fs, self.base = filesystem(root, storage_options)
        self.cache = None if is_local(self.fs) else cache  # local shards are read in place
        self._indexes: collections.OrderedDict[str, ShardIndex] = collections.OrderedDict()
        self._index_limit, self._index_held = index_bytes, 0
        self._downloads: dict[str, concurrent.futures.Future[str | None]] = {}
        self._started: dict[str, threading.Event] = {}  # set once a download's file is there, or it ended
        self._deferred: dict[str, tuple[int, str]] = {}  # shards to download once downloads start
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.mapped = MappedFiles(root)  # local shards, in place or cached
        self._verified = None if verified is None else _Hashed(*verified)
        self._storage_options = storage_options
        self._places: dict[str, tuple[fsspec.AbstractFileSystem, str, str, Ranged]] = {}
        self._client: tuple[Any, str] | None = None  # (ranged client, path) of the dataset's folder
        self._mismatched: dict[str, str] = {}  # shard name -> why its object is not the shard (this process's downloads)

    def _place(self, name: str) -> tuple[fsspec.AbstractFileSystem, str, str, Ranged]:
        """(filesystem, path, URL, ranged reader: its scheme's client, `ranged.CLIENTS`) of a shard: in the
        dataset's folder (on its filesystem), or where its absolute name says, inside an allowed root
        (an archive indexed in place: another bucket, or object storage under a local dataset); a
        local file by its real path, checked (`Places.real`). A ShardError for a name outside them."""
        found = self._places.get(name)
        if found is None:
            url = self.places.url(name)
            fs, path = (self.fs, join(self.base, name)) if url == join(self.root, name) else \
                filesystem(url, self._storage_options)
            if is_local(fs):
                path = self.places.real(path, url)
                ranged = Ranged(fs, path, url, self.retry)
            else:
                ranged = ranged_reader(url, self._storage_options, self.retry)
            found = self._places.setdefault(name, (fs, path, url, ranged))
        return found

    def holds_index(self, name: str) -> bool:
        return name in self._indexes

    def index(self, shard: ShardInfo) -> ShardIndex:
        """The shard's index: fetched when first asked for, then kept (least recently used dropped
        past `index_bytes`, but the newest)."""
        with self._lock:
            found = self._indexes.get(shard.name)
            if found is not None:
                self._indexes.move_to_end(shard.name)
                return found
        if self._client is None:  # (index files through the scheme's lean client, as shards are)
            self._client = client_for(self.root, self._storage_options)
        index = read_index(*self._client, self.root, shard, self.retry, self.cache, self.places)  # type: ignore[arg-type]
        if shard.index is not None:
            with self._lock:
                if shard.name not in self._indexes:
                    self._indexes[shard.name] = index
                    self._index_held += index.nbytes
                while self._index_held > self._index_limit and len(self._indexes) > 1:
                    self._index_held -= self._indexes.popitem(last=False)[1].nbytes
        return index

    def reads_check_size(self, name: str) -> bool:
        """Whether each read of the shard checks its size against the manifest's (`Ranged.sized`): then
        nothing asks for it apart."""
        fs, _, _, ranged = self._place(name)
        return not is_local(fs) and ranged.sized

    def size(self, name: str, key: str) -> int:
        """The shard's size in bytes (when reading sample `key`, for messages); a local one is a regular file's."""
        fs, path, url, ranged = self._place(name)
        if not is_local(fs):
            return ranged.size(key)
        try:
            return regular_size(path, url)
        except FileNotFoundError as exc:
            raise ShardError(f"sample {key!r}: shard is missing", url=url) from exc
        except ShardError as exc:
            raise ShardError(f"sample {key!r}: {exc.message}", url=url) from exc

    def read(self, name: str, size: int, sha256: str, start: int, end: int, key: str | None,
             download: bool = True) -> bytes | memoryview:
        """Bytes [start, end) of a shard: a view of the file mapped in memory when it is on local disk
        (in place or in the cache: no copy); with a cache, from its download while it arrives (started
        here if no process of the node runs it; not to `download`: only bytes already there, and the
        download waits for `start_downloads`); else read by range. With a cache, a shard whose object a
        download found to be another (`cache.Mismatch`) is a ShardError from then on."""
        fs, path, url, ranged = self._place(name)
        if self.cache is not None:
            data = self._cached(url, sha256, start, end)
            if data is None:
                self._refuse_mismatched(name, url, sha256, key)
                if download:
                    if (started := self._download(name, size, sha256)) is not None:
                        started.wait(60.0)  # (until its file is there to read from: it starts at once)
                else:
                    self._deferred.setdefault(name, (size, sha256))
                data = self.cache.read_arriving(sha256, start, end, patience=60.0 if download else 0.0)
            if data is None:
                data = self._cached(url, sha256, start, end)  # (finished meanwhile)
            if data is not None:
                return data
            self._refuse_mismatched(name, url, sha256, key)  # (its download may have failed meanwhile)
        elif is_local(fs):
            return _read_mapped(self.mapped, self._verified, name, path, url, size, sha256, start, end, key)
        if self._verified is not None:  # (an archive indexed in place, on object storage under a local dataset)
            raise ShardError(f"sample {key!r}: verify='sha256' checks shards on local disk; this one is on object "
                             "storage (`shard-pack verify` checks it)", url=url)
        return ranged.read(start, end, key, size)

    def _cached(self, url: str, sha256: str, start: int, end: int) -> bytes | memoryview | None:
        """Bytes [start, end) of the shard from the cache (mapped), or None if it is not cached."""
        assert self.cache is not None
        local = self.cache.lookup(url, sha256)
        if local is not None:
            with contextlib.suppress(FileNotFoundError):  # (evicted meanwhile)
                data = self.mapped.read(local, url, start, end)
                if len(data) == end - start:
                    return data
        return None

    def _refuse_mismatched(self, name: str, url: str, sha256: str, key: str | None) -> None:
        """A ShardError if a download found the shard's object to be another than the manifest's."""
        assert self.cache is not None
        found = self._mismatched.get(name) or self.cache.failed(sha256)
        if found is not None:
            raise ShardError(f"sample {key!r}: {found}" if key is not None else found, url=url)

    def start_downloads(self) -> None:
        """Start the downloads of the shards read while not to `download` (the first batch's)."""
        deferred, self._deferred = self._deferred, {}
        for name, (size, sha256) in deferred.items():
            self._download(name, size, sha256)

    def _download(self, name: str, size: int, sha256: str) -> threading.Event | None:
        """Start the shard's download into the cache unless this process runs it already: an event set
        once its file is there for readers (`cache.read_arriving`), or it ended; None while it waits
        for one of the `DOWNLOADS` running (not worth waiting for: read by range meanwhile)."""
        assert self.cache is not None
        cache, (_, _, url, ranged) = self.cache, self._place(name)
        with self._lock:
            running = self._downloads.get(name)
            if running is not None and not running.done():
                return self._started[name] if running.running() else None
            if running is not None and running.exception() is not None:
                failed = running.exception()
                log.log(logging.INFO if isinstance(failed, CacheFull) else logging.WARNING,
                        "%s: caching failed (%s); trying again", url, failed)
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(DOWNLOADS, thread_name_prefix="shardstream-cache")

            busy = sum(not future.done() for future in self._downloads.values())
            started = self._started[name] = threading.Event()
            future = self._pool.submit(cache.fetch, url, size, sha256, ranged.stream, actual_size=ranged.known_size,
                                       started=started.set)
            future.add_done_callback(lambda done: (started.set(), self._settled(name, done)))
            self._downloads[name] = future
            return started if busy < DOWNLOADS else None

    def _settled(self, name: str, future: concurrent.futures.Future[str | None]) -> None:
        exc = None if future.cancelled() else future.exception()
        if isinstance(exc, Mismatch):
            self._mismatched[name] = exc.message

    def settle(self) -> list[Mismatch]:
        """Wait for the background downloads (the end of an epoch). One that failed to download is
        logged, not raised (its samples were read by byte range); those that found another object than
        the shard are returned: samples taken before that was known were not checked against it."""
        with self._lock:
            downloads, self._downloads, self._started = list(self._downloads.items()), {}, {}
        mismatched = []
        for name, future in downloads:
            exc = future.exception()
            if isinstance(exc, Mismatch):
                mismatched.append(exc)
            elif exc is not None:
                log.log(logging.INFO if isinstance(exc, CacheFull) else logging.WARNING, "%s: caching failed: %s",
                        self.places.url(name), exc)
        return mismatched
