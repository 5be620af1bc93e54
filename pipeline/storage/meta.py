"""A dataset's own files: its manifest and its shards' index files, read whole and checked."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import fsspec

from pipeline.errors import ConfigError, ManifestError, ShardError, ShardIndexError
from pipeline.format import MANIFEST_NAME, MAX_INDEX_BYTES, Manifest, ShardIndex, ShardInfo
from pipeline.storage.cache import ShardCache
from pipeline.storage.fs import filesystem, is_local, join, read_range
from pipeline.storage.places import Places
from pipeline.storage.retry import Retry, describe, http_status, with_retries

__all__ = ["MAX_MANIFEST_BYTES", "read_index", "read_manifest", "shard_indexes"]

log = logging.getLogger("pipeline.storage")
MAX_MANIFEST_BYTES = 4 << 30  # SA-1B's 11M samples need ~0.3 GB


def read_manifest(root: str, storage_options: dict[str, Any] | None = None, retry: Retry = Retry(),
                  cache: ShardCache | None = None) -> Manifest:
    """The dataset's manifest. With a `cache`, a remote manifest is kept on local disk, named by
    its URL, size and ETag (one HEAD request tells whether the copy is current), so the ranks of a
    node download it once. A local manifest is read only if it is a regular file inside the folder
    (`places.Places.real`: a hub snapshot's link into its blobs too)."""
    url = join(root, MANIFEST_NAME)
    try:
        fs, path = filesystem(url, storage_options)
        if is_local(fs):
            path = Places(root).real(path, url)
        info = with_retries(retry, url, lambda: fs.info(path))
        if is_local(fs) and info.get("type") != "file":
            raise ManifestError(f"{path} is not a regular file", url=url)
        size = info["size"]
        if size > MAX_MANIFEST_BYTES:  # (outside the handlers below, which would wrap it again)
            raise ManifestError(f"larger than {MAX_MANIFEST_BYTES} bytes: not a manifest this reader accepts", url=url)
        fetch = functools.partial(read_range, fs, path, url, 0, size, retry=retry)
        if cache is not None and not is_local(fs):
            version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime")
            name = hashlib.sha256(json.dumps([url, size, str(version)]).encode()).hexdigest()
            data = cache.small(f"manifest-{name}.json", None, fetch)
        else:
            data = fetch() if size else b""
    except (ManifestError, ConfigError):  # (ConfigError: a scheme whose library is missing, no account given)
        raise
    except (FileNotFoundError, ShardError) as exc:
        if isinstance(exc, ShardError) and exc.__cause__ is None:  # (outside the folder, or not a regular file)
            raise ManifestError(exc.message, url=url) from exc
        if isinstance(exc, FileNotFoundError) or isinstance(exc.__cause__, FileNotFoundError):
            raise ManifestError("no manifest: is this a folder written by `shard-pack`? (or the bucket does "
                                "not exist)", url=url) from exc
        raise ManifestError(f"cannot read manifest: {exc.message}", url=url) from exc
    except Exception as exc:
        if isinstance(exc, PermissionError) or http_status(exc) in (401, 403):  # (adlfs: azure-core's error as it is)
            raise ManifestError(f"access denied: check the credentials in storage_options ({describe(exc)})",
                                url=url) from exc
        raise ManifestError(f"cannot read manifest: {describe(exc)}", url=url) from exc
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
               cache: ShardCache | None = None, places: Places | None = None) -> ShardIndex:
    """A shard's index, read whole (one small request) and checked against the manifest: size cap,
    SHA-256, counts, bounds. A missing or bad index is a ShardIndexError naming its file. Index
    names are flat names in the folder; on local disk, a link is followed only as `places` allows."""
    if shard.index is None:
        assert shard.inline is not None
        return shard.inline
    info, url = shard.index, join(root, shard.index.name)
    if info.bytes > MAX_INDEX_BYTES:
        raise ShardIndexError(f"the manifest says {info.bytes} bytes, more than {MAX_INDEX_BYTES}", url=url)
    try:
        path = join(base, info.name)
        if is_local(fs):
            path = (places or Places(root)).real(path, url)
        fetch = functools.partial(read_range, fs, path, url, 0, info.bytes, retry)
        data = cache.small(f"{info.sha256}.idx", info.sha256, fetch) if cache is not None else fetch()
    except ShardError as exc:
        missing = isinstance(exc.__cause__, FileNotFoundError)
        raise ShardIndexError(f"index of shard {shard.name!r} is missing (written by `shard-pack`, or by "
                              "`shard-pack upgrade` for an older dataset)" if missing else exc.message,
                              url=url) from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256:
        raise ShardIndexError(f"SHA-256 {digest}, the manifest says {info.sha256}", url=url)
    return ShardIndex.from_bytes(data, url, samples=shard.samples, units=shard.units, shard_bytes=shard.bytes)

