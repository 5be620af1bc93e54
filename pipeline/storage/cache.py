"""The shard cache: whole remote shards kept on a node's local disk, shared by its processes."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import NoReturn

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from pipeline.errors import ConfigError, ShardError
import pipeline.storage.locks as locks
from pipeline.storage.fs import write_bytes
from pipeline.storage.local import pread, sha256_file

__all__ = ["CacheFull", "Mismatch", "ShardCache"]

log = logging.getLogger("pipeline.storage")


@contextlib.contextmanager
def _locked(path: str, wait: bool = True) -> Iterator[bool]:
    """An exclusive lock between processes (and threads) of this node, held while in the block (which
    is given whether it holds it: always, when it may `wait`). Its holder removes the lock file before
    letting go; a waiter that got the lock of a removed file tries again on whatever file is there now.
    A process forked while it is held does not hold it (`locks`)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if not locks.lock(fd, wait=wait):
                os.close(fd)
                yield False
                return
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
        except BaseException:
            locks.close(fd)
            raise
        locks.close(fd)
    try:
        yield True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        locks.close(fd)  # releases the lock


_ARRIVED = ".arrived"  # beside a download in progress: how many of its bytes have arrived (int64; they come in order)
_STREAMED = "stream"  # the name of the download in progress (`.partial-stream`), where readers find it


def _arrived(path: str) -> int | None:
    """How many bytes of the shard's download (the shard's `path`) have arrived; None once it ended."""
    try:
        with open(path + _ARRIVED, "rb") as f:
            count = np.frombuffer(f.read(), np.int64)
    except FileNotFoundError:  # (finished, or failed: the caller looks it up)
        return None
    return int(count[0]) if len(count) == 1 else 0


def _download_file(path: str, deadline: float) -> int | None:
    """The file of the shard's download (the shard's `path`), open for reading; None if no download of it
    runs. A download whose lock is taken but whose file is not made yet (a process of the node about to
    start it, or finding it cached) is waited for until `deadline`: not to read its bytes by range meanwhile."""
    pause = 0.001
    while True:
        try:
            return os.open(f"{path}.partial-{_STREAMED}", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not os.path.exists(path + ".lock") or os.path.exists(path) or time.monotonic() > deadline:
                return None
        time.sleep(pause)
        pause = min(2 * pause, 0.02)


def _live(fd: int) -> bool:
    """Whether the download whose file is open at `fd` is still running (its writer holds the lock)."""
    if not locks.lock(fd, shared=True, wait=False):
        return True
    locks.unlock(fd)
    return False


def _stream_into(url: str, fd: int, arrived: int, size: int, chunks: Iterator[bytes | memoryview]) -> str:
    """Write a shard's bytes into its reserved file `fd` as they come, in order, publishing after each
    chunk how many have arrived (in the `.arrived` file open at `arrived`); their SHA-256, computed as
    they come (never read back)."""
    digest, at = hashlib.sha256(), 0
    for chunk in chunks:
        if at + len(chunk) > size:
            raise ShardError(f"download: bytes 0-{size} gave more than {size} bytes", url=url)
        os.pwrite(fd, chunk, at)
        digest.update(chunk)
        at += len(chunk)
        os.pwrite(arrived, np.int64(at).tobytes(), 0)
    if at != size:
        raise ShardError(f"download: bytes 0-{size} gave {at} bytes", url=url)
    return digest.hexdigest()


class CacheFull(Exception):
    """No room in the cache for one more shard: downloads in progress hold the rest."""


class Mismatch(ShardError):
    """The object is not the shard the manifest describes (another size, another SHA-256): an error
    for each of its samples, not a reason to read it another way."""


def _create(path: str) -> int:
    """A new empty file at `path`, locked while open (which marks the download live: see
    `_make_room`; let go by `locks.close`); its descriptor. It is made under another name and
    appears at `path` locked: a reader finding it unlocked takes it for a dead download's (`_live`).
    Call it under the cache's lock: `_make_room` would take the unlocked file for a dead one's."""
    made = f"{path}-{uuid.uuid4().hex}"  # (a `.partial-` name: removed as a dead download's if left)
    fd = os.open(made, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        locks.lock(fd)
        os.rename(made, path)
    except BaseException:
        locks.close(fd)
        os.unlink(made)
        raise
    return fd


def _allocate(fd: int, size: int) -> None:
    """Make the file open at `fd` take `size` bytes of disk (a sparse file where the filesystem cannot
    allocate ahead)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


class ShardCache:
    """Whole shards kept on local disk under `directory`, at most `limit` bytes of them.

    Files are named by their SHA-256 (from the manifest), so a shard rewritten upstream is a new
    entry and nothing stale is ever read. A shard is downloaded by one process at a time (a lock
    per shard), under a temporary name, checked against its SHA-256 and renamed into place: a
    partial download is never read. A check is recorded beside the file (`.ok`: inode, size,
    mtime); a file changed since its check is checked again and, if corrupt, fetched again. Every
    use stamps a file's access time. Safe for several workers and processes of one node sharing
    the directory.

    Space is reserved before a download: under the cache's lock, the least recently used shards
    are removed until the finished shards, the downloads in progress (each made at its full size
    when it starts) and the new one fit in `limit`; with no room left beside other downloads, the
    shard is not cached this time (its samples are read by range). So the shards and downloads in
    the directory never exceed `limit`. Beyond it: the `.ok` stamps (~60 bytes a shard), and a
    removed shard that a reader still has open keeps its disk blocks until that reader lets go.
    A download of a killed process is removed by the next one that needs room; lock files are
    removed by their holders.

    A download is trusted only once checked: the object's size is asked for before any space is
    reserved, and a size or a SHA-256 other than the manifest's is a `Mismatch`, recorded beside
    the shard (`<sha256>.bad`, read by `failed`) so that no process of the node reads that object
    for the shard again (nothing is evicted for it). Remove the record once the object is restored."""

    def __init__(self, directory: str, limit: int) -> None:
        if not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"cache_limit must be a positive number of bytes, got {limit!r}")
        os.makedirs(directory, exist_ok=True)
        self.directory, self.limit = directory, limit

    def holds(self, sha256: str) -> bool:
        """Whether the shard is cached (checked when it was stored; `lookup` checks it again if changed)."""
        return os.path.exists(os.path.join(self.directory, f"{sha256}.tar"))

    def lookup(self, url: str, sha256: str) -> str | None:
        """The local path of the shard if it is cached and intact (else None); marks it used."""
        path = os.path.join(self.directory, f"{sha256}.tar")
        try:
            stat = os.stat(path)
            os.utime(path, ns=(time.time_ns(), stat.st_mtime_ns))  # atime = last use; mtime = last write
            stamp = _stamp(stat)
            with contextlib.suppress(FileNotFoundError), open(path + ".ok") as f:
                if f.read() == stamp:
                    return path
            digest = sha256_file(path)
        except FileNotFoundError:  # not cached, or removed meanwhile (evicted, or found corrupt by another reader)
            return None
        if digest == sha256:
            write_bytes(LocalFileSystem(), path + ".ok", stamp.encode())
            return path
        log.warning("%s: cached copy %s has SHA-256 %s, not %s; fetching it again", url, path, digest, sha256)
        _remove(path)
        return None

    def fetch(self, url: str, size: int, sha256: str, read: Callable[[int, int], Iterator[bytes | memoryview]], *,
              actual_size: Callable[[], int] | None = None, started: Callable[[], None] = lambda: None) -> str | None:
        """The local path of the shard, downloading it if needed (None if another process is downloading
        it): `read(start, end)` yields the bytes [start, end) in order. A shard is one `read`, whatever its
        size (one streamed request: the node's requests for a shard are its index and this), its bytes
        written in the order they come, so that a reader of its start never waits for its end. The
        node's downloads run several shards at once (`reader.DOWNLOADS` a process), not pieces of one.
        While it arrives, readers in any process take the bytes already there (`read_arriving`), and
        its SHA-256 is computed as its bytes arrive. `actual_size()`: the object's size, asked for once the
        first request is answered (an answer may say it: `Ranged.known_size`) and before any space is
        reserved. `started()` is called once the download's file is there for readers (before its first
        request). A `Mismatch` (recorded: see the class) if the object is not the shard."""
        path = os.path.join(self.directory, f"{sha256}.tar")
        with _locked(path + ".lock", wait=False) as mine:
            if not mine:  # (another process downloads it: readers take its bytes as they arrive)
                return None
            if (found := self.lookup(url, sha256)) is not None:  # another process fetched it meanwhile
                return found
            if (failed := self.failed(sha256)) is not None:
                raise Mismatch(failed, url=url)
            for debris in [*glob.glob(glob.escape(path) + ".partial-*"), path + _ARRIVED]:  # (we hold the lock)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(debris)
            arrived = os.open(path + _ARRIVED, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            partial, fd = f"{path}.partial-{_STREAMED}", None
            try:
                os.pwrite(arrived, np.int64(0).tobytes(), 0)
                with self.locked():  # (empty until its size is known; readers wait on it from now: `read_arriving`)
                    fd = _create(partial)
                started()
                stream, arriving, failed = read(0, size) if size else iter(()), [], None
                try:
                    arriving = list(itertools.islice(stream, 1))  # (the first request: its answer may say the size)
                except ShardError as exc:  # (a range past a shortened object's end: the size says why)
                    failed = exc
                if actual_size is not None and (actual := actual_size()) != size:
                    self._mismatch(url, sha256, f"the object is {actual} bytes, the manifest says {size}")
                if failed is not None:
                    raise failed
                _make_room(self, fd, size, url)
                digest = _stream_into(url, fd, arrived, size, itertools.chain(arriving, stream))
                if digest != sha256:  # (recorded before the download's files go: its readers then see it)
                    self._mismatch(url, sha256, f"downloaded shard has SHA-256 {digest}, the manifest says {sha256}")
                # Checked: its stamp, so that `lookup` need not hash it again (a rename keeps inode and mtime).
                write_bytes(LocalFileSystem(), path + ".ok", _stamp(os.fstat(fd)).encode())
                with self.locked():  # (one that makes room would miss it between its listing and its count)
                    os.replace(partial, path)  # (the reserved bytes become the shard's)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
                if fd is not None:
                    locks.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path + _ARRIVED)
                os.close(arrived)
        log.debug("cached %s as %s", url, path)
        return self.lookup(url, sha256) or path

    def failed(self, sha256: str) -> str | None:
        """Why the object read for this shard is not the shard, if a download found so (`Mismatch`)."""
        with contextlib.suppress(FileNotFoundError), open(os.path.join(self.directory, f"{sha256}.bad")) as f:
            return f.read()
        return None

    def _mismatch(self, url: str, sha256: str, what: str) -> NoReturn:
        """Record that the object is not the shard, then raise the Mismatch."""
        record = os.path.join(self.directory, f"{sha256}.bad")
        message = (f"{what}: the object is not the shard the manifest describes; it is not read for this shard again "
                   f"(remove {record} once the object is restored)")
        write_bytes(LocalFileSystem(), record, message.encode())
        raise Mismatch(message, url=url)

    def read_arriving(self, sha256: str, start: int, end: int, patience: float = 60.0) -> bytes | None:
        """Bytes [start, end) of a shard being downloaded (by any process sharing the cache), once they
        have arrived; None if no download of it is running, or it ends or stalls (`patience` seconds
        without the bytes): then look it up, or read it by range."""
        path = os.path.join(self.directory, f"{sha256}.tar")
        deadline = time.monotonic() + patience
        fd = _download_file(path, deadline)
        if fd is None:
            return None
        try:
            pause = 0.001
            while True:
                arrived = _arrived(path)
                if arrived is None:
                    return None
                if arrived >= end:
                    data = pread(fd, start, end)
                    return data if len(data) == end - start else None
                if not _live(fd) or time.monotonic() > deadline:
                    return None
                time.sleep(pause)
                pause = min(2 * pause, 0.02)
        finally:
            os.close(fd)

    def small(self, name: str, sha256: str | None, fetch: Callable[[], bytes]) -> bytes:
        """A small file (a shard index, a manifest) kept whole under `name`: read from the cache if
        present (and, given its SHA-256, intact), else fetched, written atomically and counted in the limit."""
        path = os.path.join(self.directory, name)
        with contextlib.suppress(FileNotFoundError):
            with open(path, "rb") as f:
                data = f.read()
            if sha256 is None or hashlib.sha256(data).hexdigest() == sha256:
                os.utime(path)
                return data
        with _locked(path + ".lock"):
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:  # fetched by another process meanwhile
                data = f.read()
                if sha256 is None or hashlib.sha256(data).hexdigest() == sha256:
                    return data
            data = fetch()
            if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
                return data  # (not kept: the caller names the problem)
            partial = f"{path}.partial-{uuid.uuid4().hex}"
            with self.locked():
                fd = _create(partial)
            try:
                try:
                    _make_room(self, fd, len(data), path)
                except CacheFull:
                    return data
                os.pwrite(fd, data, 0)
                with self.locked():
                    os.replace(partial, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
                locks.close(fd)
        return data

    def locked(self) -> contextlib.AbstractContextManager[None]:
        """The cache's lock: while it is held, the shards and downloads in the directory do not
        change, but for removals (reservations, evictions and downloads renamed into place take it)."""
        return _locked(os.path.join(self.directory, ".cache.lock"))


def _stamp(stat: os.stat_result) -> str:
    """What a cached file's `.ok` record holds: the file as it was when its SHA-256 was checked."""
    return f"{stat.st_ino} {stat.st_size} {stat.st_mtime_ns}"


def _remove(path: str) -> None:
    """Remove a cached file and its check stamp (a reader holding it open keeps reading it)."""
    for name in (path, path + ".ok"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _make_room(cache: ShardCache, fd: int, size: int, url: str) -> None:
    """Reserve `size` bytes for the download open at `fd` (see `ShardCache`), evicting the least
    recently used shards. Raises CacheFull if the downloads in progress leave no room."""
    with cache.locked():
        entries, downloading = [], 0
        for name in os.listdir(cache.directory):
            where = os.path.join(cache.directory, name)
            with contextlib.suppress(FileNotFoundError):
                if name.endswith((".tar", ".idx", ".json")):
                    stat = os.stat(where)
                    entries.append((stat.st_atime_ns, name, stat.st_size))
                elif any(f"{ext}.partial-" in name for ext in (".tar", ".idx", ".json")):  # (not .ok stamps')
                    downloading += _live_download(where)
        held = downloading + sum(e[2] for e in entries)
        for _, name, bytes_ in sorted(entries):
            if held + size <= cache.limit:
                break
            _remove(os.path.join(cache.directory, name))
            held -= bytes_
            log.debug("evicted %s (%d bytes) from the cache", name, bytes_)
        if held + size > cache.limit:
            raise CacheFull(f"{url}: not cached this time: downloads in progress hold {downloading} of the "
                            f"cache's {cache.limit} bytes")
        _allocate(fd, size)


def _live_download(path: str) -> int:
    """The bytes a download in progress holds; a killed process's (its lock is free) is removed."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if not locks.lock(fd, wait=False):
            return os.fstat(fd).st_size
        os.unlink(path)
        log.debug("removed %s, the download of a process that ended", path)
        return 0
    finally:
        locks.close(fd)
