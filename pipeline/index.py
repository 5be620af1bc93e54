"""The split index: where the plan's items (samples, or units of samples) are, by shard, and the
pure grouping of a batch's items into the samples to read and what to decode of each.

Samples are numbered over a split's shards in order; the plan's items (units, or samples when the
kind yields each sample once) likewise. Each sample's key, span and units come from its shard's
index (`format.ShardIndex`), fetched by the worker that reads the shard; a sample's whole location
(`Located`) is resolved once from them, here, without I/O, and flows down to the readers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipeline.format import Manifest, ShardIndex, ShardInfo, Split
from pipeline.storage.fs import shard_url
from pipeline.tario import BLOCK

__all__ = ["Located", "MEMBER_GAP", "Members", "SplitIndex", "Where", "group", "locate", "member_ranges", "resolve",
           "row_order"]

Where = tuple[int, int]  # a sample: (source, sample number in the source's split)
Members = list[tuple[str, int, int]]  # (extension, header offset, data bytes) of each, in shard order
_SAMPLE_BITS = 40  # (source, sample) packed in one int64 for np.unique

# Members of a sample this far apart or more are read by separate ranges. A range request costs
# about as much as 1 MiB of transfer from object storage (~10-20 ms of latency at ~50-100 MB/s),
# so a sample costs at most its own bytes plus a gap under 1 MiB between two members read together.
MEMBER_GAP = 1 << 20


@dataclasses.dataclass(frozen=True, eq=False)
class SplitIndex:
    """One dataset's split as the planner and the reader need it: per-shard counts only."""

    root: str
    split: Split
    by_units: bool  # the plan orders each sample's units (else: samples)
    sizes: np.ndarray  # the plan's items per shard
    first_sample: np.ndarray  # each shard's first sample, then the split's sample count
    first_item: np.ndarray  # each shard's first plan item, then the item count

    @classmethod
    def of(cls, root: str, manifest: Manifest, split: str, by_units: bool) -> SplitIndex:
        shards = manifest.splits[split]
        sizes = shards.unit_counts if by_units else shards.sample_counts
        return cls(root, shards, by_units, sizes, np.concatenate(([0], np.cumsum(shards.sample_counts))),
                   np.concatenate(([0], np.cumsum(sizes))))

    def where(self, sample: int) -> tuple[int, int]:
        """(shard, index in the shard) of a sample."""
        shard = int(np.searchsorted(self.first_sample, sample, side="right")) - 1
        return shard, sample - int(self.first_sample[shard])

    def shards_of(self, items: np.ndarray) -> np.ndarray:
        """The shard of each plan item."""
        return np.searchsorted(self.first_item, items, side="right") - 1


@dataclasses.dataclass(frozen=True, slots=True)
class Located:
    """Where a sample is, resolved once (`resolve`) and handed to the readers: its shard (name, size,
    digest) and URL, its key, units, and the byte ranges that read it, each with its members (None:
    an index without members, one range)."""

    where: Where
    shard: ShardInfo
    url: str
    key: str
    units: int
    ranges: tuple[tuple[int, int, Members | None], ...]


def member_ranges(members: Members, gap: int = MEMBER_GAP) -> list[tuple[int, int, Members]]:
    """The byte ranges [start, end) that read a sample's members (in shard order), each with the
    members it holds: neighbours less than `gap` bytes apart share a range, others get their own."""
    ranges: list[tuple[int, int, Members]] = []
    for member in members:
        start, end = member[1], member[1] + BLOCK + member[2] + (-member[2] % BLOCK)
        if ranges and start - ranges[-1][1] < gap:
            ranges[-1] = (ranges[-1][0], end, [*ranges[-1][2], member])
        else:
            ranges.append((start, end, [member]))
    return ranges


def resolve(index: SplitIndex, where: Where, shard_indexes: Mapping[int, ShardIndex]) -> Located:
    """A sample's location, from its split and its shard's index (one of `shard_indexes`, by shard)."""
    shard, at = index.where(where[1])
    info, shard_index = index.split[shard], shard_indexes[shard]
    members = shard_index.sample_members(at) if shard_index.members is not None else None
    ranges = member_ranges(members) if members is not None else [(*shard_index.span(at), None)]
    return Located(where, info, shard_url(index.root, info.name), shard_index.key(at), int(shard_index.units[at]),
                   tuple(ranges))


def locate(index: SplitIndex, items: np.ndarray,
           unit_starts: Mapping[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sample number, unit within the sample) of each plan item. `unit_starts`: for each shard the
    items touch, its samples' first units (`ShardIndex.unit_starts`; needed when the plan orders units)."""
    shard = index.shards_of(items)
    local = items - index.first_item[shard]
    samples, units = np.empty_like(items), np.zeros_like(items)
    for i in np.unique(shard).tolist():
        at = shard == i
        if index.by_units:
            starts = unit_starts[i]
            within = np.searchsorted(starts, local[at], side="right") - 1
            units[at] = local[at] - starts[within]
        else:
            within = local[at]
        samples[at] = index.first_sample[i] + within
    return samples, units


def group(sources: np.ndarray, samples: np.ndarray, units: np.ndarray,
          grouped: bool) -> tuple[list[Where], list[tuple[Where, Any]]]:
    """A batch's samples, in order of first use, and what to decode: (sample, unit) for each item in
    plan order, or for a `grouped` kind, (sample, array of its units) for each sample."""
    codes = sources << _SAMPLE_BITS | samples
    unique, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    appearance = np.argsort(first)
    mask = (1 << _SAMPLE_BITS) - 1
    wheres = [(code >> _SAMPLE_BITS, code & mask) for code in unique[appearance].tolist()]
    if not grouped:
        return wheres, list(zip(zip(sources.tolist(), samples.tolist()), units.tolist()))
    rank = np.empty_like(appearance)
    rank[appearance] = np.arange(len(appearance))
    order = rank[inverse.reshape(-1)]
    ends = np.cumsum(np.bincount(order)).tolist()
    together = units[np.argsort(order, kind="stable")]
    return wheres, [(where, together[start:end]) for where, start, end in zip(wheres, [0] + ends, ends)]


def row_order(sources: np.ndarray, samples: np.ndarray, grouped: bool) -> np.ndarray:
    """A batch's plan items (by position) in the order of its rows: plan order, or for a `grouped`
    kind each sample's items together, samples in order of first use (as `group` gives them)."""
    if not grouped:
        return np.arange(len(samples))
    _, first, inverse = np.unique(sources << _SAMPLE_BITS | samples, return_index=True, return_inverse=True)
    return np.argsort(first[inverse.reshape(-1)], kind="stable")
