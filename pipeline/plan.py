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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["World", "PlanError", "rank_batch_sizes", "epoch_order", "plan_epoch"]

_SHARD_ORDER, _WINDOW_ORDER = 1, 2  # SeedSequence purposes


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


def epoch_order(sizes: Sequence[int], seed: int, epoch: int, shuffle: bool, window: int, start: int, stop: int) -> np.ndarray:
    """Global sample ids (shard-major numbering) at positions [start, stop) of the epoch order."""
    if not shuffle:
        return np.arange(start, stop, dtype=np.int64)
    counts = np.asarray(sizes, dtype=np.int64)
    total = int(counts.sum())
    perm = np.random.default_rng([seed, epoch, _SHARD_ORDER]).permutation(counts.size)
    first_id = np.concatenate(([0], np.cumsum(counts)[:-1]))
    seq_start = np.concatenate(([0], np.cumsum(counts[perm])[:-1]))
    if stop <= start:
        return np.zeros(0, np.int64)
    lo, hi = start // window, -(-stop // window)
    positions = np.concatenate([
        w * window + np.random.default_rng([seed, epoch, _WINDOW_ORDER, w]).permutation(min(window, total - w * window))
        for w in range(lo, hi)
    ])[start - lo * window : stop - lo * window]
    shard = np.searchsorted(seq_start, positions, side="right") - 1  # skips empty shards
    return first_id[perm[shard]] + positions - seq_start[shard]


def plan_epoch(
    sizes: Sequence[int],
    seed: int,
    epoch: int,
    world: World,
    *,
    batch_size: int,
    drop_last: bool = True,
    shuffle: bool = True,
    window: int = 16384,
) -> list[tuple[int, np.ndarray]]:
    """(batch index within the rank, global sample ids) for each batch `world`'s worker yields, in order."""
    if seed < 0 or epoch < 0 or batch_size < 1 or window < 1:
        raise ValueError(f"need seed >= 0, epoch >= 0, batch_size >= 1, window >= 1; got {seed}, {epoch}, {batch_size}, {window}")
    start, batch_sizes = rank_batch_sizes(sum(sizes), world.world_size, world.rank, batch_size, drop_last)
    ids = epoch_order(sizes, seed, epoch, shuffle, window, start, start + sum(batch_sizes))
    bounds = np.cumsum([0] + batch_sizes)
    return [(b, ids[bounds[b] : bounds[b + 1]]) for b in range(world.worker, len(batch_sizes), world.num_workers)]
