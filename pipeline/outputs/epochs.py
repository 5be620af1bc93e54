"""A sidecar's epochs as its writers leave them (`pipeline.format.outputs`): its manifest, if it has
one yet (`read_outputs`), each rank's commits in an epoch folder (`committed`), and the finishing of
an epoch once every rank's share is committed (`finish_epoch`: its per-shard item indexes and its
entry in the manifest).

Finishing inverts the ranks' records (written in each rank's plan order) into per-shard indexes (in
item order). Its memory is bounded whatever the split's size: the records pass once through
files on local disk, one per group of shards of about `GROUP_ITEMS` items, and each group's
indexes are made from its file alone; a commit's records are held only while they are routed."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import re
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.errors import DatasetError
from pipeline.format.outputs import (
    OUTPUTS_NAME, Commit, FileRef, OutputsManifest, chunk_name, commit_name, item_index_name, pack_item_index,
)
from pipeline.storage import Retry, join, with_retries, write_bytes

__all__ = ["GROUP_ITEMS", "COMMIT_RE", "committed", "finish_epoch", "listing", "read_outputs", "shown"]

log = logging.getLogger("pipeline.outputs")
COMMIT_RE = re.compile(r"r(\d{5})-(\d{6})\.json")
GROUP_ITEMS = 1 << 21  # plan items whose indexes are made together (~100 bytes each at the peak)


def read_outputs(fs: Any, base: str, out: str, retry: Retry) -> OutputsManifest | None:
    """A sidecar's manifest, if it has one yet. (A function of the filesystem alone: fsspec keeps the
    FileNotFoundError of an absent one in a cycle with its frames, which must not hold a loader.)"""
    url, path = join(out, OUTPUTS_NAME), join(base, OUTPUTS_NAME)
    try:
        data = with_retries(retry, url, lambda: fs.cat_file(path))
    except FileNotFoundError:
        return None
    return OutputsManifest.from_bytes(data, url)


def listing(fs: Any, path: str) -> list[str]:
    """The names in a folder, listed afresh ([] where there is none)."""
    with contextlib.suppress(AttributeError):
        fs.invalidate_cache(path)  # (s3fs, gcsfs and adlfs keep listings)
    try:
        return [name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


def _commit(fs: Any, base: str, out: str, folder: str, rank: int, number: int, retry: Retry) -> Commit:
    name = commit_name(folder, rank, number)
    path = join(base, name)
    return Commit.from_bytes(with_retries(retry, join(out, name), lambda: fs.cat_file(path)), join(out, name))


def committed(fs: Any, base: str, out: str, folder: str, rank: int | None, retry: Retry,
              records: bool = True) -> list[Commit] | dict[int, list[Commit]]:
    """A rank's commits in `folder`, in order, up to the first missing one (or, `rank=None`, every
    rank's, by rank). A chunk counts only with its commit, and only if it is the size it says.
    `records` False: each commit's records left out (read again where needed: they are the epoch's)."""
    numbers: dict[int, set[int]] = {}
    for name in listing(fs, join(base, folder)):
        if (match := COMMIT_RE.fullmatch(name)) and (rank is None or int(match[1]) == rank):
            numbers.setdefault(int(match[1]), set()).add(int(match[2]))
    found: dict[int, list[Commit]] = {}
    for r, have in sorted(numbers.items()):
        commits = found.setdefault(r, [])
        while len(commits) in have:
            commit = _commit(fs, base, out, folder, r, len(commits), retry)
            try:
                size = fs.size(join(base, chunk_name(folder, r, len(commits))))
            except FileNotFoundError:
                break
            if size != commit.bytes:
                break
            commits.append(commit if records else dataclasses.replace(commit, records=np.empty((0, 4), np.int64)))
            if commit.last:
                break
    return found.get(rank, []) if rank is not None else found


class _Groups:
    """The epoch's records routed to files in `folder` by group of shards (whole shards of one
    source, about `GROUP_ITEMS` plan items a group), each row (item, chunk number, start, end)."""

    def __init__(self, sources: Sequence[Any], folder: str) -> None:
        self.bounds: list[tuple[int, int, int]] = []  # (source, first shard, end shard) of each group
        for number, source in enumerate(sources):
            first = 0
            for shard in range(len(source.sizes)):
                if shard > first and source.first_item[shard + 1] - source.first_item[first] > GROUP_ITEMS:
                    self.bounds.append((number, first, shard))
                    first = shard
            self.bounds.append((number, first, len(source.sizes)))
        self.sources, self.paths = sources, [f"{folder}/g{i}.bin" for i in range(len(self.bounds))]
        self.files = [open(path, "wb") for path in self.paths]  # noqa: SIM115 (closed by `close`)
        self.starts = [np.array([sources[n].first_item[a] for n, a, _ in self.bounds if n == number], dtype=np.int64)
                       for number in range(len(sources))]
        self.first = [sum(1 for n, _, _ in self.bounds if n < number) for number in range(len(sources))]

    def add(self, chunk: int, records: np.ndarray, url: str) -> None:
        """A chunk's records (source, item, start, end), each to its group's file."""
        source, item = records[:, 0], records[:, 1]
        group = np.full(len(records), -1, dtype=np.int64)
        for number, starts in enumerate(self.starts):
            mine = (source == number) & (item >= 0) & (item < self.sources[number].first_item[-1])
            group[mine] = np.searchsorted(starts, item[mine], side="right") - 1 + self.first[number]
        if (group < 0).any():
            bad = int(np.argmax(group < 0))
            raise DatasetError(f"a record of item {int(item[bad])} of source {int(source[bad])}, which the outputs "
                               "are not of", url=url)
        rows = np.column_stack([item, np.full(len(records), chunk), records[:, 2:]]).astype("<i8")
        for g in np.unique(group).tolist():
            self.files[g].write(rows[group == g].tobytes())

    def close(self) -> None:
        for file in self.files:
            file.close()

    def tables(self, folder: str, url: str) -> Any:
        """Per group, in order: (source, first shard, end shard, the (chunk, start, end) of each of its
        items in item order), each item's record found once."""
        self.close()
        for path, (number, first, end) in zip(self.paths, self.bounds):
            start, stop = (int(self.sources[number].first_item[i]) for i in (first, end))
            rows = np.fromfile(path, dtype="<i8").reshape(-1, 4)
            counts = np.bincount(rows[:, 0] - start, minlength=stop - start)
            if (counts != 1).any():
                bad = int(np.flatnonzero(counts != 1)[0])
                raise DatasetError(f"{folder}: item {start + bad} of source {number} was written {int(counts[bad])} "
                                   "times", url=url)
            table = np.empty((stop - start, 3), dtype=np.int64)
            table[rows[:, 0] - start] = rows[:, 1:]
            yield number, first, end, table


def finish_epoch(out: str, folder: str, of: dict[str, Any], sources: Sequence[Any], fs: Any, base: str, retry: Retry,
                 required: bool = False) -> bool:
    """An epoch folder's indexes and its entry in the manifest, once every rank's share is committed
    (each plan item once); False when some rank is not done yet (an error where `required`)."""
    ranks = committed(fs, base, out, folder, None, retry, records=False)
    assert isinstance(ranks, dict)
    world = {c.world_size for commits in ranks.values() for c in commits}
    size = world.pop() if len(world) == 1 else None
    done = size is not None and sorted(ranks) == list(range(size)) and all(c[-1].last for c in ranks.values())
    if not done:
        if required:
            raise DatasetError(f"{folder}: not every rank's share is committed ({sorted(ranks)} of {world})", url=out)
        return False
    commits = [c for r in sorted(ranks) for c in ranks[r]]
    if len({(c.fields, c.keyed) for c in commits}) != 1:
        raise DatasetError(f"{folder}: ranks wrote different output fields, or some with keys and some without",
                           url=out)
    chunks = tuple(FileRef(chunk_name(folder, c.rank, c.number), c.bytes, c.sha256) for c in commits)
    indexes: list[list[FileRef]] = [[] for _ in sources]
    with tempfile.TemporaryDirectory(prefix="shardstream-finish-") as spill:
        groups = _Groups(sources, spill)
        try:
            for number, commit in enumerate(commits):  # (each commit's records read again, one at a time)
                groups.add(number, _commit(fs, base, out, folder, commit.rank, commit.number, retry).records, out)
            for s, first, end, table in groups.tables(folder, out):
                items = sources[s].first_item
                for shard in range(first, end):
                    data = pack_item_index(table[items[shard] - items[first] : items[shard + 1] - items[first]])
                    name = item_index_name(folder, s, shard)
                    write_bytes(fs, join(base, name), data, retry)
                    indexes[s].append(FileRef(name, len(data), hashlib.sha256(data).hexdigest()))
        finally:
            groups.close()  # (also when a commit is refused: no descriptor left open)
    manifest = read_outputs(fs, base, out, retry) or OutputsManifest(of, commits[0].fields, commits[0].keyed, {})
    if (manifest.fields, manifest.keyed) != (commits[0].fields, commits[0].keyed):
        raise DatasetError(f"{folder}: fields {shown(commits[0].fields)}, the sidecar's other epochs have "
                           f"{shown(manifest.fields)} (or were written with keys where these were not)", url=out)
    epochs = {**manifest.epochs, folder: (chunks, tuple(tuple(refs) for refs in indexes))}
    write_bytes(fs, join(base, OUTPUTS_NAME), dataclasses.replace(manifest, epochs=epochs).to_bytes(), retry)
    log.info("%s: %s finished: %d chunks, %d bytes", out, folder, len(chunks), sum(c.bytes for c in chunks))
    return True


def shown(fields: Sequence[Any]) -> str:
    return ", ".join(f"{f.name}: {f.describe()}" for f in fields)
