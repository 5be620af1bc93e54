"""Any WebDataset tars on the packing side: indexed in place (`shard-pack index webdataset`), never
packed. Consecutive members of one key form a sample, as webdataset groups them; the user's own
`decode` reads them (`pipeline.kinds.webdataset`). `PACKING` declares the kind to `shard_tools.kinds`.
"""

from __future__ import annotations

import collections
import posixpath
from collections.abc import Iterator

from pipeline.errors import excerpt
from pipeline.format import check_ext, check_key
from pipeline.tario import ArchiveMember
from shard_tools.plugin import PackingKind
from shard_tools.scan import LIMITS, Indexing, Members, skip

__all__ = ["PACKING"]


def _samples(url: str, scanned: Iterator[ArchiveMember], skipped: list[dict[str, str]],
             counts: collections.Counter[str]) -> list[tuple[str, Members]]:
    """Consecutive members of one key form a sample, as webdataset groups them (the key: the member's
    path up to its basename's first dot, a `./` prefix dropped); a sample holding a member that
    cannot be indexed is skipped whole, named. A folder, or a member with no extension and nothing
    wrong with it, is no sample's (counted "ignored", as webdataset ignores it); any other member is
    a sample's part or a skipped sample's."""
    groups: list[tuple[str, list[ArchiveMember]]] = []
    for member in scanned:
        name = member.name.removeprefix("./")
        base, dot, _ = posixpath.basename(name).partition(".")
        if member.directory or not (dot or member.problem):
            counts["ignored"] += 1
            continue
        key = posixpath.join(posixpath.dirname(name), base)
        if not groups or groups[-1][0] != key:
            groups.append((key, []))
        groups[-1][1].append(member)
    samples: list[tuple[str, Members]] = []
    seen: set[str] = set()
    for key, group in groups:
        members = [(m.name.removeprefix("./").partition(".")[2], m.offset, m.size) for m in group]
        reason = _problem(key, group, [ext for ext, _, _ in members], seen)
        seen.add(key)
        if reason:
            skipped.append(skip(url, group[0].name, key, reason))
        else:
            samples.append((key, members))
    return samples


def _problem(key: str, group: list[ArchiveMember], exts: list[str], seen: set[str]) -> str | None:
    """Why a group of members cannot be indexed as a sample, if so."""
    for member, ext in zip(group, exts):
        if member.problem is not None:
            return f"member {excerpt(member.name, 100)}: {member.problem}"
        if not _ext_ok(ext):
            return (f"member {excerpt(member.name, 100)}: extension {ext!r} is not lowercase letters and digits, "
                    "joined by dots")
    try:
        check_key(key)
    except ValueError as exc:
        return str(exc)
    if len(set(exts)) != len(exts):
        return f"a member extension twice in one sample: {exts}"
    if key in seen:
        return f"duplicate key {key!r} (its members are not consecutive); kept the first"
    if len(group) > LIMITS.max_members:
        return f"more than {LIMITS.max_members} members"
    return None


def _ext_ok(ext: str) -> bool:
    try:
        check_ext(ext)
    except ValueError:
        return False
    return True


def _wanted(name: str) -> bool:
    return False  # (headers only: the user's decode checks the bytes)


PACKING = PackingKind(index=Indexing(_samples, _wanted, help="any WebDataset tars (members grouped by key, as "
                                     "webdataset does)", what="any WebDataset tars"))
