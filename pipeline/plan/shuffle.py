"""Shuffles: one source's epoch order, from the table `SHUFFLES` of pure functions.

A shuffle maps (shard sizes, entropy, window) to an `Order`: positions of the epoch -> global sample
ids (shard-major numbering). "shards-then-window" (`shuffle=True`) permutes the shards, then the
samples within consecutive windows of `window` samples of that sequence (locality: a window touches
few shards); "shards-then-blocks" permutes blocks of `BLOCK` consecutive samples in those windows
(a block is read by range in one request, at the cost of mixing within a batch). Seeds come from
`numpy.random.SeedSequence` over (entropy, purpose, window), purposes from `pipeline.seeds`: no
global state.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import numpy as np

from pipeline.errors import ConfigError
from pipeline.seeds import Purpose

__all__ = ["BLOCK", "Order", "Shuffle", "SHUFFLES", "shuffle_name", "get_shuffle", "epoch_order"]

BLOCK = 8  # samples that "shards-then-blocks" keeps together

Order = Callable[[np.ndarray], np.ndarray]  # positions of an epoch -> global sample ids (shard-major numbering)
Shuffle = Callable[[Sequence[int], Sequence[int], int], Order]  # (shard sizes, entropy, window) -> an order


def _in_order(sizes: Sequence[int], entropy: Sequence[int], window: int) -> Order:
    """No shuffle: the samples as numbered."""
    return lambda positions: np.asarray(positions, dtype=np.int64).copy()


class _ShardsThenWindow:
    """The shards permuted, then samples permuted within consecutive windows of `window` samples of
    that sequence (a window touches few shards). The shard permutation is computed once and the last
    windows' permutations kept: a lazy plan asks for one chunk of positions at a time."""

    def __init__(self, sizes: Sequence[int], entropy: Sequence[int], window: int) -> None:
        self.entropy, self.window = list(entropy), window
        counts = np.asarray(sizes, dtype=np.int64)
        self.total = int(counts.sum())
        self.shard_order = np.random.default_rng([*entropy, Purpose.SHARD_ORDER]).permutation(counts.size)
        self.first_id = np.concatenate(([0], np.cumsum(counts)[:-1]))
        self.seq_start = np.concatenate(([0], np.cumsum(counts[self.shard_order])[:-1]))
        self.windows: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def _window_permutation(self, w: int) -> np.ndarray:
        if w not in self.windows:
            self.windows[w] = self._draw(w, min(self.window, self.total - w * self.window))
            if len(self.windows) > 4:
                self.windows.popitem(last=False)
        return self.windows[w]

    def _draw(self, w: int, size: int) -> np.ndarray:
        """Window `w`'s permutation of its `size` samples."""
        return np.random.default_rng([*self.entropy, Purpose.WINDOW_ORDER, w]).permutation(size)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size == 0:
            return positions.copy()
        windows = positions // self.window
        order = np.argsort(windows, kind="stable")
        sequence = np.empty_like(positions)  # position in the shard-permuted sequence of all samples
        for group in np.split(order, np.flatnonzero(np.diff(windows[order])) + 1):
            w = int(windows[group[0]])
            sequence[group] = w * self.window + self._window_permutation(w)[positions[group] - w * self.window]
        shard = np.searchsorted(self.seq_start, sequence, side="right") - 1  # skips empty shards
        return self.first_id[self.shard_order[shard]] + sequence - self.seq_start[shard]


class _ShardsThenBlocks(_ShardsThenWindow):
    """As "shards-then-window", but a window permutes blocks of `BLOCK` consecutive samples of the
    shard-permuted sequence (the samples of a block permuted among themselves): an aligned batch of
    `BLOCK` is one block, neighbours in a shard, so reading by range merges it into one span. Less
    mixing: a batch's samples come from one shard (two where a block spans a shard's end)."""

    def _draw(self, w: int, size: int) -> np.ndarray:
        rng = np.random.default_rng([*self.entropy, Purpose.BLOCK_ORDER, w])
        place = rng.permutation(-(-size // BLOCK))  # each block's place in the window
        return np.lexsort((rng.random(size), place[np.arange(size) // BLOCK]))


# The shuffles, by name. A new shuffle is a function here (or a module beside this one) and an entry in
# this table; it must be a permutation that depends on its arguments only.
SHUFFLES: dict[str, Shuffle] = {
    "none": _in_order,
    "shards-then-window": _ShardsThenWindow,
    "shards-then-blocks": _ShardsThenBlocks,
}


def shuffle_name(shuffle: bool | str) -> str:
    """The table's name for a `shuffle` setting: True is "shards-then-window", False is "none"."""
    name = ("shards-then-window" if shuffle else "none") if isinstance(shuffle, bool) else shuffle
    if name not in SHUFFLES:
        raise ConfigError(f"shuffle must be True, False or one of {sorted(SHUFFLES)}, got {shuffle!r}")
    return name  # type: ignore[return-value]


def get_shuffle(shuffle: bool | str) -> Shuffle:
    """The shuffle of this name (or True/False, see `shuffle_name`)."""
    return SHUFFLES[shuffle_name(shuffle)]


def epoch_order(sizes: Sequence[int], entropy: Sequence[int], shuffle: bool | str, window: int,
                positions: np.ndarray) -> np.ndarray:
    """Global sample ids (shard-major numbering) at the given positions of one source's order for
    `entropy` ((seed, epoch), or (seed, epoch, source, pass) when mixing)."""
    return get_shuffle(shuffle)(sizes, entropy, window)(positions)

