"""The epoch plan: which samples each rank and DataLoader worker reads, in which order. Pure.

`plan_epoch(sizes, seed, epoch, world, ...)` decides everything that must agree across processes:
- Order: with `shuffle`, the shards are permuted, then samples are permuted within consecutive
  windows of `window` samples of that sequence (locality: a window touches few shards). Seeds
  come from `numpy.random.SeedSequence` over (seed, epoch, purpose, window): no global state.
- Ranks: rank r takes a contiguous span of the order, cut into batches. Every rank gets the same
  number of batches (DDP needs it). `drop_last=True` drops the tail of the order that does not
  fill a batch on every rank (fewer than world_size * batch_size samples); `drop_last=False`
  keeps every sample exactly once, so the last one or two batches of a rank may be short.
- Workers: worker w of W yields the rank's batches w, w + W, ... The DataLoader takes batches
  from its workers round-robin, so a rank yields the same batches in the same order for any
  number of workers (and for persistent or fresh workers).
- Mixing (`Mix`): several sources, each giving an exact share of the epoch, interleaved at random.
- Resumption: an epoch's history of `Resume` stretches. The same world continues each rank's
  own batches; another world size splits the positions no rank had taken over the new world.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = [
    "World", "Resume", "Mix", "PlanError", "rank_batch_sizes", "rank_positions", "epoch_order", "epoch_samples",
    "mixed_order", "plan_epoch",
]

_SHARD_ORDER, _WINDOW_ORDER, _MIX_ORDER = 1, 2, 4  # SeedSequence purposes (3 is the SA-1B mask sampling)


class PlanError(ValueError):
    """The split cannot be divided as asked (e.g. fewer samples than ranks)."""


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


def rank_batch_sizes(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool) -> tuple[int, list[int]]:
    """(first position, batch sizes) of `rank`'s contiguous span of the epoch order."""
    if drop_last:
        per_rank = total // (world_size * batch_size)
        return rank * per_rank * batch_size, [batch_size] * per_rank
    share, extra = divmod(total, world_size)
    count = share + (rank < extra)
    batches = -(-(share + (extra > 0)) // batch_size)  # the largest rank's batch count
    if batches == 0:
        return 0, []
    sizes = [batch_size] * (batches - 1) + [count - (batches - 1) * batch_size]
    if sizes[-1] == 0:  # a smaller rank: lend its last batch one sample from the one before
        if batches < 2 or batch_size < 2:
            raise PlanError(
                f"{total} samples cannot be split over {world_size} ranks in equal numbers of batches "
                f"of at most {batch_size} without dropping or repeating samples; use drop_last=True"
            )
        sizes[-2:] = [batch_size - 1, 1]
    return rank * share + min(rank, extra), sizes


def epoch_order(sizes: Sequence[int], entropy: Sequence[int], shuffle: bool, window: int, positions: np.ndarray) -> np.ndarray:
    """Global sample ids (shard-major numbering) at the given positions of one source's order for
    `entropy` ((seed, epoch), or (seed, epoch, source, pass) when mixing)."""
    positions = np.asarray(positions, dtype=np.int64)
    if not shuffle or positions.size == 0:
        return positions.copy()
    counts = np.asarray(sizes, dtype=np.int64)
    total = int(counts.sum())
    perm = np.random.default_rng([*entropy, _SHARD_ORDER]).permutation(counts.size)
    first_id = np.concatenate(([0], np.cumsum(counts)[:-1]))
    seq_start = np.concatenate(([0], np.cumsum(counts[perm])[:-1]))
    windows = positions // window
    order = np.argsort(windows, kind="stable")
    sequence = np.empty_like(positions)  # position in the shard-permuted sequence of all samples
    for group in np.split(order, np.flatnonzero(np.diff(windows[order])) + 1):
        w = int(windows[group[0]])
        within = np.random.default_rng([*entropy, _WINDOW_ORDER, w]).permutation(min(window, total - w * window))
        sequence[group] = w * window + within[positions[group] - w * window]
    shard = np.searchsorted(seq_start, sequence, side="right") - 1  # skips empty shards
    return first_id[perm[shard]] + sequence - seq_start[shard]


@dataclasses.dataclass(frozen=True)
class Resume:
    """One stretch of an epoch run in one world: every rank of `world_size` took `batches` batches."""

    world_size: int
    batches: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.batches < 0:
            raise ValueError(f"invalid resume point {self}")


def _split(positions: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return np.split(positions[: sum(sizes)], np.cumsum(sizes)[:-1]) if sizes else []


def rank_positions(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool,
                   history: Sequence[Resume] = ()) -> list[np.ndarray]:
    """The epoch-order positions of each batch `rank` yields, in order, after the epoch's `history`.

    Each stretch of the history split the positions still remaining over its world and took the
    first `batches` batches of every rank. Resuming in the world of the last stretch, a rank
    yields the rest of its own batches: exactly what an uninterrupted run would have. In another
    world, the remaining positions are split afresh, by the same rules (equal batch counts).
    """
    remaining = np.arange(total, dtype=np.int64)
    for i, stretch in enumerate(history):
        split = []
        for r in range(stretch.world_size):
            start, sizes = rank_batch_sizes(remaining.size, stretch.world_size, r, batch_size, drop_last)
            if stretch.batches > len(sizes):
                raise PlanError(f"cannot resume after batch {stretch.batches}: the epoch has {len(sizes)} batches per rank")
            split.append(_split(remaining[start:], sizes))
        if i == len(history) - 1 and stretch.world_size == world_size:
            return split[rank][stretch.batches :]
        taken = [p for batches in split for p in batches[: stretch.batches]]
        remaining = np.setdiff1d(remaining, np.concatenate(taken)) if taken else remaining
    start, sizes = rank_batch_sizes(remaining.size, world_size, rank, batch_size, drop_last)
    return _split(remaining[start:], sizes)


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


def mixed_order(sources: Sequence[Sequence[int]], mix: Mix, seed: int, epoch: int, shuffle: bool, window: int,
                positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, sample id within it) at the given positions of the epoch's mixed order."""
    labels = np.repeat(np.arange(len(sources)), mix.counts)
    if shuffle:
        labels = np.random.default_rng([seed, epoch, _MIX_ORDER]).permutation(labels)
    occurrence = np.empty(labels.size, dtype=np.int64)  # how many of the same source come before
    for s in range(len(sources)):
        where = np.flatnonzero(labels == s)
        occurrence[where] = np.arange(where.size)
    source, nth = labels[positions], occurrence[positions]
    ids = np.empty(positions.size, dtype=np.int64)
    for s, sizes in enumerate(sources):
        mine, total = np.flatnonzero(source == s), sum(sizes)
        if not mine.size:
            continue
        for run in np.unique(nth[mine] // total):
            sel = mine[nth[mine] // total == run]
            ids[sel] = epoch_order(sizes, [seed, epoch, s, int(run)], shuffle, window, nth[sel] % total)
    return source, ids


def plan_epoch(
    sources: Sequence[Sequence[int]],
    seed: int,
    epoch: int,
    world: World,
    *,
    batch_size: int,
    drop_last: bool = True,
    shuffle: bool = True,
    window: int = 16384,
    mix: Mix | None = None,
    history: Sequence[Resume] = (),
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(batch index in this iteration of the rank, source of each sample, sample ids within their
    source) of each batch `world`'s worker yields. `sources` holds each source's shard sizes; one
    source needs no `mix`."""
    if seed < 0 or epoch < 0 or batch_size < 1 or window < 1:
        raise ValueError(f"need seed >= 0, epoch >= 0, batch_size >= 1, window >= 1; got {seed}, {epoch}, {batch_size}, {window}")
    batches = rank_positions(epoch_samples(sources, mix), world.world_size, world.rank, batch_size, drop_last, history)
    mine = batches[world.worker :: world.num_workers]
    positions = np.concatenate(mine) if mine else np.zeros(0, np.int64)
    if mix is None:
        source, ids = np.zeros(positions.size, np.int64), epoch_order(sources[0], [seed, epoch], shuffle, window, positions)
    else:
        source, ids = mixed_order(sources, mix, seed, epoch, shuffle, window, positions)
    bounds = np.cumsum([0] + [len(b) for b in mine])
    return [(world.worker + i * world.num_workers, source[bounds[i] : bounds[i + 1]], ids[bounds[i] : bounds[i + 1]])
            for i in range(len(mine))]
