"""All reads and writes of datasets go through here: fsspec filesystems (local paths and URLs
alike), one layer of retries, and the opt-in local shard cache.

Retries live in one place. For `s3://`, botocore's and s3fs's own retry loops are turned off
(they multiply: 5 x 5 tries by default) unless the caller sets them, so `Retry` alone decides how
often a request is tried: transient failures (HTTP 5xx / SlowDown, connection reset, truncated
body, timeout) back off exponentially with jitter, and a long range read resumes from the last
whole piece it reached. A failure that is not transient (missing object, bad credentials) fails at once.

Filesystems are made in the process that uses them (`ShardReader` is built inside each DataLoader
worker): s3fs is not fork-safe.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import functools
import glob
import hashlib
import json
import logging
import mmap
import os
import posixpath
import random
import signal
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import fsspec
import numpy as np
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from pipeline.errors import ManifestError, ShardError, ShardIndexError
from pipeline.format import MANIFEST_NAME, MAX_INDEX_BYTES, Manifest, ShardIndex, ShardInfo

__all__ = [
    "MAX_MANIFEST_BYTES", "PIECE_BYTES", "Retry", "ShardCache", "ShardReader", "join", "filesystem", "is_local", "read_manifest",
    "read_index", "release_pages", "shard_url", "read_range", "shard_indexes", "sha256_file", "with_retries", "write_bytes",
]

log = logging.getLogger(__name__)
MAX_MANIFEST_BYTES = 4 << 30  # SA-1B's 11M samples need ~0.3 GB
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
_TRANSPORT_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "http")
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Retry:
    """How transient storage failures are retried: up to `attempts` tries of each request, waiting
    `initial_delay * 2**n` (at most `max_delay`) times a random factor in [0.5, 1.5) between tries."""

    attempts: int = 6
    initial_delay: float = 0.2
    max_delay: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts must be an int >= 1, got {self.attempts!r}")
        if not (0 <= self.initial_delay <= self.max_delay):
            raise ValueError(f"need 0 <= initial_delay <= max_delay, got {self.initial_delay}, {self.max_delay}")

    def delay(self, failures: int) -> float:
        return min(self.max_delay, self.initial_delay * 2 ** (failures - 1)) * random.uniform(0.5, 1.5)


def transient(exc: BaseException) -> bool:
    """Whether a storage failure may go away if tried again."""
    if isinstance(exc, _PERMANENT):
        return False
    status = getattr(exc, "status", None)  # aiohttp / http responses
    if isinstance(status, int):
        return status >= 500 or status == 429
    return isinstance(exc, (OSError, TimeoutError, _Truncated)) or type(exc).__module__.split(".")[0] in _TRANSPORT_MODULES


class _Truncated(Exception):
    """A read returned fewer bytes than asked for (a body cut short)."""


def with_retries(retry: Retry, what: str, call: Callable[[], T]) -> T:
    """`call()`, tried again on transient failures; the last failure propagates (with a note)."""
    for attempt in range(1, retry.attempts + 1):
        try:
            return call()
        except Exception as exc:
            if not transient(exc) or attempt == retry.attempts:
                if attempt > 1:
                    exc.add_note(f"{what}: failed {attempt} times")
                raise
            wait = retry.delay(attempt)
            log.info("%s: %r; try %d of %d in %.2f s", what, exc, attempt + 1, retry.attempts, wait)
        time.sleep(wait)
    raise AssertionError("unreachable")


def join(root: str, name: str) -> str:
    return posixpath.join(root.rstrip("/"), name)


def shard_url(root: str, name: str) -> str:
    """Where a shard the manifest at `root` names is: in the dataset's folder (packed shards, and
    archives indexed in place under it, named relative to it), or at an absolute path or URL."""
    return name if name.startswith("/") or "://" in name else join(root, name)


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of a URL, with s3fs's and botocore's retries off unless the options set
    them (`Retry` is the one retry layer). Call it in the process that reads: filesystems are not fork-safe.

    An s3 filesystem is made once per process, options and AWS_* environment (what botocore reads)
    and kept, its listings cache off so that nothing it answers goes stale: its client costs
    ~0.1-0.2 s to make, and one inherited by a forked worker must never be collected there (s3fs's
    finalizer would wait a second for the parent's event loop, then print "attached to a different
    loop")."""
    options = dict(storage_options or {})
    if not url.startswith(("s3://", "s3a://")):
        return url_to_fs(url, **options)
    aws = sorted((name, value) for name, value in os.environ.items() if name.startswith("AWS_"))
    key = (os.getpid(), json.dumps([options, aws], sort_keys=True, default=repr))
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})
        options["config_kwargs"] = config
        options.setdefault("skip_instance_cache", True)  # our instance: its `retries` below is ours to set
        options.setdefault("use_listings_cache", False)
        options.setdefault("session", _botocore_session())
        fs, _ = url_to_fs(url, **options)
        if "retries" not in options:
            fs.retries = 1  # s3fs's own loop: one try
        fs = _FILESYSTEMS.setdefault(key, fs)
    return fs, fs._strip_protocol(url)


_FILESYSTEMS: dict[tuple[int, str], fsspec.AbstractFileSystem] = {}  # s3: by process and options, never dropped
_SESSION: list[Any] = []  # the process's aiobotocore session


def _botocore_session() -> Any:
    """One botocore session per process, inherited by forked DataLoader workers: its parsed service
    models make their clients ~3x faster to create. A session holds no connection or event loop
    (those belong to each filesystem's client), so sharing it across fork is safe."""
    if not _SESSION:
        from aiobotocore.session import AioSession

        _SESSION.append(AioSession())
    return _SESSION[0]


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


PIECE_BYTES = 8 << 20  # a long read is a series of range requests of this size; a retry redoes one piece


def read_range(fs: fsspec.AbstractFileSystem, path: str, url: str, start: int, end: int, key: str | None = None,
               retry: Retry = Retry()) -> bytes:
    """Bytes [start, end) of a shard (holding sample `key`), read in pieces of `PIECE_BYTES`. A transient
    failure is retried from the piece it hit (the pieces before it are kept); a missing file, a short
    file or a failure past the retries is a ShardError."""
    what = f"sample {key!r}: " if key is not None else ""

    def piece(first: int, stop: int) -> bytes:
        data = fs.cat_file(path, start=first, end=stop)
        if len(data) != stop - first:
            raise _Truncated(f"bytes {first}-{stop} gave {len(data)} bytes")
        return data

    parts = []
    for first in range(start, end, PIECE_BYTES):
        stop = min(first + PIECE_BYTES, end)
        try:
            parts.append(with_retries(retry, f"{url} bytes {first}-{stop}", functools.partial(piece, first, stop)))
        except FileNotFoundError as exc:
            raise ShardError(url, f"{what}shard is missing") from exc
        except Exception as exc:
            tries = f" after {retry.attempts} tries" if transient(exc) else ""
            raise ShardError(url, f"{what}cannot read bytes {first}-{stop}{tries}: {_describe(exc)}") from exc
    return b"".join(parts)


def read_manifest(root: str, storage_options: dict[str, Any] | None = None, retry: Retry = Retry(),
                  cache: ShardCache | None = None) -> Manifest:
    """The dataset's manifest. With a `cache`, a remote manifest is kept on local disk, named by
    its URL, size and ETag (one HEAD request tells whether the copy is current), so the ranks of a
    node download it once."""
    url = join(root, MANIFEST_NAME)
    try:
        fs, path = filesystem(url, storage_options)
        info = with_retries(retry, url, lambda: fs.info(path))
        size = info["size"]
        if size > MAX_MANIFEST_BYTES:  # (outside the handlers below, which would wrap it again)
            raise ManifestError(url, f"larger than {MAX_MANIFEST_BYTES} bytes: not a manifest this reader accepts")
        fetch = functools.partial(read_range, fs, path, url, 0, size, retry=retry)
        if cache is not None and not is_local(fs):
            version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime")
            name = hashlib.sha256(json.dumps([url, size, str(version)]).encode()).hexdigest()
            data = cache.small(f"manifest-{name}.json", None, fetch)
        else:
            data = fetch() if size else b""
    except ManifestError:
        raise
    except (FileNotFoundError, ShardError) as exc:
        if isinstance(exc, FileNotFoundError) or isinstance(exc.__cause__, FileNotFoundError):
            raise ManifestError(url, "no manifest: is this a folder written by `shard-pack`? (or the bucket does "
                                "not exist)") from exc
        raise ManifestError(url, f"cannot read manifest: {exc.message}") from exc
    except PermissionError as exc:
        raise ManifestError(url, f"access denied: check the credentials in storage_options ({_describe(exc)})") from exc
    except Exception as exc:
        raise ManifestError(url, f"cannot read manifest: {_describe(exc)}") from exc
    manifest = Manifest.from_json(data, url)
    if manifest.version < 3:
        log.warning("%s: schema %d manifest, read with its per-sample tables in memory; `shard-pack upgrade %s` writes "
                    "shard indexes so that opening it costs O(shards)", url, manifest.version, root)
    return manifest


def shard_indexes(root: str, manifest: Manifest, split: str, storage_options: dict[str, Any] | None = None,
                  retry: Retry = Retry()) -> Iterator[tuple[ShardInfo, ShardIndex]]:
    """Each shard of a split with its index, in order (for tools: `verify`, `upgrade`, tests)."""
    fs, base = filesystem(root, storage_options)
    for shard in manifest.splits[split]:
        yield shard, read_index(fs, base, root, shard, retry)


def read_index(fs: fsspec.AbstractFileSystem, base: str, root: str, shard: ShardInfo, retry: Retry = Retry(),
               cache: ShardCache | None = None) -> ShardIndex:
    """A shard's index, read whole (one small request) and checked against the manifest: size cap,
    SHA-256, counts, bounds. A missing or bad index is a ShardIndexError naming its file."""
    if shard.index is None:
        assert shard.inline is not None
        return shard.inline
    info, url = shard.index, join(root, shard.index.name)
    if info.bytes > MAX_INDEX_BYTES:
        raise ShardIndexError(url, f"the manifest says {info.bytes} bytes, more than {MAX_INDEX_BYTES}")
    fetch = functools.partial(read_range, fs, join(base, info.name), url, 0, info.bytes, None, retry)
    try:
        data = cache.small(f"{info.sha256}.idx", info.sha256, fetch) if cache is not None else fetch()
    except ShardError as exc:
        missing = isinstance(exc.__cause__, FileNotFoundError)
        raise ShardIndexError(url, f"index of shard {shard.name!r} is missing (written by `shard-pack`, or by "
                              "`shard-pack upgrade` for an older dataset)" if missing else exc.message) from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256:
        raise ShardIndexError(url, f"SHA-256 {digest}, the manifest says {info.sha256}")
    return ShardIndex.from_bytes(data, url, samples=shard.samples, units=shard.units, shard_bytes=shard.bytes)


def write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes, retry: Retry = Retry()) -> None:
    """Write a small file so that readers see all of it or nothing: on a local disk a synced temporary
    file renamed into place (removed if the write fails: the OSError then names `path`); on object
    storage one PUT (objects appear only when complete)."""
    if is_local(fs):
        partial = f"{path}.partial-{uuid.uuid4().hex}"
        try:
            with open(partial, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            if isinstance(exc, OSError) and exc.errno is not None:  # (a failed write names no file)
                raise OSError(exc.errno, exc.strerror, path) from exc
            raise
        return
    with_retries(retry, fs.unstrip_protocol(path), lambda: fs.pipe_file(path, data))


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


class _CacheFull(Exception):
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
            except _CacheFull:
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
        until closed. Raises _CacheFull if the downloads in progress leave no room."""
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
                raise _CacheFull(f"{url}: not cached this time: downloads in progress hold {downloading} of the "
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


def _read_file(path: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a local file, copied (fewer at its end)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts = []
        while start < end:
            part = os.pread(fd, min(end - start, 1 << 30), start)
            if not part:
                break
            parts.append(part)
            start += len(part)
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)


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


class ShardReader:
    """Reads samples of one dataset's shards by byte range, with retries, from storage or the cache.

    With a cache, a shard not cached yet is downloaded whole in a background thread while its
    samples keep streaming by byte range: the first batch never waits for whole shards.
    Build it in the process that reads (a DataLoader worker).

    Local shards (in place or cached) are memory-mapped, each under a read lease (Linux `F_SETLEASE`):
    a process that opens a mapped shard for writing or truncates it must wait until the mapping is
    gone (at most /proc/sys/fs/lease-break-time, 45 s by default), and `check_leases`, called before
    each batch, names that shard. So a shard cut in place never faults a reader (SIGBUS, which
    would kill the process). Where no lease can be had (not the file's owner and no CAP_LEASE, a
    filesystem without leases, a file open for writing), shards are read by copy instead."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None, retry: Retry,
                 cache: ShardCache | None = None, verified: tuple[Any, Sequence[str]] | None = None,
                 index_bytes: int = 64 << 20) -> None:
        """`verified`: to check local shards' SHA-256, a table of one row per shard (an int64 array
        of shape (shards, 3), shared between the processes reading) and the shards' names.
        `index_bytes`: shard indexes kept (least recently used dropped past it)."""
        self.root, self.retry = root, retry
        self.fs, self.base = filesystem(root, storage_options)
        self.cache = None if is_local(self.fs) else cache  # local shards are read in place
        self._indexes: collections.OrderedDict[str, ShardIndex] = collections.OrderedDict()
        self._index_limit, self._index_held = index_bytes, 0
        self._downloads: dict[str, concurrent.futures.Future[str]] = {}
        self._waiting: dict[str, tuple[int, str]] = {}  # wanted before `start_downloads`
        self._started = False
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._maps: collections.OrderedDict[tuple[str, int, int], memoryview] = collections.OrderedDict()
        self._leases: dict[int, _Lease] = {}  # by descriptor: mapped shards, while any view of them lives
        self._copied = False  # a local shard was read by copy (no lease): said once in the log
        self._verified = verified
        self._index: dict[str, int] | None = None  # shard name -> row of `verified`
        self._storage_options = storage_options
        self._places: dict[str, tuple[fsspec.AbstractFileSystem, str, str]] = {}

    def _place(self, name: str) -> tuple[fsspec.AbstractFileSystem, str, str]:
        """(filesystem, path, URL) of a shard: in the dataset's folder, or where its absolute name says
        (an archive indexed in place: another bucket, or object storage under a local dataset)."""
        found = self._places.get(name)
        if found is None:
            url = shard_url(self.root, name)
            fs, path = (self.fs, join(self.base, name)) if url == join(self.root, name) else \
                filesystem(url, self._storage_options)
            found = self._places.setdefault(name, (fs, path, url))
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
        index = read_index(self.fs, self.base, self.root, shard, self.retry, self.cache)
        if shard.index is not None:
            with self._lock:
                if shard.name not in self._indexes:
                    self._indexes[shard.name] = index
                    self._index_held += index.nbytes
                while self._index_held > self._index_limit and len(self._indexes) > 1:
                    self._index_held -= self._indexes.popitem(last=False)[1].nbytes
        return index

    def size(self, name: str, key: str) -> int:
        """The shard's size in bytes (when reading sample `key`, for messages)."""
        fs, path, url = self._place(name)
        try:
            return with_retries(self.retry, url, lambda: fs.size(path))
        except FileNotFoundError as exc:
            raise ShardError(url, f"sample {key!r}: shard is missing") from exc
        except Exception as exc:
            raise ShardError(url, f"sample {key!r}: cannot stat shard: {_describe(exc)}") from exc

    def read(self, name: str, size: int, sha256: str, start: int, end: int, key: str) -> bytes | memoryview:
        """Bytes [start, end) of a shard: a view of the file mapped in memory when it is on local disk
        (in place or in the cache: no copy), else read by range."""
        fs, path, url = self._place(name)
        if self.cache is not None:
            local = self.cache.lookup(url, sha256)
            if local is not None:
                with contextlib.suppress(FileNotFoundError):  # (evicted meanwhile: stream)
                    data = self._local(local, url, start, end)
                    if len(data) == end - start:
                        return data
            self._download(name, size, sha256)
        elif is_local(fs):
            try:
                if self._verified is not None:
                    self._verify(name, path, url, sha256)
                data = self._local(path, url, start, end)
            except FileNotFoundError as exc:
                raise ShardError(url, f"sample {key!r}: shard is missing") from exc
            except (OSError, ValueError) as exc:
                raise ShardError(url, f"sample {key!r}: cannot read the shard: {_describe(exc)}") from exc
            if len(data) < end - start:
                actual: int | str = "now fewer"
                with contextlib.suppress(OSError):
                    actual = os.stat(path).st_size
                raise ShardError(url, f"sample {key!r}: shard is {actual} bytes, shorter than the sample's range "
                                 f"({start}-{end})")
            return data
        if self._verified is not None:  # (an archive indexed in place, on object storage under a local dataset)
            raise ShardError(url, f"sample {key!r}: verify='sha256' checks shards on local disk; this one is on object "
                             "storage (`shard-pack verify` checks it)")
        return read_range(fs, path, url, start, end, key, self.retry)

    def _verify(self, name: str, path: str, url: str, sha256: str) -> None:
        """Check a local shard's SHA-256 against the manifest's, unless the shared table says the file
        as it is now (inode, size, mtime) was checked: by one process at a time (a lock on the shard,
        so that the others wait for its answer instead of hashing it again)."""
        table, names = self._verified  # type: ignore[misc]
        if self._index is None:
            self._index = {n: i for i, n in enumerate(names)}
        row = table[self._index[name]]

        def checked() -> bool:
            stat = os.stat(path)
            return row.tolist() == [stat.st_ino, stat.st_size, stat.st_mtime_ns]

        if checked():
            return
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with contextlib.suppress(OSError):  # (no lock where the filesystem has none: hash it here too)
                fcntl.flock(fd, fcntl.LOCK_EX)
            if checked():
                return
            stat = os.fstat(fd)
            digest = hashlib.sha256()
            while block := os.read(fd, 1 << 22):
                digest.update(block)
            if digest.hexdigest() != sha256:
                raise ShardError(url, f"content has SHA-256 {digest.hexdigest()}, the manifest says {sha256}: the "
                                 "shard was changed since it was packed, or the manifest was edited (verify='sha256')")
            row[:] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            log.debug("%s: SHA-256 checked", url)
        finally:
            os.close(fd)  # (and the lock)

    def _local(self, path: str, url: str, start: int, end: int) -> bytes | memoryview:
        """Bytes [start, end) of a local file (fewer at its end): a view of its mapping, or a copy
        where it cannot be mapped under a lease."""
        view = self._mapped(path, url)
        if view is not None:
            return view[start:end]
        return _read_file(path, start, end)

    def _mapped(self, path: str, url: str) -> memoryview | None:
        """The file at `path` mapped read-only under a read lease, kept for later reads (the newest 64
        files; a file replaced since, by rename, is mapped anew); None where no lease can be had."""
        stat = os.stat(path)
        where = (path, stat.st_ino, stat.st_size)
        with self._lock:
            view = self._maps.get(where)
            if view is not None:
                self._maps.move_to_end(where)
                return view
        if not stat.st_size:
            return memoryview(b"")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
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
                    "memory-mapped (slower for embeddings)", self.root, path, _describe(exc))
            return None
        try:
            stat = os.fstat(fd)  # (the file leased: what `path` named when stat'ed above, or its replacement)
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            raise
        lease = _Lease(url, path, fd, stat.st_ino, stat.st_size)
        weakref.finalize(mapping, _mapping_gone, lease)
        view = memoryview(mapping)
        with self._lock:
            self._leases[fd] = lease
            self._maps[(path, stat.st_ino, stat.st_size)] = view
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

    def start_downloads(self) -> None:
        """Let background downloads begin (after the first batch: they would slow it down)."""
        with self._lock:
            self._started, waiting = True, list(self._waiting.items())
            self._waiting.clear()
        for name, args in waiting:
            self._download(name, *args)

    def _download(self, name: str, size: int, sha256: str) -> None:
        assert self.cache is not None
        cache, (fs, path, url) = self.cache, self._place(name)
        with self._lock:
            if not self._started:
                self._waiting[name] = (size, sha256)
                return
            running = self._downloads.get(name)
            if running is not None and not running.done():
                return
            if running is not None and running.exception() is not None:
                failed = running.exception()
                log.log(logging.INFO if isinstance(failed, _CacheFull) else logging.WARNING,
                        "%s: caching failed (%s); trying again", url, failed)
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardstream-cache")

            def fetch(f: Any) -> None:
                for offset in range(0, size, 8 * PIECE_BYTES):
                    f.write(read_range(fs, path, url, offset, min(offset + 8 * PIECE_BYTES, size), None, self.retry))

            self._downloads[name] = self._pool.submit(cache.fetch, url, size, sha256, fetch)

    def settle(self) -> None:
        """Wait for the background downloads (the end of an epoch); a failed one is logged, not raised:
        its samples were read by byte range."""
        with self._lock:
            downloads, self._downloads = list(self._downloads.items()), {}
        for name, future in downloads:
            exc = future.exception()
            if exc is not None:
                log.log(logging.INFO if isinstance(exc, _CacheFull) else logging.WARNING, "%s: caching failed: %s",
                        shard_url(self.root, name), exc)
