"""Local files: memory-mapped under read leases (so a shard cut in place never faults a reader),
read by copy where no lease can be had, pages released once a sample is decoded, and hashed.

Only regular files are read: a dataset's file may be a FIFO (an open or a read would wait
forever), a device (`/dev/zero` never ends) or anything a symlink leads to, so each is checked
(`stat`, then `fstat` of a descriptor opened without blocking) before a byte is read."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import mmap
import os
import signal
import stat
import threading
import weakref

import numpy as np

from pipeline.errors import ShardError
from pipeline.storage.retry import describe

__all__ = ["MappedFiles", "open_regular", "pread", "read_regular", "regular_size", "release_pages", "sha256_file"]

log = logging.getLogger("pipeline.storage")


_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY  # (a FIFO or a device: the open does not wait)


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))
    for test, what in kinds:
        if test(mode):
            return what
    return "not a regular file"


def _refuse(path: str, url: str, mode: int) -> ShardError:
    real = os.path.realpath(path)
    through = f" (a symlink to {real})" if real != os.path.abspath(path) else ""
    return ShardError(f"{path}{through} is {_kind(mode)}, not a regular file: a dataset's shards and index files, "
                      "and archives to index, must be regular files", url=url)


def regular_size(path: str, url: str) -> int:
    """The size of the local file at `path` (following symlinks); a ShardError if it is not a regular file."""
    if not stat.S_ISREG((found := os.stat(path)).st_mode):
        raise _refuse(path, url, found.st_mode)
    return found.st_size


def open_regular(path: str, url: str, size: int | None = None) -> int:
    """A descriptor of the local file at `path` (following symlinks), open for reading, once it is
    checked to be a regular file (of `size` bytes, if given); else a ShardError naming it. Nothing
    else is opened: not a device (an open may act), nor a FIFO (the descriptor is opened without
    blocking, and checked again, should the file have changed in between)."""
    if not stat.S_ISREG(mode := os.stat(path).st_mode):
        raise _refuse(path, url, mode)
    fd = os.open(path, _OPEN)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise _refuse(path, url, found.st_mode)
        if size is not None and found.st_size != size:
            raise ShardError(f"{path} is {found.st_size} bytes, the manifest says {size}", url=url)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, url: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a local regular file (fewer at its end); a ShardError if it is not one."""
    fd = open_regular(path, url)
    try:
        return pread(fd, start, end)
    finally:
        os.close(fd)


def pread(fd: int, start: int, end: int) -> bytes:
    """Bytes [start, end) of an open file (fewer at its end), in reads of at most 1 GiB."""
    parts = []
    while start < end:
        part = os.pread(fd, min(end - start, 1 << 30), start)
        if not part:
            break
        parts.append(part)
        start += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def sha256_file(path: str) -> str:
    """The SHA-256 of a local file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


@dataclasses.dataclass
class _Lease:
    """A local shard mapped under a read lease: our descriptor (to ask about the lease), and the file
    as it was when mapped. `dead` once the mapping is gone (its descriptor is closed at the next check)."""

    url: str
    path: str
    fd: int
    ino: int
    size: int
    dead: bool = False


def _mapping_gone(lease: _Lease) -> None:
    lease.dead = True  # (a finalizer: closing the descriptor here could race with a check reusing its number)


def _read_file(path: str, url: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a local regular file, copied (fewer at its end)."""
    return read_regular(path, url, start, end)


def release_pages(data: bytes | memoryview) -> None:
    """Drop the pages of a sample read from a mapped shard (`ShardReader.read`) from this process's
    resident memory, once it is decoded: they stay in the page cache, and a later read of them
    faults them back in. So a worker's RSS holds what it is decoding, not every shard page it has
    read (64 mapped shards of ~1 GB each would otherwise count in full). Bytes read by copy: nothing."""
    if not isinstance(data, memoryview) or not isinstance(data.obj, mmap.mmap) or not data.nbytes:
        return
    base = np.frombuffer(data.obj, np.uint8).ctypes.data
    start = np.frombuffer(data, np.uint8).ctypes.data - base
    first = start - start % mmap.PAGESIZE
    with contextlib.suppress(OSError, ValueError):  # (a mapping closed meanwhile: nothing to drop)
        data.obj.madvise(mmap.MADV_DONTNEED, first, start + data.nbytes - first)



class MappedFiles:
    """A process's local shards, each memory-mapped under a read lease (Linux `F_SETLEASE`): a
    process that opens a mapped shard for writing or truncates it must wait until the mapping is
    gone (at most /proc/sys/fs/lease-break-time, 45 s by default), and `check_leases`, called before
    each batch, names that shard. So a shard cut in place never faults a reader (SIGBUS, which
    would kill the process). Where no lease can be had (not the file's owner and no CAP_LEASE, a
    filesystem without leases, a file open for writing), files are read by copy instead."""

    def __init__(self, root: str) -> None:
        self.root = root  # (for messages)
        self._lock = threading.Lock()
        self._maps: collections.OrderedDict[tuple[str, int, int], memoryview] = collections.OrderedDict()
        self._leases: dict[int, _Lease] = {}  # by descriptor: mapped shards, while any view of them lives
        self._copied = False  # a local shard was read by copy (no lease): said once in the log

    def read(self, path: str, url: str, start: int, end: int) -> bytes | memoryview:
        """Bytes [start, end) of a local file (fewer at its end): a view of its mapping, or a copy
        where it cannot be mapped under a lease."""
        view = self._mapped(path, url)
        if view is not None:
            return view[start:end]
        return _read_file(path, url, start, end)

    def _mapped(self, path: str, url: str) -> memoryview | None:
        """The file at `path` mapped read-only under a read lease, kept for later reads (the newest 64
        files; a file replaced since, by rename, is mapped anew); None where no lease can be had. A
        ShardError if it is not a regular file."""
        found = os.stat(path)
        where = (path, found.st_ino, found.st_size)
        with self._lock:
            view = self._maps.get(where)
            if view is not None:
                self._maps.move_to_end(where)
                return view
        if not stat.S_ISREG(found.st_mode):
            raise _refuse(path, url, found.st_mode)
        if not found.st_size:
            return memoryview(b"")
        fd = open_regular(path, url)
        try:
            # A lease break signals the holder (SIGIO by default, which would end the process); SIGURG
            # is ignored unless handled. `check_leases` asks about the lease instead.
            fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except (OSError, AttributeError) as exc:  # (AttributeError: not Linux)
            os.close(fd)
            level = logging.DEBUG if self._copied else logging.WARNING
            self._copied = True
            log.log(level, "%s: no read lease on local shard %s (%s): local shards are read by copy instead of "
                    "memory-mapped (slower for embeddings)", self.root, path, describe(exc))
            return None
        try:
            leased = os.fstat(fd)  # (the file leased: what `path` named when stat'ed above, or its replacement)
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            raise
        lease = _Lease(url, path, fd, leased.st_ino, leased.st_size)
        weakref.finalize(mapping, _mapping_gone, lease)
        view = memoryview(mapping)
        with self._lock:
            self._leases[fd] = lease
            self._maps[(path, leased.st_ino, leased.st_size)] = view
            while len(self._maps) > 64:
                self._maps.popitem(last=False)  # (unmapped once the samples read from it are dropped)
        return view

    def check_leases(self) -> list[tuple[str, str]]:
        """(url, what changed) of each mapped shard that another process has opened for writing or is
        truncating (it waits for our mapping to go), or whose lease ran out; empty if none.

        Call it before each batch, in the thread that uses the mapped samples. A shard named here is
        forgotten: drop every sample read from it, then its mapping goes and the writer goes on."""
        problems = []
        with self._lock:
            for fd, lease in list(self._leases.items()):
                if lease.dead:  # (mapping gone: closing the last descriptor lets go of the lease)
                    del self._leases[fd]
                    os.close(fd)
                    continue
                try:
                    held = fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK
                except OSError:
                    held = False
                if held:
                    continue
                now = os.fstat(fd).st_size
                change = f"it was {lease.size} bytes when mapped, {now} now" if now != lease.size else \
                    "another process opened it for writing or is truncating it"
                problems.append((lease.url, f"shard rewritten in place while the loader reads it ({change}); replace "
                                 "shards by rename (as shard-pack does), never in place"))
                for where in [w for w in self._maps if w[:3] == (lease.path, lease.ino, lease.size)]:
                    del self._maps[where]
                del self._leases[fd]
                os.close(fd)  # (the mapping keeps the lease until it goes)
        return problems
