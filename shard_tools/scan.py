"""What a kind hands `shard-pack index` (`Indexing`: how to find its samples among an archive's
members), and the helpers its sample finder shares with the index run: the limits a sample must
keep, a skipped input's entry, an archive's flat-named regular files."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator

from pipeline.tario import ArchiveMember, ReadLimits

__all__ = ["LIMITS", "Indexing", "Members", "flat_members", "skip", "shown"]

LIMITS = ReadLimits()  # what the loader will accept of a sample: spans and member sizes beyond are skipped here
Members = list[tuple[str, int, int]]  # (extension, header offset, size), in archive order


@dataclasses.dataclass(frozen=True)
class Indexing:
    """A kind that can be indexed in place: `samples(url, members, skipped, counts)` turns an archive's
    members (in order) into its samples `(key, members)` in archive order, appending what it skips
    to `skipped` and counting in `counts` ("ignored": members that are no sample's; any other name
    is the kind's, shown in the summary); `wanted(name)`: whether the scan reads a member's bytes
    (`ArchiveMember.data`) for the finder to check. `help`: the `index KIND` subcommand's help;
    `what`: the archives, as `index`'s help names them."""

    samples: Callable[[str, Iterator[ArchiveMember], list[dict[str, str]], collections.Counter[str]],
                      list[tuple[str, Members]]]
    wanted: Callable[[str], bool]
    help: str
    what: str


def skip(url: str, member: str, key: str, reason: str) -> dict[str, str]:
    """A skipped input's entry: the archive's member, the sample's key, and why."""
    return {"source": f"{url}:{shown(member)}", "key": shown(key), "reason": f"{url}:{shown(member)}: {reason}"}


def shown(name: str) -> str:
    """A name for a message: whole up to 100 characters (a tar header's), else cut there, its length said
    (a pax or GNU long name may have any number)."""
    return name if len(name) <= 100 else f"{name[:100]}... ({len(name)} characters)"


def flat_members(url: str, scanned: Iterator[ArchiveMember], skipped: list[dict[str, str]],
                 counts: collections.Counter[str]) -> Iterator[tuple[ArchiveMember, str, str]]:
    """(member, key, extension) of each regular file with a flat name; the rest skipped or ignored."""
    for member in scanned:
        name = member.name.removeprefix("./")
        key, dot, ext = name.partition(".")
        if member.directory:
            counts["ignored"] += 1
        elif member.problem is not None or "/" in name or not dot:
            why = member.problem or ("in a folder inside the archive: only flat names are indexed" if "/" in name
                                     else "no extension")
            skipped.append(skip(url, member.name, key, why))
        else:
            yield member, key, ext
