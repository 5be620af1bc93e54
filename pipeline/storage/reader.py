"""The reader of a dataset's shards: one way of reading per shard (`Way`: a mapped local file, the
shard cache, ranged reads), chosen once; and the shard indexes."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol

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

__all__ = ["DOWNLOADS", "PATIENCE", "Cached", "Downloads", "Mapped", "ShardReader", "Way"]

log = logging.getLogger("pipeline.storage")
DOWNLOADS = 8  # shards a process downloads into the cache at once
PATIENCE = 60.0  # seconds a read waits for its shard's download to start, then for its bytes, before reading by range


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


class Way(Protocol):
    """One way of reading one shard's bytes, chosen once per shard (`ShardReader.way`). Errors are
    ShardErrors naming the shard's URL; the read stage adds the sample (`errors.about_sample`)."""

    url: str

    def read(self, start: int, end: int) -> bytes | memoryview:
        """Bytes [start, end) of the shard."""

    def size(self) -> int:
        """The shard's size in bytes now."""

    def checks_size(self) -> bool:
        """Whether each `read` checks the shard's size against the manifest's (then nothing asks it apart)."""


@dataclasses.dataclass
class Mapped:
    """A shard on local disk, read as views of the file mapped in memory (no copy), its SHA-256
    checked first where `verified`."""

    files: MappedFiles
    path: str
    url: str
    shard: ShardInfo
    verified: _Hashed | None

    def read(self, start: int, end: int) -> memoryview:
        try:
            if self.verified is not None:
                self.verified.check(self.shard.name, self.path, self.url, self.shard.sha256, self.shard.bytes)
            data = self.files.read(self.path, self.url, start, end)
        except FileNotFoundError as exc:
            raise ShardError("shard is missing", url=self.url) from exc
        except (OSError, ValueError) as exc:
            raise ShardError(f"cannot read the shard: {describe(exc)}", url=self.url) from exc
        if len(data) < end - start:
            actual: int | str = "now fewer"
            with contextlib.suppress(OSError):
                actual = os.stat(self.path).st_size
            raise ShardError(f"shard is {actual} bytes, shorter than the sample's range ({start}-{end})", url=self.url)
        return data

    def size(self) -> int:
        try:
            return regular_size(self.path, self.url)
        except FileNotFoundError as exc:
            raise ShardError("shard is missing", url=self.url) from exc

    def checks_size(self) -> bool:
        return False


@dataclasses.dataclass
class Cached:
    """A shard on object storage through the node's shard cache: from its cached copy (mapped), else
    from its download while it arrives (started here if no process of the node runs it, and waited
    for while it waits its turn; while the reader's downloads are held, only bytes already there),
    else by range: the node's requests for a shard are its download, not a span per worker. A shard
    whose download found another object than the manifest's (`cache.Mismatch`) is a ShardError from
    then on."""

    downloads: Downloads
    ranged: Ranged
    shard: ShardInfo

    @property
    def url(self) -> str:
        return self.ranged.url

    def read(self, start: int, end: int) -> bytes | memoryview:
        downloads, shard = self.downloads, self.shard
        data = downloads.cached(self.url, shard.sha256, start, end)
        if data is None:
            downloads.refuse_mismatched(shard, self.url)
            started = downloads.start(shard, self.ranged)
            patience = 0.0 if downloads.held else PATIENCE
            # (this process's download not begun before the look: if it begins during it, looked for again)
            pending = started if started is not None and not started.is_set() else None
            # (from a download running in any process of the node: this one's, or another's while this
            # one's waits its turn; else, once this one's file is there: at once, or when its turn comes)
            data = downloads.cache.read_arriving(shard.sha256, start, end, patience=patience)
            if data is None and pending is not None and pending.wait(PATIENCE):
                data = downloads.cache.read_arriving(shard.sha256, start, end, patience=patience)
            if data is None:
                data = downloads.cached(self.url, shard.sha256, start, end)  # (finished meanwhile)
        if data is not None:
            return data
        downloads.refuse_mismatched(shard, self.url)  # (its download may have failed meanwhile)
        return self.ranged.read(start, end)

    def size(self) -> int:
        return self.ranged.size()

    def checks_size(self) -> bool:
        return self.ranged.checks_size() or self.downloads.cache.holds(self.shard.sha256)


class Downloads:
    """A process's downloads of shards into the node's cache: `DOWNLOADS` at a time, one per shard
    in the node (whichever process starts it first); `held`: new ones wait for `start_held`."""

    def __init__(self, cache: ShardCache, mapped: MappedFiles) -> None:
        self.cache, self.mapped = cache, mapped
        self.held = False
        self._running: dict[str, tuple[str, concurrent.futures.Future[str | None]]] = {}  # name -> (URL, download)
        self._started: dict[str, threading.Event] = {}  # set once a download's file is there, or it ended
        self._waiting: dict[str, tuple[ShardInfo, Ranged]] = {}  # asked for while held
        self._mismatched: dict[str, str] = {}  # shard name -> why its object is not the shard
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def cached(self, url: str, sha256: str, start: int, end: int) -> bytes | memoryview | None:
        """Bytes [start, end) of the shard from the cache (mapped), or None if it is not cached."""
        local = self.cache.lookup(url, sha256)
        if local is not None:
            with contextlib.suppress(FileNotFoundError):  # (evicted meanwhile)
                data = self.mapped.read(local, url, start, end)
                if len(data) == end - start:
                    return data
        return None

    def refuse_mismatched(self, shard: ShardInfo, url: str) -> None:
        """A ShardError if a download found the shard's object to be another than the manifest's."""
        found = self._mismatched.get(shard.name) or self.cache.failed(shard.sha256)
        if found is not None:
            raise ShardError(found, url=url)

    def start_held(self) -> None:
        """Downloads no longer held: those asked for meanwhile start."""
        self.held = False
        waiting, self._waiting = self._waiting, {}
        for shard, ranged in waiting.values():
            self.start(shard, ranged)

    def start(self, shard: ShardInfo, ranged: Ranged) -> threading.Event | None:
        """Start the shard's download into the cache unless this process runs it already: an event set
        once its file is there for readers (`cache.read_arriving`), or it ended; None while held. A
        download waiting for one of the `DOWNLOADS` running is waited for too (it was read by range
        meanwhile: a request per span of each worker, what the node's one download is there to save)."""
        name = shard.name
        with self._lock:
            if self.held:
                self._waiting.setdefault(name, (shard, ranged))
                return None
            url, running = self._running.get(name, (ranged.url, None))
            if running is not None and not running.done():
                return self._started[name]
            if running is not None and running.exception() is not None:
                failed = running.exception()
                log.log(logging.INFO if isinstance(failed, CacheFull) else logging.WARNING,
                        "%s: caching failed (%s); trying again", ranged.url, failed)
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(DOWNLOADS, thread_name_prefix="shardstream-cache")
            busy = sum(not future.done() for _, future in self._running.values())
            started = self._started[name] = threading.Event()
            future = self._pool.submit(self.cache.fetch, ranged.url, shard.bytes, shard.sha256, ranged.stream,
                                       actual_size=ranged.known_size, started=started.set)
            future.add_done_callback(lambda done: (started.set(), self._settled(name, done)))
            self._running[name] = (url, future)
            if busy >= DOWNLOADS:
                log.debug("%s: download waits for one of the %d running", ranged.url, busy)
            return started

    def _settled(self, name: str, future: concurrent.futures.Future[str | None]) -> None:
        exc = None if future.cancelled() else future.exception()
        if isinstance(exc, Mismatch):
            self._mismatched[name] = exc.message

    def settle(self) -> list[Mismatch]:
        """Wait for the downloads (the end of an epoch). One that failed is logged, not raised (its
        samples were read by byte range); those that found another object than the shard are
        returned: samples taken before that was known were not checked against it."""
        self.start_held()
        with self._lock:
            running, self._running, self._started = list(self._running.values()), {}, {}
        mismatched = []
        for url, future in running:
            exc = future.exception()
            if isinstance(exc, Mismatch):
                mismatched.append(exc)
            elif exc is not None:
                log.log(logging.INFO if isinstance(exc, CacheFull) else logging.WARNING, "%s: caching failed: %s",
                        url, exc)
        return mismatched


class ShardReader:
    """Reads one dataset's shards (and their indexes), each in the way that fits it (`way`):
    mapped local files, the shard cache, or ranged reads from object storage, with retries.

    With a cache, a shard not cached yet is downloaded whole in the background, by one process of
    the node, and its samples are taken from the download as they arrive (in any process): no
    sample waits for a whole shard, and a shard's bytes cross the network once per node. Build it
    in the process that reads (a DataLoader worker).

    Names resolve inside the dataset's folder, or under `allowed_roots` (`places.Places`)."""

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
        self.mapped = MappedFiles(root)  # local shards, in place or cached
        # (local shards are read in place)
        self.downloads = Downloads(cache, self.mapped) if cache is not None and not is_local(self.fs) else None
        self._indexes: collections.OrderedDict[str, ShardIndex] = collections.OrderedDict()
        self._index_limit, self._index_held = index_bytes, 0
        self._lock = threading.Lock()
        self._verified = None if verified is None else _Hashed(*verified)
        self._storage_options = storage_options
        self._ways: dict[str, Way] = {}
        self._client: tuple[Any, str] | None = None  # (ranged client, path) of the dataset's folder

    def way(self, shard: ShardInfo) -> Way:
        """How to read the shard, chosen when first asked for and kept: where the dataset's folder or
        its absolute name says, inside an allowed root (an archive indexed in place: another bucket,
        or object storage under a local dataset); a local file by its real path, checked
        (`Places.real`). A ShardError for a name outside them."""
        found = self._ways.get(shard.name)
        if found is not None:
            return found
        url = self.places.url(shard.name)
        fs, path = (self.fs, join(self.base, shard.name)) if url == join(self.root, shard.name) else \
            filesystem(url, self._storage_options)
        way: Way
        if is_local(fs):
            way = Mapped(self.mapped, self.places.real(path, url), url, shard, self._verified)
        elif self._verified is not None:  # (an archive indexed in place, on object storage under a local dataset)
            raise ShardError("verify='sha256' checks shards on local disk; this one is on object storage "
                             "(`shard-pack verify` checks it)", url=url)
        else:
            ranged = dataclasses.replace(ranged_reader(url, self._storage_options, self.retry), expected=shard.bytes)
            way = ranged if self.downloads is None else Cached(self.downloads, ranged, shard)
        return self._ways.setdefault(shard.name, way)

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
        cache = None if self.downloads is None else self.downloads.cache
        index = read_index(*self._client, self.root, shard, self.retry, cache, self.places)  # type: ignore[arg-type]
        if shard.index is not None:
            with self._lock:
                if shard.name not in self._indexes:
                    self._indexes[shard.name] = index
                    self._index_held += index.nbytes
                while self._index_held > self._index_limit and len(self._indexes) > 1:
                    self._index_held -= self._indexes.popitem(last=False)[1].nbytes
        return index
