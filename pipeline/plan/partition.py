"""The rank partition and resumption: which positions of the epoch order each rank takes, as batches.

Rank r takes a contiguous span of the order, cut into batches. Every rank gets the same number of
batches (DDP needs it). `drop_last=True` drops the tail of the order that does not fill a batch on
every rank (fewer than world_size * batch_size samples); `drop_last=False` keeps every sample
exactly once, so the last one or two batches of a rank may be short.

Resumption: an epoch's history of `Resume` stretches. The same world continues each rank's own
batches; another world size splits the positions no rank had taken over the new world. The
positions still untaken after a history are a few sorted runs (a stretch in a world of W ranks
cuts at most W spans out of them), and a rank's batches are (first index, full batches, a tail of
at most two sizes): O(history x world sizes), never O(epoch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pipeline.errors import ConfigError, PlanError

__all__ = [
    "World", "Resume", "RankSpan", "rank_span", "rank_batch_sizes", "rank_batch_count", "rank_sample_count",
    "rank_positions",
]


@dataclasses.dataclass(frozen=True)
class World:
    """Where this iterator runs: distributed rank and DataLoader worker (num_workers=1 in-process)."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} not in [0, world_size={self.world_size})")
        if not 0 <= self.worker < self.num_workers:
            raise ConfigError(f"worker {self.worker} not in [0, num_workers={self.num_workers})")


def _span_starts(total: int, world_size: int, ranks: np.ndarray, batch_size: int, drop_last: bool) -> np.ndarray:
    """First position of each of `ranks`' spans."""
    if drop_last:
        return ranks * (total // (world_size * batch_size) * batch_size)
    share, extra = divmod(total, world_size)
    return ranks * share + np.minimum(ranks, extra)


def _span_layout(total: int, world_size: int, rank: int, batch_size: int,
                 drop_last: bool) -> tuple[int, int, tuple[int, ...]]:
    """(first position, full batches, sizes of the at most two batches after them) of `rank`'s span."""
    start = int(_span_starts(total, world_size, np.int64(rank), batch_size, drop_last))
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


def _samples_before(batch: int, full: int, tail: tuple[int, ...], batch_size: int) -> int:
    """Samples in a rank's batches before `batch`."""
    return batch * batch_size if batch <= full else full * batch_size + sum(tail[: batch - full])


def rank_batch_sizes(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool) -> tuple[int, list[int]]:
    """(first position, batch sizes) of `rank`'s contiguous span of the epoch order."""
    start, full, tail = _span_layout(total, world_size, rank, batch_size, drop_last)
    return start, [batch_size] * full + list(tail)


@dataclasses.dataclass(frozen=True)
class Resume:
    """One stretch of an epoch run in one world: every rank of `world_size` took `batches` batches."""

    world_size: int
    batches: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.batches < 0:
            raise ConfigError(f"invalid resume point {self}")


def _runs_at_indices(starts: np.ndarray, cum: np.ndarray, lo: np.ndarray,
                     hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
class RankSpan:
    """A rank's batches after a history: the remaining positions as runs (`starts`, prefix lengths
    `cum`), and in that sequence the rank's layout from index `start` (`full_batches` of
    `batch_size`, then `tail_sizes`), less the `taken` batches already taken."""

    starts: np.ndarray
    cum: np.ndarray
    start: int
    full_batches: int
    tail_sizes: tuple[int, ...]
    taken: int
    batch_size: int

    @property
    def batches(self) -> int:
        return self.full_batches + len(self.tail_sizes) - self.taken

    @property
    def samples(self) -> int:
        layout = (self.full_batches, self.tail_sizes, self.batch_size)
        return _samples_before(self.full_batches + len(self.tail_sizes), *layout) - _samples_before(self.taken, *layout)

    def offsets(self, batches: np.ndarray) -> np.ndarray:
        """Index in the remaining sequence of the first sample of each of these batches (of this iteration)."""
        j = np.asarray(batches, np.int64) + self.taken
        tail = np.cumsum([0, *self.tail_sizes])
        over = self.full_batches * self.batch_size + tail[np.clip(j - self.full_batches, 0, len(self.tail_sizes))]
        return self.start + np.where(j <= self.full_batches, j * self.batch_size, over)

    def positions(self, batches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epoch-order positions of these batches' samples, one after another; each batch's size)."""
        begin = self.offsets(batches)
        sizes = self.offsets(np.asarray(batches, np.int64) + 1) - begin
        ends = np.cumsum(sizes)
        index = np.repeat(begin - (ends - sizes), sizes) + np.arange(int(ends[-1]) if ends.size else 0)
        run = np.searchsorted(self.cum, index, side="right") - 1
        return self.starts[run] + index - self.cum[run], sizes


def rank_span(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool,
              history: Sequence[Resume]) -> RankSpan:
    """`rank`'s batches after the epoch's `history` (see `rank_positions`), as arithmetic on runs."""
    starts, cum = np.zeros(min(total, 1), np.int64), np.array([0, total] if total else [0], np.int64)
    for i, stretch in enumerate(history):
        n, size = int(cum[-1]), stretch.world_size
        took = []  # samples each kind of rank took: the larger ranks (from 0), the smaller (to the last)
        for r in (0, size - 1):  # (the last rank fails to split if any does)
            _, full, tail = _span_layout(n, size, r, batch_size, drop_last)
            if stretch.batches > full + len(tail):
                raise PlanError(f"cannot resume after batch {stretch.batches}: "
                                f"the epoch has {full + len(tail)} batches per rank")
            took.append(_samples_before(stretch.batches, full, tail, batch_size))
        if i == len(history) - 1 and size == world_size:
            layout = _span_layout(n, world_size, rank, batch_size, drop_last)
            return RankSpan(starts, cum, *layout, stretch.batches, batch_size)
        ranks = np.arange(size, dtype=np.int64)
        begin = _span_starts(n, size, ranks, batch_size, drop_last)
        taken = np.where(ranks < (0 if drop_last else n % size), took[0], took[1])
        begin, end = begin[taken > 0], (begin + taken)[taken > 0]
        starts, cum = _runs_at_indices(starts, cum, np.concatenate(([0], end)), np.concatenate((begin, [n])))
    return RankSpan(starts, cum, *_span_layout(int(cum[-1]), world_size, rank, batch_size, drop_last), 0, batch_size)


def rank_batch_count(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool,
                     history: Sequence[Resume] = ()) -> int:
    """Batches `rank` yields after the epoch's `history` (O(history x world sizes), no per-sample work)."""
    return int(rank_span(total, world_size, rank, batch_size, drop_last, history).batches)


def rank_sample_count(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool,
                      history: Sequence[Resume] = ()) -> int:
    """Samples `rank` yields after the epoch's `history` (O(history x world sizes), no per-sample work)."""
    return int(rank_span(total, world_size, rank, batch_size, drop_last, history).samples)


def rank_positions(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool,
                   history: Sequence[Resume] = ()) -> list[np.ndarray]:
    """The epoch-order positions of each batch `rank` yields, in order, after the epoch's `history`.

    Each stretch of the history split the positions still remaining over its world and took the
    first `batches` batches of every rank. Resuming in the world of the last stretch, a rank
    yields the rest of its own batches: exactly what an uninterrupted run would have. In another
    world, the remaining positions are split afresh, by the same rules (equal batch counts).
    Materialises the rank's positions: for tests and small epochs (`plan_epoch` does not).
    """
    span = rank_span(total, world_size, rank, batch_size, drop_last, history)
    positions, sizes = span.positions(np.arange(span.batches))
    bounds = np.concatenate(([0], np.cumsum(sizes))).tolist()
    return [positions[bounds[k] : bounds[k + 1]] for k in range(span.batches)]

