"""Tar shards: a deterministic writer, a strict reader of one sample's byte range, and a scanner of
whole archives (what `shard-pack index` reads original archives with).

Kind-agnostic. Shards are plain USTAR archives (readable by `tar`, `tarfile` and `webdataset`);
each sample is members `<key>.<ext>`, consecutive in packed shards. The reader accepts only what
the writer makes: regular files with flat, safe names, checked header checksums and sizes inside
the range. Given the members an index records, it checks each at its recorded offset instead,
so the members of an original archive's sample may lie apart, in any order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tarfile
import uuid
from collections.abc import Callable, Iterator, Sequence

from pipeline.checks import is_int_at_least
from pipeline.errors import ConfigError, DatasetError, ShardError, excerpt
from pipeline.format import check_key

__all__ = ["BLOCK", "ArchiveMember", "ReadLimits", "ShardWriter", "member_header", "parse_sample", "sample_members",
           "scan_archive"]

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
            if not is_int_at_least(value, 1):
                raise ConfigError(f"{field.name} must be a positive int, got {value!r}")


def member_header(name: str, size: int) -> bytes:
    """The deterministic USTAR header of a regular-file member (mode 644, mtime 0)."""
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
            raise ConfigError(f"sample {key!r} has no members")
        self.keys.append(key)
        self.members.append([])
        for ext, data in members:
            if not _EXT_RE.fullmatch(ext):
                raise ConfigError(f"invalid member extension {ext!r}")
            self.members[-1].append((ext, self.size, len(data)))
            self._write(member_header(f"{key}.{ext}", len(data)))
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


def _octal(field: bytes, name: str) -> int:
    """A tar header's octal number field; a ValueError naming the field, never echoing its bytes."""
    text = field.rstrip(b"\0 ").lstrip(b" ")
    if not text or not text.isdigit() or b"8" in text or b"9" in text:
        raise DatasetError(f"its {name} field is not an octal number")
    return int(text, 8)


def parse_sample(data: bytes | memoryview, url: str, key: str, limits: ReadLimits = ReadLimits(),
                 members: Sequence[tuple[str, int, int]] | None = None, start: int = 0) -> dict[str, memoryview]:
    """The members `{ext: view of their bytes}` of one sample (no copy), from the exact byte range
    the index gives for it (starting at byte `start` of the shard).

    Only what the writer makes is accepted: regular files named `<key>.<ext>` for the index's
    key, headers with valid checksums, sizes within the caps and within the range. Nothing is
    ever extracted to disk; compressed shards are refused. With the index's `members` (extension,
    header offset in the shard, size), each is checked at its offset, and the bytes between them
    (other samples' members, in an original archive) are never looked at."""
    view = memoryview(data)
    found = sample_members(data, url, key, limits) if members is None else \
        _recorded_members(view, url, key, limits, members, start)
    return {ext: view[at + BLOCK : at + BLOCK + size] for ext, at, size in found}


def _header_size(header: bytes, url: str, pos: int, prefix: str, hint: str = "", key: str | None = None) -> int:
    """A tar header's size field, its octal fields and checksum checked; else a ShardError naming byte
    `pos` (and never quoting the header: it may be any file's bytes)."""
    try:
        checksum, size = _octal(header[148:156], "checksum"), _octal(header[124:136], "size")
    except ValueError as exc:
        raise ShardError(f"{prefix}invalid tar header at byte {pos}{hint}: {exc}", url=url, key=key) from exc
    if checksum != sum(header[:148]) + 256 + sum(header[156:]):
        raise ShardError(f"{prefix}tar header checksum mismatch at byte {pos}{hint}", url=url, key=key)
    return size


def _read_header(view: memoryview, pos: int, url: str, key: str) -> tuple[str, int]:
    """(name, size) of the regular-file header at `pos`, its checksum checked. Messages name the byte,
    never the header's own name (checked by the caller against the key)."""
    header = bytes(view[pos : pos + BLOCK])
    if len(header) < BLOCK:
        raise ShardError(f"truncated tar header at byte {pos}", url=url, key=key)
    size = _header_size(header, url, pos, "", key=key)
    if header[156:157] not in (b"0", b"\0"):
        raise ShardError(f"member type {excerpt(header[156:157])} at byte {pos} is not a regular file",
                         url=url, key=key)
    name = header[:100].rstrip(b"\0").decode("utf-8", "replace")
    if header[345:500].strip(b"\0"):
        raise ShardError(f"the member at byte {pos} has a ustar name prefix (a folder)", url=url, key=key)
    return name, size


def _recorded_members(view: memoryview, url: str, key: str, limits: ReadLimits,
                      members: Sequence[tuple[str, int, int]], start: int) -> list[tuple[str, int, int]]:
    """The index's members, each header checked at its offset (relative to `start`): a regular file
    named `<key>.<ext>` (or `./<key>.<ext>`, as `tar -C dir .` writes) of the recorded size."""
    try:
        check_key(key)
    except ValueError as exc:
        raise ShardError(f"unsafe sample key in the index: {exc}", url=url) from exc
    if len(members) > limits.max_members:
        raise ShardError(f"more than {limits.max_members} members", url=url, key=key)
    found = []
    for ext, offset, recorded in members:
        pos = offset - start
        name, size = _read_header(view, pos, url, key)
        if name not in (f"{key}.{ext}", f"./{key}.{ext}") or not _EXT_RE.fullmatch(ext):
            raise ShardError(f"the member at byte {offset} is not named {key}.{excerpt(ext)[1:-1]}, "
                             "as the index says", url=url, key=key)
        if size != recorded or size > limits.max_member_bytes or pos + BLOCK + size > len(view):
            raise ShardError(f"member {key}.{ext} at byte {offset} claims {size} bytes, the index says "
                             f"{recorded} (or beyond the cap or the sample's range)", url=url, key=key)
        found.append((ext, pos, size))
    return found


def sample_members(data: bytes | memoryview, url: str, key: str,
                   limits: ReadLimits = ReadLimits()) -> list[tuple[str, int, int]]:
    """(extension, header offset, data bytes) of each member of one sample's byte range, checked as
    `parse_sample` says."""
    try:
        check_key(key)
    except ValueError as exc:
        raise ShardError(f"unsafe sample key in the index: {exc}", url=url) from exc
    if bytes(data[:2]) == b"\x1f\x8b":
        raise ShardError("gzip-compressed data; only uncompressed tar shards are read", url=url, key=key)
    members: list[tuple[str, int, int]] = []
    view = memoryview(data)
    pos = 0
    while pos < len(data):
        name, size = _read_header(view, pos, url, key)
        member_key, _, ext = name.partition(".")
        if member_key != key or not _EXT_RE.fullmatch(ext):
            raise ShardError(f"the member at byte {pos} of the sample is not named {key}.<ext>",
                             url=url, key=key)
        shown = f"{key}.{excerpt(ext)[1:-1]}"
        if size > limits.max_member_bytes or pos + BLOCK + size > len(data):
            raise ShardError(f"member {shown} claims {size} bytes, beyond the cap or the sample's range",
                             url=url, key=key)
        if any(e == ext for e, _, _ in members) or len(members) == limits.max_members:
            raise ShardError(f"duplicate member {shown} or more than {limits.max_members} members",
                             url=url, key=key)
        members.append((ext, pos, size))
        pos += BLOCK + size + (-size % BLOCK)
    return members


_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
_MAX_EXTENDED = 1 << 20  # a pax or GNU long-name header's bytes


@dataclasses.dataclass(frozen=True)
class ArchiveMember:
    """One member of an archive scanned front to back: its name (as extended headers set it), its
    own header's offset, its size, and why it cannot be read as a sample member (`problem`), if so."""

    name: str
    offset: int
    size: int
    problem: str | None  # not a regular file, a name only an extended header holds, ...
    data: bytes | None  # its bytes, if the scanner was asked for them and it has no problem
    directory: bool = False


def scan_archive(read: Callable[[int], bytes], url: str, wanted: Callable[[str], bool],
                 limits: ReadLimits = ReadLimits()) -> Iterator[ArchiveMember]:
    """Each member of an uncompressed tar (ustar, GNU or pax, as GNU tar and tarfile write it),
    reading it front to back with `read(n)` (the next n bytes; fewer only at the end), the bytes of
    the regular files `wanted(name)` selects included. A member whose name or size only a pax or
    GNU extended header gives cannot be read back from its own header: it comes with a `problem`,
    under the name the extended header sets, whole (else its own): its key and extension are the
    ones the skip names. A compressed, truncated or malformed
    archive is a ShardError naming the byte it failed at. Member names in messages are escaped and
    cut to `_SHOWN` characters."""
    pos, extended, path = 0, False, ""
    while True:
        header = read(BLOCK)
        if not header:  # (an archive may end without its end-of-archive blocks, as tarfile allows)
            return
        if pos == 0:
            for magic, name in _COMPRESSED.items():
                if header.startswith(magic):
                    raise ShardError(f"{name}-compressed archive; only uncompressed tar archives are indexed", url=url)
        if len(header) < BLOCK:
            raise ShardError(f"not a tar archive: {len(header)} bytes, less than a tar header" if pos == 0
                             else f"truncated tar header at byte {pos}", url=url)
        if header == b"\0" * BLOCK:
            return
        size = _header_size(header, url, pos, "not a tar archive: " if pos == 0 else "")
        kind, padded = header[156:157], size + (-size % BLOCK)
        name = header[:100].rstrip(b"\0").decode("utf-8", "replace")
        if kind in (b"x", b"g", b"L", b"K"):
            if size > _MAX_EXTENDED:
                raise ShardError(f"extended header of {size} bytes at byte {pos}, more than {_MAX_EXTENDED}", url=url)
            payload = _read_exactly(read, padded, url, f"the extended header at byte {pos}")[:size]
            if kind == b"g" and (b" path=" in payload or b" size=" in payload):
                raise ShardError(f"a pax global header at byte {pos} sets names or sizes: not indexed", url=url)
            if kind in (b"L", b"x") and (kind == b"L" or b" path=" in payload or b" size=" in payload):
                extended = True
                path = payload.rstrip(b"\0").decode("utf-8", "replace") if kind == b"L" else _pax_path(payload) or path
            pos += BLOCK + padded
            continue
        problem = None
        if kind not in (b"0", b"\0"):
            problem = f"member type {kind!r} is not a regular file"
        elif extended:
            problem = "its name or size is set by a pax or GNU extended header, not by its own tar header"
        elif header[345:500].strip(b"\0"):
            problem = "its name continues in the ustar prefix field (a folder inside the archive)"
        elif size > limits.max_member_bytes:
            problem = f"{size} bytes, more than max_member_bytes={limits.max_member_bytes}"
        take = problem is None and wanted(name)
        where = f"member {excerpt(name, _SHOWN)} ({size} bytes at byte {pos})"
        data = _read_exactly(read, size, url, where) if take else None
        _skip(read, padded - size if take else padded, url, where)
        yield ArchiveMember(path or name, pos, size, problem, data, kind == b"5")  # (the path, whole: skipped)
        pos, extended, path = pos + BLOCK + padded, False, ""


_SHOWN = 100  # characters of an archive member's name in messages (a tar header holds 100; pax, any number)


def _pax_path(payload: bytes) -> str:
    """The path a pax header sets, if any ("": a header setting only the size, say)."""
    for record in payload.split(b"\n"):
        _, _, field = record.partition(b" ")
        if field.startswith(b"path="):
            return field[5:].decode("utf-8", "replace")
    return ""


def _read_exactly(read: Callable[[int], bytes], size: int, url: str, where: str) -> bytes:
    data = read(size)
    if len(data) < size:
        raise ShardError(f"archive ends inside {where} (truncated?)", url=url)
    return data


def _skip(read: Callable[[int], bytes], size: int, url: str, where: str) -> None:
    while size:
        size -= len(_read_exactly(read, min(size, 1 << 22), url, where))
