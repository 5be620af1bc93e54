"""The split index: where the plan's items (samples, or units of samples) are, by shard, and the
pure grouping of a batch's items into the samples to read and what to decode of each.

Samples are numbered over a split's shards in order; the plan's items (units, or samples when the
kind yields each sample once) likewise. Each sample's key, span and units come from its shard's
index (`format.ShardIndex`), fetched by the worker that reads the shard."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from pipeline.format import Manifest, Split

__all__ = ["SplitIndex", "Where", "locate", "group"]

Where = tuple[int, int]  # a sample: (source, sample number in the source's split)
_SAMPLE_BITS = 40  # (source, sample) packed in one int64 for np.unique


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


def locate(index: SplitIndex, items: np.ndarray,
           unit_starts: Callable[[list[int]], Mapping[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(sample number, unit within the sample) of each plan item. `unit_starts(shards)` gives, for
    each shard the items touch, its samples' first units (`ShardIndex.unit_starts`; the reader
    fetches those indexes then, all at once)."""
    shard = index.shards_of(items)
    local = items - index.first_item[shard]
    samples, units = np.empty_like(items), np.zeros_like(items)
    touched = np.unique(shard).tolist()
    starts_of = unit_starts(touched)
    for i in touched:
        at = shard == i
        if index.by_units:
            starts = starts_of[i]
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
