"""The epoch plan: which samples each rank and DataLoader worker reads, in which order. Pure.

`plan_epoch(sizes, seed, epoch, world, ...)` decides everything that must agree across processes:
- Order: a shuffle from the table `SHUFFLES`. With `shuffle=True` ("shards-then-window"), the shards
  are permuted, then samples are permuted within consecutive windows of `window` samples of that
  sequence (locality: a window touches few shards). Seeds come from `numpy.random.SeedSequence`
  over (seed, epoch, purpose, window) (purposes: `pipeline.seeds`): no global state.
- Ranks: rank r takes a contiguous span of the order, cut into batches. Every rank gets the same
  number of batches (DDP needs it). `drop_last=True` drops the tail of the order that does not
  fill a batch on every rank (fewer than world_size * batch_size samples); `drop_last=False`
  keeps every sample exactly once, so the last one or two batches of a rank may be short.
- Workers: worker w of W yields the rank's batches w, w + W, ... The DataLoader takes batches
  from its workers round-robin, so a rank yields the same batches in the same order for any
  number of workers (and for persistent or fresh workers).
- Mixing (`Mix`): several sources, each giving an exact share of the epoch, interleaved at random.
  The epoch is cut into windows of `_MIX_WINDOW` positions; a binary tree over the windows splits
  each node's per-source counts between its halves by a multivariate hypergeometric draw seeded
  by the node, and each window permutes its labels. That is a uniformly random arrangement of the
  epoch's labels (as a whole-epoch permutation would be), and any window's labels and the counts
  before it cost O(log windows) draws. (Before this scheme, the order permuted all the epoch's
  labels at once; mixed orders of that version differ from this one's.)
- Resumption: an epoch's history of `Resume` stretches. The same world continues each rank's
  own batches; another world size splits the positions no rank had taken over the new world.

Cost: the positions still untaken after a history are a few sorted runs (a stretch in a world of
W ranks cuts at most W spans out of them), a rank's batches are (first index, full batches, a
tail of at most two sizes), and `plan_epoch` returns a lazy sequence that computes its batches a
chunk at a time. So a worker's plan costs time in proportion to what it yields and memory of a
chunk, plus O(shards + history x world sizes), never O(epoch).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from pipeline.errors import PlanError
from pipeline.seeds import MixStep, Purpose

__all__ = [
    "World", "Resume", "Mix", "PlanError", "rank_batch_sizes", "rank_batch_count", "rank_sample_count",
    "rank_positions", "epoch_order", "epoch_samples", "mixed_order", "plan_epoch", "SHUFFLES", "get_shuffle",
    "shuffle_name",
]

_MIX_WINDOW = 4096  # positions per mixing window (part of the mixed order: changing it changes the order)
_CHUNK = 8192  # positions a lazy plan computes at once
_HYPERGEOMETRIC_LIMIT = 10**9  # numpy's bound on each of ngood and nbad

Item = tuple[int, np.ndarray, np.ndarray]


@dataclasses.dataclass(frozen=True)
class World:
    """Where this iterator runs: distributed rank and DataLoader worker (num_workers=1 in-process)."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} not in [0, world_size={self.world_size})")
        if not 0 <= self.worker < self.num_workers:
            raise ValueError(f"worker {self.worker} not in [0, num_workers={self.num_workers})")


def _first(total: int, world_size: int, ranks: np.ndarray, batch_size: int, drop_last: bool) -> np.ndarray:
    """First position of each of `ranks`' spans."""
    if drop_last:
        return ranks * (total // (world_size * batch_size) * batch_size)
    share, extra = divmod(total, world_size)
    return ranks * share + np.minimum(ranks, extra)


def _layout(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool) -> tuple[int, int, tuple[int, ...]]:
    """(first position, full batches, sizes of the at most two batches after them) of `rank`'s span."""
    start = int(_first(total, world_size, np.int64(rank), batch_size, drop_last))
    if drop_last:
        return start, total // (world_size * batch_size), ()
    share, extra = divmod(total, world_size)
    count = share + (rank < extra)
    batches = -(-(share + (extra > 0)) // batch_size)  # the largest rank's batch count
    if batches == 0:
        return 0, 0, ()
    last = count - (batches - 1) * batch_size
    if last == 0:  # a smaller rank: lend its last batch one sample from the one before
        if batches < 2 or batch_size < 2:
            raise PlanError(
                f"{total} samples cannot be split over {world_size} ranks in equal numbers of batches "
                f"of at most {batch_size} without dropping or repeating samples; use drop_last=True"
            )
        return start, batches - 2, (batch_size - 1, 1)
    return start, batches - 1, (last,)


def _offset(batch: int, full: int, tail: tuple[int, ...], batch_size: int) -> int:
    """Samples in a rank's batches before `batch`."""
    return batch * batch_size if batch <= full else full * batch_size + sum(tail[: batch - full])


def rank_batch_sizes(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool) -> tuple[int, list[int]]:
    """(first position, batch sizes) of `rank`'s contiguous span of the epoch order."""
    start, full, tail = _layout(total, world_size, rank, batch_size, drop_last)
    return start, [batch_size] * full + list(tail)


Order = Callable[[np.ndarray], np.ndarray]  # positions of an epoch -> global sample ids (shard-major numbering)


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
        self.perm = np.random.default_rng([*entropy, Purpose.SHARD_ORDER]).permutation(counts.size)
        self.first_id = np.concatenate(([0], np.cumsum(counts)[:-1]))
        self.seq_start = np.concatenate(([0], np.cumsum(counts[self.perm])[:-1]))
        self.windows: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def _within(self, w: int) -> np.ndarray:
        if w not in self.windows:
            rng = np.random.default_rng([*self.entropy, Purpose.WINDOW_ORDER, w])
            self.windows[w] = rng.permutation(min(self.window, self.total - w * self.window))
            if len(self.windows) > 4:
                self.windows.popitem(last=False)
        return self.windows[w]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size == 0:
            return positions.copy()
        windows = positions // self.window
        order = np.argsort(windows, kind="stable")
        sequence = np.empty_like(positions)  # position in the shard-permuted sequence of all samples
        for group in np.split(order, np.flatnonzero(np.diff(windows[order])) + 1):
            w = int(windows[group[0]])
            sequence[group] = w * self.window + self._within(w)[positions[group] - w * self.window]
        shard = np.searchsorted(self.seq_start, sequence, side="right") - 1  # skips empty shards
        return self.first_id[self.perm[shard]] + sequence - self.seq_start[shard]


# The shuffles, by name: (shard sizes, entropy, window) -> one source's epoch order. A new shuffle is a
# function here and an entry in this table; it must be a permutation that depends on its arguments only.
SHUFFLES: dict[str, Callable[[Sequence[int], Sequence[int], int], Order]] = {
    "none": _in_order,
    "shards-then-window": _ShardsThenWindow,
}


def shuffle_name(shuffle: bool | str) -> str:
    """The table's name for a `shuffle` setting: True is "shards-then-window", False is "none"."""
    name = ("shards-then-window" if shuffle else "none") if isinstance(shuffle, bool) else shuffle
    if name not in SHUFFLES:
        raise ValueError(f"shuffle must be True, False or one of {sorted(SHUFFLES)}, got {shuffle!r}")
    return name  # type: ignore[return-value]


def get_shuffle(shuffle: bool | str) -> Callable[[Sequence[int], Sequence[int], int], Order]:
    """The shuffle of this name (or True/False, see `shuffle_name`)."""
    return SHUFFLES[shuffle_name(shuffle)]


def epoch_order(sizes: Sequence[int], entropy: Sequence[int], shuffle: bool | str, window: int,
                positions: np.ndarray) -> np.ndarray:
    """Global sample ids (shard-major numbering) at the given positions of one source's order for
    `entropy` ((seed, epoch), or (seed, epoch, source, pass) when mixing)."""
    return get_shuffle(shuffle)(sizes, entropy, window)(positions)


@dataclasses.dataclass(frozen=True)
class Resume:
    """One stretch of an epoch run in one world: every rank of `world_size` took `batches` batches."""

    world_size: int
    batches: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.batches < 0:
            raise ValueError(f"invalid resume point {self}")


def _keep(starts: np.ndarray, cum: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The runs (starts, prefix lengths) of the positions at indices [lo[i], hi[i]) (sorted, disjoint)
    of the sequence that the runs `starts`, `cum` describe."""
    nonempty = hi > lo
    lo, hi = lo[nonempty], hi[nonempty]
    cuts = np.sort(np.concatenate([cum, lo, hi]))
    cuts = cuts[np.concatenate(([True], cuts[1:] != cuts[:-1]))]
    a, b = cuts[:-1], cuts[1:]  # pieces that lie in one run and in or out of one interval
    k = np.searchsorted(lo, a, side="right") - 1
    inside = (k >= 0) & (a < hi[np.maximum(k, 0)] if hi.size else np.zeros(a.size, bool))
    a, b = a[inside], b[inside]
    if not a.size:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    run = np.searchsorted(cum, a, side="right") - 1
    pos, length = starts[run] + a - cum[run], b - a
    new = np.ones(pos.size, bool)
    new[1:] = pos[1:] != pos[:-1] + length[:-1]  # joins pieces that continue each other
    first = np.flatnonzero(new)
    return pos[first], np.concatenate(([0], np.cumsum(np.add.reduceat(length, first))))


@dataclasses.dataclass(frozen=True)
class _Span:
    """A rank's batches after a history: the remaining positions as runs (`starts`, prefix lengths
    `cum`), and in that sequence the rank's layout from index `first`, less the `skip` batches
    already taken."""

    starts: np.ndarray
    cum: np.ndarray
    first: int
    full: int
    tail: tuple[int, ...]
    skip: int
    batch_size: int

    @property
    def batches(self) -> int:
        return self.full + len(self.tail) - self.skip

    @property
    def samples(self) -> int:
        end, skip = (_offset(j, self.full, self.tail, self.batch_size) for j in (self.full + len(self.tail), self.skip))
        return end - skip

    def offsets(self, batches: np.ndarray) -> np.ndarray:
        """Index in the remaining sequence of the first sample of each of these batches (of this iteration)."""
        j = np.asarray(batches, np.int64) + self.skip
        tail = np.cumsum([0, *self.tail])
        over = self.full * self.batch_size + tail[np.clip(j - self.full, 0, len(self.tail))]
        return self.first + np.where(j <= self.full, j * self.batch_size, over)

    def positions(self, batches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epoch-order positions of these batches' samples, one after another; each batch's size)."""
        begin = self.offsets(batches)
        sizes = self.offsets(np.asarray(batches, np.int64) + 1) - begin
        ends = np.cumsum(sizes)
        index = np.repeat(begin - (ends - sizes), sizes) + np.arange(int(ends[-1]) if ends.size else 0)
        run = np.searchsorted(self.cum, index, side="right") - 1
        return self.starts[run] + index - self.cum[run], sizes


def _rank_span(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool,
               history: Sequence[Resume]) -> _Span:
    """`rank`'s batches after the epoch's `history` (see `rank_positions`), as arithmetic on runs."""
    starts, cum = np.zeros(min(total, 1), np.int64), np.array([0, total] if total else [0], np.int64)
    for i, stretch in enumerate(history):
        n, size = int(cum[-1]), stretch.world_size
        took = []  # samples each kind of rank took: the larger ranks (from 0), the smaller (to the last)
        for r in (0, size - 1):  # (the last rank fails to split if any does)
            _, full, tail = _layout(n, size, r, batch_size, drop_last)
            if stretch.batches > full + len(tail):
                raise PlanError(f"cannot resume after batch {stretch.batches}: "
                                f"the epoch has {full + len(tail)} batches per rank")
            took.append(_offset(stretch.batches, full, tail, batch_size))
        if i == len(history) - 1 and size == world_size:
            return _Span(starts, cum, *_layout(n, world_size, rank, batch_size, drop_last), stretch.batches, batch_size)
        ranks = np.arange(size, dtype=np.int64)
        first = _first(n, size, ranks, batch_size, drop_last)
        taken = np.where(ranks < (0 if drop_last else n % size), took[0], took[1])
        first, end = first[taken > 0], (first + taken)[taken > 0]
        starts, cum = _keep(starts, cum, np.concatenate(([0], end)), np.concatenate((first, [n])))
    return _Span(starts, cum, *_layout(int(cum[-1]), world_size, rank, batch_size, drop_last), 0, batch_size)


def rank_batch_count(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool,
                     history: Sequence[Resume] = ()) -> int:
    """Batches `rank` yields after the epoch's `history` (O(history x world sizes), no per-sample work)."""
    return int(_rank_span(total, world_size, rank, batch_size, drop_last, history).batches)


def rank_sample_count(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool,
                      history: Sequence[Resume] = ()) -> int:
    """Samples `rank` yields after the epoch's `history` (O(history x world sizes), no per-sample work)."""
    return int(_rank_span(total, world_size, rank, batch_size, drop_last, history).samples)


def rank_positions(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool,
                   history: Sequence[Resume] = ()) -> list[np.ndarray]:
    """The epoch-order positions of each batch `rank` yields, in order, after the epoch's `history`.

    Each stretch of the history split the positions still remaining over its world and took the
    first `batches` batches of every rank. Resuming in the world of the last stretch, a rank
    yields the rest of its own batches: exactly what an uninterrupted run would have. In another
    world, the remaining positions are split afresh, by the same rules (equal batch counts).
    Materialises the rank's positions: for tests and small epochs (`plan_epoch` does not).
    """
    span = _rank_span(total, world_size, rank, batch_size, drop_last, history)
    positions, sizes = span.positions(np.arange(span.batches))
    bounds = np.concatenate(([0], np.cumsum(sizes))).tolist()
    return [positions[bounds[k] : bounds[k + 1]] for k in range(span.batches)]


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
                raise ValueError("epoch_size needs weights")
            return cls(tuple(sizes))
        w = np.asarray(weights, dtype=np.float64)
        if len(w) != len(sizes) or not (np.isfinite(w).all() and (w > 0).all()):
            raise ValueError(f"weights must be {len(sizes)} positive numbers, got {list(weights)}")
        w = w / w.sum()
        if epoch_size is None:
            epoch_size = int(min(np.floor(n / f + 1e-9) for n, f in zip(sizes, w)))
        if epoch_size < 0 or any(n == 0 for n in sizes):
            raise ValueError(f"cannot mix sources of sizes {list(sizes)} into {epoch_size} samples")
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


class _Mixer:
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
    def _cached(cache: collections.OrderedDict, key: object, limit: int, make: Callable, *args: object) -> Any:  # type: ignore[type-arg]
        """cache[key], made by make(*args) if absent; the `limit` last used kept."""
        if key in cache:
            cache.move_to_end(key)
        else:
            cache[key] = make(*args)
            if len(cache) > limit:
                cache.popitem(last=False)
        return cache[key]

    def _split(self, lo: int, hi: int, counts: np.ndarray, size: int) -> np.ndarray:
        """Per-source counts of the first `size` positions of the tree node over windows [lo, hi)."""
        return _split_counts(np.random.default_rng([self.seed, self.epoch, Purpose.MIX_ORDER, MixStep.SPLIT, lo, hi]), counts, size)

    def _window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, how many of that source come before in the epoch) at each position of window w."""
        lo, hi, counts, before = 0, self.windows, self.counts, np.zeros_like(self.counts)
        while hi - lo > 1:  # down the tree: each node splits its counts between its halves
            mid = (lo + hi) // 2
            size = min(mid * _MIX_WINDOW, self.total) - lo * _MIX_WINDOW
            left = self._cached(self.nodes, (lo, hi), 256, self._split, lo, hi, counts, size)
            if w < mid:
                counts, hi = left, mid
            else:
                counts, before, lo = counts - left, before + left, mid
        labels = np.repeat(np.arange(self.counts.size), counts)
        labels = np.random.default_rng([self.seed, self.epoch, Purpose.MIX_ORDER, MixStep.LABELS, w]).permutation(labels)
        order = np.argsort(labels, kind="stable")
        nth = np.empty(labels.size, np.int64)
        nth[order] = np.arange(labels.size) - np.repeat(np.cumsum(counts) - counts - before, counts)
        return labels, nth

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, how many of that source come before) at the given positions of the epoch."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:  # the sources one after another
            ends = np.cumsum(self.counts)
            source = np.searchsorted(ends, positions, side="right")
            return source, positions - (ends - self.counts)[source]
        source, nth = np.empty_like(positions), np.empty_like(positions)
        windows = positions // _MIX_WINDOW
        order = np.argsort(windows, kind="stable")
        for group in np.split(order, np.flatnonzero(np.diff(windows[order])) + 1) if order.size else []:
            w = int(windows[group[0]])
            labels, before = self._cached(self.labels, w, 4, self._window, w)
            within = positions[group] - w * _MIX_WINDOW
            source[group], nth[group] = labels[within], before[within]
        return source, nth

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        source, nth = self.locate(positions)
        ids = np.empty(source.size, dtype=np.int64)
        for s in np.unique(source).tolist():
            mine = np.flatnonzero(source == s)
            passes = nth[mine] // self.sizes[s]
            for run in np.unique(passes).tolist():
                sel = mine[passes == run]
                order = self._cached(self.orders, (s, run), 2 * len(self.sources), self.order, self.sources[s],
                                     [self.seed, self.epoch, s, run], self.window)
                ids[sel] = order(nth[sel] % self.sizes[s])
        return source, ids


def mixed_order(sources: Sequence[Sequence[int]], mix: Mix, seed: int, epoch: int, shuffle: bool | str, window: int,
                positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, sample id within it) at the given positions of the epoch's mixed order."""
    return _Mixer(sources, mix, seed, epoch, shuffle, window)(positions)


class _Plan(Sequence[Item]):
    """A worker's batches (see `plan_epoch`), computed a chunk of batches at a time when asked for,
    the last two chunks kept: cheap in order with a small look-ahead, correct in any order."""

    def __init__(self, span: _Span, world: World, order: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]) -> None:
        self._span, self._worker, self._workers, self._order = span, world.worker, world.num_workers, order
        self._length = max(0, -(-(span.batches - world.worker) // world.num_workers))
        self._per_chunk = max(1, _CHUNK // span.batch_size)
        self._chunks: collections.OrderedDict[int, list[Item]] = collections.OrderedDict()

    def __len__(self) -> int:
        return self._length

    def _chunk(self, c: int) -> list[Item]:
        if c in self._chunks:
            return self._chunks[c]
        items = np.arange(c * self._per_chunk, min((c + 1) * self._per_chunk, self._length))
        batches = self._worker + items * self._workers
        positions, sizes = self._span.positions(batches)
        source, ids = self._order(positions)
        if sizes.min() == sizes.max():  # (rows of a 2-d view: twice as fast as slicing each batch)
            chunk = list(zip(batches.tolist(), source.reshape(-1, sizes[0]), ids.reshape(-1, sizes[0])))
        else:
            bounds = np.concatenate(([0], np.cumsum(sizes))).tolist()
            chunk = [(b, source[bounds[k] : bounds[k + 1]], ids[bounds[k] : bounds[k + 1]])
                     for k, b in enumerate(batches.tolist())]
        self._chunks[c] = chunk
        if len(self._chunks) > 2:
            self._chunks.popitem(last=False)
        return chunk

    @overload
    def __getitem__(self, i: int) -> Item: ...
    @overload
    def __getitem__(self, i: slice) -> list[Item]: ...
    def __getitem__(self, i: int | slice) -> Item | list[Item]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._length))]
        k = i + self._length if i < 0 else i
        if not 0 <= k < self._length:
            raise IndexError(f"batch {i} of a plan of {self._length}")
        c, j = divmod(k, self._per_chunk)
        chunk = self._chunks.get(c)
        return (self._chunk(c) if chunk is None else chunk)[j]

    def __iter__(self) -> Iterator[Item]:
        for c in range(-(-self._length // self._per_chunk)):
            yield from self._chunk(c)


def plan_epoch(
    sources: Sequence[Sequence[int]],
    seed: int,
    epoch: int,
    world: World,
    *,
    batch_size: int,
    drop_last: bool = True,
    shuffle: bool | str = True,
    window: int = 16384,
    mix: Mix | None = None,
    history: Sequence[Resume] = (),
) -> Sequence[Item]:
    """(batch index in this iteration of the rank, source of each sample, sample ids within their
    source) of each batch `world`'s worker yields. `sources` holds each source's shard sizes; one
    source needs no `mix`. A lazy sequence: its batches are computed a chunk at a time."""
    if seed < 0 or epoch < 0 or batch_size < 1 or window < 1:
        raise ValueError(f"need seed >= 0, epoch >= 0, batch_size >= 1, window >= 1; got {seed}, {epoch}, {batch_size}, {window}")
    span = _rank_span(epoch_samples(sources, mix), world.world_size, world.rank, batch_size, drop_last, history)
    order: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    if mix is None:
        single = get_shuffle(shuffle)(sources[0], [seed, epoch], window)
        order = lambda positions: (np.zeros(positions.size, np.int64), single(positions))  # noqa: E731
    else:
        order = _Mixer(sources, mix, seed, epoch, shuffle, window)
    return _Plan(span, world, order)
