"""What a name in a dataset may be: sample keys, member extensions, shard and index file names.
A name that is not one of these is refused, never rewritten into one (a dataset folder is untrusted)."""

from __future__ import annotations

import re

import numpy as np

from pipeline.errors import ConfigError

__all__ = ["shard_name", "check_key", "check_ext", "check_shard_name"]

_KEY_RE = re.compile(r"[A-Za-z0-9_\-]{1,80}")
_KEY_BYTES = np.zeros(256, dtype=bool)
_KEY_BYTES[np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-", np.uint8)] = True
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_SHARD_RE = re.compile(r"[A-Za-z0-9_\-]+\.tar")
# An archive indexed in place: relative to the manifest's folder, an absolute path, or a URL.
_RELATIVE_RE = re.compile(r"(?:[A-Za-z0-9_\-][A-Za-z0-9_.\-]*/)*[A-Za-z0-9_\-][A-Za-z0-9_.\-]*\.tar")
_ABSOLUTE_RE = re.compile(r"(?:/|[a-z][a-z0-9+.\-]*://[^/\x00-\x1f\x7f]+/)[^\x00-\x1f\x7f\\]*\.tar")
_INDEX_RE = re.compile(r"[A-Za-z0-9_\-]+\.idx")
_EXT_RE = re.compile(r"[a-z0-9]+(\.[a-z0-9]+)*")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def check_key(key: str) -> str:
    """Keys are flat names (letters, digits, `_`, `-`; at most 80): safe in tar, URLs and file systems."""
    if not _KEY_RE.fullmatch(key):
        raise ConfigError(f"invalid sample key {key!r}: allowed are 1-80 of [A-Za-z0-9_-]")
    return key


def check_ext(ext: str) -> str:
    """Member extensions are lowercase letters and digits, in parts joined by dots (`jpg`, `seg.png`)."""
    if not _EXT_RE.fullmatch(ext):
        raise ConfigError(f"invalid member extension {ext!r}: want lowercase letters and digits, joined by dots")
    return ext


def check_shard_name(name: str, origin: str) -> str:
    """A shard name a manifest of `origin` may hold, else ValueError: packed shards are flat names in
    the dataset's folder; an archive indexed in place is a `.tar` path relative to it (no `.` or `..`
    component) or an absolute path or URL (none either), without control characters."""
    if not _shard_name_ok(name, origin):
        raise ConfigError(f"shard name {name!r} is not allowed in a {origin} dataset: want " +
                          ("<letters, digits, _ ->.tar" if origin == "packed" else
                          "a .tar path relative to the dataset folder, an absolute path or a URL, no . or .. parts"))
    return name


def _shard_name_ok(name: str, origin: str) -> bool:
    if origin == "packed":
        return _SHARD_RE.fullmatch(name) is not None
    if _RELATIVE_RE.fullmatch(name):
        return True
    return _ABSOLUTE_RE.fullmatch(name) is not None and not any(p in (".", "..") for p in name.split("/"))

