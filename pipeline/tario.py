"""Tar shards: a deterministic writer and a strict reader of one sample's byte range.

Kind-agnostic. Shards are plain USTAR archives (readable by `tar`, `tarfile` and `webdataset`);
each sample is consecutive members `<key>.<ext>`. The reader accepts only what the writer makes:
regular files with flat, safe names, checked header checksums and sizes inside the range.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tarfile
import uuid
from collections.abc import Sequence

from pipeline.errors import ShardError
from pipeline.format import check_key

__all__ = ["BLOCK", "ReadLimits", "ShardWriter", "parse_sample", "sample_members"]

BLOCK = 512
_END = b"\0" * (2 * BLOCK)
_EXT_RE = re.compile(r"[a-z0-9]+(\.[a-z0-9]+)*")


@dataclasses.dataclass(frozen=True)
class ReadLimits:
    """Caps on what a shard can make a reader do, checked before the bytes are read or decoded.

    Shards are untrusted input; the defaults are generous for real data (an SA-1B sample is
    ~0.5 MB, a shard ~1 GB) and bound memory and work per sample."""

    max_member_bytes: int = 256 << 20
    max_members: int = 16  # per sample
    max_sample_bytes: int = 512 << 20
    max_shard_bytes: int = 1 << 40
    max_image_pixels: int = 1 << 26  # 8k x 8k (SA-1B: 3.4M); larger images are refused, not decoded

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field.name} must be a positive int, got {value!r}")


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


class ShardWriter:
    """Writes one shard to `<path>.partial-<unique>` and renames it to `path` on `close()`: never a
    partial shard, and two writers of the same shard (a retried task) never share a temporary file."""

    def __init__(self, path: str) -> None:
        self.path, self.partial = path, f"{path}.partial-{uuid.uuid4().hex}"
        self._file = open(self.partial, "wb")
        self._sha = hashlib.sha256()
        self.keys: list[str] = []
        self.members: list[list[tuple[str, int, int]]] = []  # per sample: (extension, header offset, data bytes)
        self.size = 0

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._sha.update(data)
        self.size += len(data)

    def add(self, key: str, members: Sequence[tuple[str, bytes]]) -> None:
        check_key(key)
        if not members:
            raise ValueError(f"sample {key!r} has no members")
        self.keys.append(key)
        self.members.append([])
        for ext, data in members:
            if not _EXT_RE.fullmatch(ext):
                raise ValueError(f"invalid member extension {ext!r}")
            self.members[-1].append((ext, self.size, len(data)))
            self._write(_header(f"{key}.{ext}", len(data)))
            self._write(data)
            self._write(b"\0" * (-len(data) % BLOCK))

    def close(self) -> str:
        """Finish the archive, flush it to disk, rename it into place; returns its SHA-256."""
        self._write(_END)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial, self.path)
        return self._sha.hexdigest()

    def abort(self) -> None:
        self._file.close()
        os.unlink(self.partial)


def _octal(field: bytes) -> int:
    text = field.rstrip(b"\0 ").lstrip(b" ")
    if not text or not text.isdigit() or b"8" in text or b"9" in text:
        raise ValueError(f"bad octal field {field!r}")
    return int(text, 8)


def parse_sample(data: bytes | memoryview, url: str, key: str, limits: ReadLimits = ReadLimits()) -> dict[str, memoryview]:
    """The members `{ext: view of their bytes}` of one sample (no copy), from the exact byte range
    the index gives for it.

    Only what the writer makes is accepted: regular files named `<key>.<ext>` for the index's
    key, headers with valid checksums, sizes within the caps and within the range. Nothing is
    ever extracted to disk; compressed shards are refused."""
    view = memoryview(data)
    return {ext: view[at + BLOCK : at + BLOCK + size] for ext, at, size in sample_members(data, url, key, limits)}


def sample_members(data: bytes | memoryview, url: str, key: str, limits: ReadLimits = ReadLimits()) -> list[tuple[str, int, int]]:
    """(extension, header offset, data bytes) of each member of one sample's byte range, checked as
    `parse_sample` says."""
    try:
        check_key(key)
    except ValueError as exc:
        raise ShardError(url, f"unsafe sample key in the index: {exc}") from exc
    if bytes(data[:2]) == b"\x1f\x8b":
        raise ShardError(url, f"sample {key!r}: gzip-compressed data; only uncompressed tar shards are read")
    members: list[tuple[str, int, int]] = []
    view = memoryview(data)
    pos = 0
    while pos < len(data):
        header = bytes(view[pos : pos + BLOCK])
        if len(header) < BLOCK:
            raise ShardError(url, f"sample {key!r}: truncated tar header at byte {pos}")
        try:
            checksum = _octal(header[148:156])
            size = _octal(header[124:136])
        except ValueError as exc:
            raise ShardError(url, f"sample {key!r}: invalid tar header at byte {pos}: {exc}") from exc
        if checksum != sum(header[:148]) + 256 + sum(header[156:]):
            raise ShardError(url, f"sample {key!r}: tar header checksum mismatch at byte {pos}")
        if header[156:157] not in (b"0", b"\0"):
            raise ShardError(url, f"sample {key!r}: member type {header[156:157]!r} is not a regular file")
        name = header[:100].rstrip(b"\0").decode("utf-8", "replace")
        member_key, _, ext = name.partition(".")
        if header[345:500].strip(b"\0") or member_key != key or not _EXT_RE.fullmatch(ext):
            raise ShardError(url, f"sample {key!r}: unexpected member name {name[:120]!r}")
        if size > limits.max_member_bytes or pos + BLOCK + size > len(data):
            raise ShardError(url, f"sample {key!r}: member {name!r} claims {size} bytes, beyond the cap or the sample's range")
        if any(e == ext for e, _, _ in members) or len(members) == limits.max_members:
            raise ShardError(url, f"sample {key!r}: duplicate member {name!r} or more than {limits.max_members} members")
        members.append((ext, pos, size))
        pos += BLOCK + size + (-size % BLOCK)
    return members
