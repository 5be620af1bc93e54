"""The output folder of a pack or an index run: marked as a run's (`_pack/fingerprint`) before
anything is written, resumed by a run of the same inputs, left as it was found by a run that ends
before its first shard, and cleared of a killed run's debris."""

from __future__ import annotations

import contextlib
import glob
import os
import posixpath
from typing import Any

from pipeline.errors import PackError
from pipeline.format import MANIFEST_NAME
from pipeline.storage import Retry, filesystem, is_local, join, with_retries, write_bytes
from pipeline.storage.retry import http_status

__all__ = ["STATE_DIR", "exists", "holds_more_than_state", "remove_debris", "start", "unstart"]

STATE_DIR = "_pack"


def holds_more_than_state(fs: Any, base: str) -> bool:
    """OUT holds something besides `_pack/` (listed afresh: workers write shards from other processes)."""
    return exists(fs, base) and any(posixpath.basename(p.rstrip("/")) != STATE_DIR
                                     for p in fs.ls(base, detail=False, refresh=True))


def start(fs: Any, base: str, out: str, fingerprint: str) -> list[str] | None:
    """Check that OUT may take this pack and mark it as this pack's (`_pack/fingerprint`). None when
    resuming an unfinished pack of the same inputs; else the folders made for it, outermost first."""
    state = join(base, STATE_DIR)
    stamp = join(state, "fingerprint")
    if exists(fs, stamp):
        if fs.cat_file(stamp).decode().strip() != fingerprint:
            raise PackError(f"{out} holds an unfinished pack of other inputs or options; remove it or use a new folder")
        return None
    if holds_more_than_state(fs, base):
        raise PackError(f"{out} is not empty and holds no pack of these inputs; use a new or empty folder")
    made: list[str] = []
    path = state
    while is_local(fs) and not fs.exists(path):  # (object storage has no folders; a missing bucket fails below)
        made.insert(0, path)
        path = posixpath.dirname(path)
    try:
        for path in made:
            fs.mkdir(path, create_parents=False)
        write_bytes(fs, stamp, fingerprint.encode())
    except BaseException as exc:
        unstart(fs, base, made)
        if isinstance(exc, (FileNotFoundError, PermissionError)) or http_status(exc) in (401, 403, 404):  # (adlfs)
            raise PackError(f"cannot write to {out}: {type(exc).__name__}: {exc} (does the bucket exist? are the "
                            "credentials allowed to write?)") from exc
        raise
    return made


def unstart(fs: Any, base: str, made: list[str]) -> None:
    """After a run that `start` marked ends early: its fingerprint and the folders it made removed,
    unless OUT holds more (a shard, or a writer's debris: the next run goes on from there)."""
    if holds_more_than_state(fs, base):
        return
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(join(join(base, STATE_DIR), "fingerprint"))
    for path in reversed(made):
        with contextlib.suppress(OSError):  # (not made, or not empty: kept)
            fs.rmdir(path)


def exists(fs: Any, path: str) -> bool:
    return with_retries(Retry(), fs.unstrip_protocol(path), lambda: fs.exists(path))


def remove_debris(out: str, storage_options: dict[str, Any] | None) -> None:
    """What a run killed mid-way leaves besides its shards' temporary files (removed once a run
    finishes): a manifest being written. (The `sem.mp-*` semaphores a killed process group leaves
    in /dev/shm are not removed: which of them belong to a dead run cannot be told safely, since a
    live semaphore's creator maps it under a temporary name, and removing another job's breaks it.)"""
    fs, base = filesystem(out, storage_options)
    if is_local(fs):
        for partial in glob.glob(glob.escape(join(base, MANIFEST_NAME)) + ".partial-*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
