"""Mixing (`Mix`): several sources, each giving an exact share of the epoch, interleaved at random.

The epoch is cut into windows of `_MIX_WINDOW` positions; a binary tree over the windows splits
each node's per-source counts between its halves by a multivariate hypergeometric draw seeded by
the node, and each window permutes its labels. That is a uniformly random arrangement of the
epoch's labels (as a whole-epoch permutation would be), and any window's labels and the counts
before it cost O(log windows) draws. (Before this scheme, the order permuted all the epoch's
labels at once; mixed orders of that version differ from this one's.)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipeline.errors import ConfigError, PlanError
from pipeline.plan.shuffle import Order, get_shuffle, shuffle_name
from pipeline.seeds import MixStep, Purpose

__all__ = ["Mix", "MixedOrder", "epoch_samples", "mixed_order"]

_MIX_WINDOW = 4096  # positions per mixing window (part of the mixed order: changing it changes the order)
_HYPERGEOMETRIC_LIMIT = 10**9  # numpy's bound on each of ngood and nbad


@dataclasses.dataclass(frozen=True)
class Mix:
    """Several sources in one epoch: source s gives exactly `counts[s]` samples, interleaved at random.

    Within its share a source yields each sample once per pass over it; a share larger than the
    source cycles through further passes, each in a fresh order."""

    counts: tuple[int, ...]

    @classmethod
    def of(cls, sizes: Sequence[int], weights: Sequence[float] | None, epoch_size: int | None) -> Mix:
        """Shares for sources of `sizes` samples. Without weights, every sample once (concatenation);
        with weights, `epoch_size` samples (default: the most that exhausts no source) split by the
        largest-remainder rule, so the shares match the weights to within one sample."""
        if weights is None:
            if epoch_size is not None:
                raise ConfigError("epoch_size needs weights")
            return cls(tuple(sizes))
        w = np.asarray(weights, dtype=np.float64)
        if len(w) != len(sizes) or not (np.isfinite(w).all() and (w > 0).all()):
            raise ConfigError(f"weights must be {len(sizes)} positive numbers, got {list(weights)}")
        w = w / w.sum()
        if epoch_size is None:
            epoch_size = int(min(np.floor(n / f + 1e-9) for n, f in zip(sizes, w)))
        if epoch_size < 0 or any(n == 0 for n in sizes):
            raise PlanError(f"cannot mix sources of sizes {list(sizes)} into {epoch_size} samples")
        exact = epoch_size * w
        counts = np.floor(exact).astype(np.int64)
        counts[np.argsort(-(exact - counts), kind="stable")[: epoch_size - int(counts.sum())]] += 1
        return cls(tuple(int(c) for c in counts))


def epoch_samples(sources: Sequence[Sequence[int]], mix: Mix | None) -> int:
    """Samples in an epoch, before the split over ranks: the one source's, or the mix's shares."""
    return sum(mix.counts) if mix else sum(sources[0])


def _split_counts(rng: np.random.Generator, colors: np.ndarray, n: int) -> np.ndarray:
    """How many of each color `n` draws without replacement take from `colors`: a multivariate
    hypergeometric draw, color by color. Past numpy's bound (10**9 of a kind) a clipped binomial
    stands in: the counts stay exact, the law is then only close to hypergeometric."""
    taken = np.zeros(colors.size, np.int64)
    rest = int(colors.sum())
    for s, good in enumerate(colors.tolist()):
        rest -= good
        if n == 0:
            break
        if not rest:
            taken[s] = n
            break
        if good < _HYPERGEOMETRIC_LIMIT and rest < _HYPERGEOMETRIC_LIMIT:
            x = int(rng.hypergeometric(good, rest, n))
        else:
            x = min(max(int(rng.binomial(n, good / (good + rest))), n - rest), good, n)
        taken[s] = x
        n -= x
    return taken


class MixedOrder:
    """The epoch's mixed order (see the module docstring), its tree nodes, last windows and
    sources' orders kept between calls."""

    def __init__(self, sources: Sequence[Sequence[int]], mix: Mix, seed: int, epoch: int, shuffle: bool | str,
                 window: int) -> None:
        self.sources, self.seed, self.epoch, self.window = sources, seed, epoch, window
        self.shuffle, self.order = shuffle_name(shuffle) != "none", get_shuffle(shuffle)
        self.counts = np.asarray(mix.counts, np.int64)
        self.total = int(self.counts.sum())
        self.sizes = [sum(s) for s in sources]
        self.windows = -(-self.total // _MIX_WINDOW)
        self.nodes: collections.OrderedDict[tuple[int, int], np.ndarray] = collections.OrderedDict()
        self.labels: collections.OrderedDict[int, tuple[np.ndarray, np.ndarray]] = collections.OrderedDict()
        self.orders: collections.OrderedDict[tuple[int, int], Order] = collections.OrderedDict()

    @staticmethod
    def _cached(cache: collections.OrderedDict[Any, Any], key: object, limit: int, make: Callable[..., Any],
                *args: object) -> Any:
        """cache[key], made by make(*args) if absent; the `limit` last used kept."""
        if key in cache:
            cache.move_to_end(key)
        else:
            cache[key] = make(*args)
            if len(cache) > limit:
                cache.popitem(last=False)
        return cache[key]

    def _left_counts(self, lo: int, hi: int, counts: np.ndarray, size: int) -> np.ndarray:
        """Per-source counts of the first `size` positions of the tree node over windows [lo, hi)."""
        rng = np.random.default_rng([self.seed, self.epoch, Purpose.MIX_ORDER, MixStep.SPLIT, lo, hi])
        return _split_counts(rng, counts, size)

    def _window_labels(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, how many of that source come before in the epoch) at each position of window w."""
        lo, hi, counts, before = 0, self.windows, self.counts, np.zeros_like(self.counts)
        while hi - lo > 1:  # down the tree: each node splits its counts between its halves
            mid = (lo + hi) // 2
            size = min(mid * _MIX_WINDOW, self.total) - lo * _MIX_WINDOW
            left = self._cached(self.nodes, (lo, hi), 256, self._left_counts, lo, hi, counts, size)
            if w < mid:
                counts, hi = left, mid
            else:
                counts, before, lo = counts - left, before + left, mid
        labels = np.repeat(np.arange(self.counts.size), counts)
        rng = np.random.default_rng([self.seed, self.epoch, Purpose.MIX_ORDER, MixStep.LABELS, w])
        labels = rng.permutation(labels)
        order = np.argsort(labels, kind="stable")
        index_in_source = np.empty(labels.size, np.int64)
        index_in_source[order] = np.arange(labels.size) - np.repeat(np.cumsum(counts) - counts - before, counts)
        return labels, index_in_source

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, how many of that source come before) at the given positions of the epoch."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:  # the sources one after another
            ends = np.cumsum(self.counts)
            source = np.searchsorted(ends, positions, side="right")
            return source, positions - (ends - self.counts)[source]
        source, index_in_source = np.empty_like(positions), np.empty_like(positions)
        windows = positions // _MIX_WINDOW
        order = np.argsort(windows, kind="stable")
        for group in np.split(order, np.flatnonzero(np.diff(windows[order])) + 1) if order.size else []:
            w = int(windows[group[0]])
            labels, before = self._cached(self.labels, w, 4, self._window_labels, w)
            within = positions[group] - w * _MIX_WINDOW
            source[group], index_in_source[group] = labels[within], before[within]
        return source, index_in_source

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        source, index_in_source = self.locate(positions)
        ids = np.empty(source.size, dtype=np.int64)
        for s in np.unique(source).tolist():
            mine = np.flatnonzero(source == s)
            passes = index_in_source[mine] // self.sizes[s]
            for run in np.unique(passes).tolist():
                sel = mine[passes == run]
                order = self._cached(self.orders, (s, run), 2 * len(self.sources), self.order, self.sources[s],
                                     [self.seed, self.epoch, s, run], self.window)
                ids[sel] = order(index_in_source[sel] % self.sizes[s])
        return source, ids


def mixed_order(sources: Sequence[Sequence[int]], mix: Mix, seed: int, epoch: int, shuffle: bool | str, window: int,
                positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, sample id within it) at the given positions of the epoch's mixed order."""
    return MixedOrder(sources, mix, seed, epoch, shuffle, window)(positions)

