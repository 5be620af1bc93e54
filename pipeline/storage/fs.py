"""Filesystems by URL (fsspec: local paths and any URL alike), made in the process that uses them,
and the generic ranged read and atomic small write over them.

For `s3://`, botocore's and s3fs's own retry loops are turned off (they multiply: 5 x 5 tries by
default) unless the caller sets them, for `az://` azure-storage-blob's (10 tries) and for `gs://`
gcsfs's (6 tries), so `Retry` alone decides how often a request is tried, and a long range read
resumes from the last whole piece it reached."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import posixpath
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from pipeline.errors import ConfigError, ShardError
from pipeline.storage.azure import SCHEMES as AZURE_SCHEMES
from pipeline.storage.azure import filesystem as adlfs_filesystem
import pipeline.storage.gcs as gcs
from pipeline.storage.local import read_regular
from pipeline.storage.retry import Retry, Tries, Truncated, describe, transient, with_retries

__all__ = ["KEPT", "PIECE_BYTES", "filesystem", "is_local", "join", "read_range", "shard_url", "write_bytes"]

def join(root: str, name: str) -> str:
    return posixpath.join(root.rstrip("/"), name)


def shard_url(root: str, name: str) -> str:
    """Where a shard the manifest at `root` names is: in the dataset's folder (packed shards, and
    archives indexed in place under it, named relative to it), or at an absolute path or URL."""
    return name if name.startswith("/") or "://" in name else join(root, name)


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of a URL, with the storage library's own retries off unless the options set
    them (`Retry` is the one retry layer). Call it in the process that reads: filesystems are not fork-safe.

    An s3, Azure or gs filesystem is made once per process, options and environment (what botocore,
    azure-storage, or gcsfs and google-auth read) and kept, its listings cache off so that nothing it
    answers goes stale: its client costs ~0.1-0.2 s to make, and one inherited by a forked worker must
    never be collected there (s3fs's and adlfs's finalizers would wait for the parent's event loop;
    s3fs's then prints "attached to a different loop")."""
    options = dict(storage_options or {})
    kept = KEPT.get(url.partition("://")[0]) if "://" in url else None
    if kept is None:
        return url_to_fs(url, **options)
    prefix, make = kept
    env = sorted((name, value) for name, value in os.environ.items() if name.startswith(prefix))
    key = (os.getpid(), url.partition("://")[0], json.dumps([options, env], sort_keys=True, default=repr))
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        fs = _FILESYSTEMS.setdefault(key, make(url, options))
    return fs, fs._strip_protocol(url)


def _s3fs(url: str, options: dict[str, Any]) -> fsspec.AbstractFileSystem:
    """s3fs's filesystem with its own and botocore's retries off, unless the options set them; a
    ConfigError naming the URL where s3fs is missing."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    options = {**options, "config_kwargs": config}
    options.setdefault("skip_instance_cache", True)  # our instance: its `retries` below is ours to set
    options.setdefault("use_listings_cache", False)
    try:
        options.setdefault("session", _botocore_session())
        fs, _ = url_to_fs(url, **options)
    except ImportError as exc:
        raise ConfigError(f"{url}: reading or writing S3 needs s3fs ({exc}): install the package's s3 extra, "
                          "or pip install 's3fs>=2023.1' 'obstore>=0.12,<0.13'") from exc
    if "retries" not in options:
        fs.retries = 1  # s3fs's own loop: one try
    return fs


# scheme -> (the environment variables its library reads: their prefix or prefixes, its filesystem's maker)
KEPT: dict[str, tuple[str | tuple[str, ...], Callable[[str, dict[str, Any]], fsspec.AbstractFileSystem]]] = {
    "s3": ("AWS_", _s3fs), "s3a": ("AWS_", _s3fs),
    **{scheme: ("AZURE", adlfs_filesystem) for scheme in AZURE_SCHEMES},
    **{scheme: (gcs.ENVIRONMENT, gcs.filesystem) for scheme in gcs.SCHEMES}}
_FILESYSTEMS: dict[tuple[int, str, str], fsspec.AbstractFileSystem] = {}  # by process and options, never dropped
_SESSIONS: dict[tuple[tuple[str, str], ...], Any] = {}  # the process's aiobotocore sessions, by AWS_ environment


def _botocore_session() -> Any:
    """One botocore session per process and AWS_ environment, inherited by forked DataLoader workers:
    its parsed service models make their clients ~3x faster to create. A session holds no connection
    or event loop (those belong to each filesystem's client), so sharing it across fork is safe. It
    keeps the credentials it first resolves, so one made under other AWS_ variables is never reused:
    a process that sets or drops credentials (or AWS_PROFILE) later reads with what it has now."""
    env = tuple(sorted((name, value) for name, value in os.environ.items() if name.startswith("AWS_")))
    if env not in _SESSIONS:
        from aiobotocore.session import AioSession

        _SESSIONS[env] = AioSession()
    return _SESSIONS[env]


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)



PIECE_BYTES = 8 << 20  # a long read is a series of range requests of this size; a retry redoes one piece


def read_range(fs: fsspec.AbstractFileSystem, path: str, url: str, start: int, end: int,
               retry: Retry = Retry()) -> bytes:
    """Bytes [start, end) of a shard, read in pieces of `PIECE_BYTES`. A transient
    failure is retried from the piece it hit (the pieces before it are kept); a missing file, a short
    file or a failure past the retries is a ShardError. A local file is read only if it is a regular
    file (`local.read_regular`: never a FIFO or a device)."""
    local = is_local(fs)

    def piece(first: int, stop: int) -> bytes:
        data = read_regular(path, url, first, stop) if local else fs.cat_file(path, start=first, end=stop)
        if len(data) != stop - first:
            raise Truncated(f"bytes {first}-{stop} gave {len(data)} bytes")
        return data

    parts = []
    for first in range(start, end, PIECE_BYTES):
        stop = min(first + PIECE_BYTES, end)
        tries, read = Tries(retry), functools.partial(piece, first, stop)
        try:
            parts.append(with_retries(retry, f"{url} bytes {first}-{stop}", read, tries))
        except FileNotFoundError as exc:
            raise ShardError("shard is missing", url=url) from exc
        except ShardError:  # (not a regular file)
            raise
        except Exception as exc:
            after = f" after {tries}" if transient(exc) else ""
            raise ShardError(f"cannot read bytes {first}-{stop}{after}: {describe(exc)}", url=url) from exc
    return b"".join(parts)



def write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes | memoryview, retry: Retry = Retry()) -> None:
    """Write a file so that readers see all of it or nothing: on a local disk a synced temporary
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
    with_retries(retry, fs.unstrip_protocol(path), lambda: fs.pipe_file(path, bytes(data)))

