"""All reads go through here (fsspec: local paths and URLs alike)."""

from __future__ import annotations

import posixpath
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from pipeline.errors import ManifestError, ShardError
from pipeline.format import MANIFEST_NAME, Manifest

__all__ = ["MAX_MANIFEST_BYTES", "join", "filesystem", "read_manifest", "read_range"]

MAX_MANIFEST_BYTES = 4 << 30  # SA-1B's 11M samples need ~0.3 GB


def join(root: str, name: str) -> str:
    return posixpath.join(root.rstrip("/"), name)


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of a URL; call it in the process that reads (filesystems are not fork-safe)."""
    return url_to_fs(url, **(storage_options or {}))


def read_manifest(root: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    url = join(root, MANIFEST_NAME)
    fs, path = filesystem(url, storage_options)
    try:
        if fs.size(path) > MAX_MANIFEST_BYTES:
            raise ManifestError(url, f"larger than {MAX_MANIFEST_BYTES} bytes: not a manifest this reader accepts")
        data = fs.cat_file(path)
    except FileNotFoundError as exc:
        raise ManifestError(url, "no manifest: is this a folder written by `shard-pack`?") from exc
    except OSError as exc:
        raise ManifestError(url, f"cannot read manifest: {exc}") from exc
    return Manifest.from_json(data, url)


def read_range(fs: fsspec.AbstractFileSystem, path: str, url: str, start: int, end: int, key: str | None = None) -> bytes:
    """Bytes [start, end) of a shard (holding sample `key`); a missing file or a short read is a ShardError."""
    what = f"sample {key!r}: " if key is not None else ""
    try:
        data = fs.cat_file(path, start=start, end=end)
    except FileNotFoundError as exc:
        raise ShardError(url, f"{what}shard is missing") from exc
    except OSError as exc:
        raise ShardError(url, f"{what}cannot read bytes {start}-{end}: {exc}") from exc
    if len(data) != end - start:
        raise ShardError(url, f"{what}truncated: bytes {start}-{end} gave {len(data)} bytes")
    return data
