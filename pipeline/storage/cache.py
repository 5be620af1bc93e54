"""The shard cache: whole remote shards kept on a node's local disk, shared by its processes."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from pipeline.errors import ShardError
from pipeline.storage.fs import write_bytes
from pipeline.storage.local import sha256_file

__all__ = ["CacheFull", "ShardCache"]

log = logging.getLogger("pipeline.storage")


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock between processes (and threads) of this node, held while in the block. Its
    holder removes the lock file before letting go; a waiter that got the lock of a removed file
    tries again on whatever file is there now."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)  # releases the lock


class CacheFull(Exception):
    """No room in the cache for one more shard: downloads in progress hold the rest."""


def _reserve(path: str, size: int) -> int:
    """A new file at `path` taking `size` bytes of disk (a sparse file where the filesystem cannot
    allocate ahead), locked while open; its descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # (marks the download live: see ShardCache._room)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


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
    removed by their holders."""

    def __init__(self, directory: str, limit: int) -> None:
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"cache_limit must be a positive number of bytes, got {limit!r}")
        os.makedirs(directory, exist_ok=True)
        self.directory, self.limit = directory, limit

    def lookup(self, url: str, sha256: str) -> str | None:
        """The local path of the shard if it is cached and intact (else None); marks it used."""
        path = os.path.join(self.directory, f"{sha256}.tar")
        try:
            stat = os.stat(path)
            os.utime(path, ns=(time.time_ns(), stat.st_mtime_ns))  # atime = last use; mtime = last write
            stamp = f"{stat.st_ino} {stat.st_size} {stat.st_mtime_ns}"
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
        self._remove(path)
        return None

    def fetch(self, url: str, size: int, sha256: str, fetch: Callable[[Any], None]) -> str:
        """The local path of the shard, downloading it (`fetch(file)` writes all its bytes) if needed."""
        path = os.path.join(self.directory, f"{sha256}.tar")
        with _locked(path + ".lock"):
            if (found := self.lookup(url, sha256)) is not None:  # another process fetched it meanwhile
                return found
            for debris in glob.glob(glob.escape(path) + ".partial-*"):  # of a killed download (we hold the lock)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(debris)
            partial = f"{path}.partial-{uuid.uuid4().hex}"
            fd = self._room(partial, size, url)
            try:
                with os.fdopen(os.dup(fd), "r+b") as f:
                    fetch(f)
                    if f.tell() != size:
                        raise ShardError(url, f"download gave {f.tell()} bytes, the manifest says {size}")
                digest = sha256_file(partial)
                if digest != sha256:
                    raise ShardError(url, f"downloaded shard has SHA-256 {digest}, the manifest says {sha256}")
                with self.locked():  # (one that makes room would miss it between its listing and its count)
                    os.replace(partial, path)  # (the reserved bytes become the shard's)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
                os.close(fd)
        log.debug("cached %s as %s", url, path)
        return self.lookup(url, sha256) or path

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
            try:
                fd = self._room(partial, len(data), path)
            except CacheFull:
                return data
            try:
                os.pwrite(fd, data, 0)
                with self.locked():
                    os.replace(partial, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
                os.close(fd)
        return data

    def _remove(self, path: str) -> None:
        for name in (path, path + ".ok"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)  # a reader holding it open keeps reading it

    def locked(self) -> contextlib.AbstractContextManager[None]:
        """The cache's lock: while it is held, the shards and downloads in the directory do not
        change, but for removals (reservations, evictions and downloads renamed into place take it)."""
        return _locked(os.path.join(self.directory, ".cache.lock"))

    def _room(self, partial: str, size: int, url: str) -> int:
        """Reserve `size` bytes for a download to `partial` (see the class): its descriptor, locked
        until closed. Raises CacheFull if the downloads in progress leave no room."""
        with self.locked():
            entries, downloading = [], 0
            for name in os.listdir(self.directory):
                where = os.path.join(self.directory, name)
                with contextlib.suppress(FileNotFoundError):
                    if name.endswith((".tar", ".idx", ".json")):
                        stat = os.stat(where)
                        entries.append((stat.st_atime_ns, name, stat.st_size))
                    elif any(f"{ext}.partial-" in name for ext in (".tar", ".idx", ".json")):  # (not .ok stamps')
                        downloading += self._live_download(where)
            held = downloading + sum(e[2] for e in entries)
            for _, name, bytes_ in sorted(entries):
                if held + size <= self.limit:
                    break
                self._remove(os.path.join(self.directory, name))
                held -= bytes_
                log.debug("evicted %s (%d bytes) from the cache", name, bytes_)
            if held + size > self.limit:
                raise CacheFull(f"{url}: not cached this time: downloads in progress hold {downloading} of the "
                                 f"cache's {self.limit} bytes")
            return _reserve(partial, size)

    @staticmethod
    def _live_download(path: str) -> int:
        """The bytes a download in progress holds; a killed process's (its lock is free) is removed."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return os.fstat(fd).st_size
            os.unlink(path)
            log.debug("removed %s, the download of a process that ended", path)
            return 0
        finally:
            os.close(fd)

