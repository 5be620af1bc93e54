"""The epoch plan: which samples each rank and DataLoader worker reads, in which order. Pure.

`plan_epoch(sizes, seed, epoch, world, ...)` decides everything that must agree across processes,
one module per algorithm:
- `shuffle`: one source's order, a shuffle from the table `SHUFFLES`;
- `partition`: each rank's contiguous span of the order, cut into equal numbers of batches, and
  resumption after an epoch's history of `Resume` stretches, in the same world or another;
- `mixing`: several sources (`Mix`), each an exact share of the epoch, interleaved at random;
- `lazy`: `plan_epoch`, a worker's share of its rank's batches, computed a chunk at a time.
Seeds come from `numpy.random.SeedSequence` with the purposes of `pipeline.seeds`: no global state.
A worker's plan costs O(what it yields + shards + history x world sizes), never O(epoch).
"""

from __future__ import annotations

from pipeline.errors import PlanError
from pipeline.plan.lazy import Item as Item  # (the type of a plan's entries; not in __all__, as before)
from pipeline.plan.lazy import plan_epoch
from pipeline.plan.mixing import Mix, epoch_samples, mixed_order
from pipeline.plan.partition import (Resume, World, rank_batch_count, rank_batch_sizes, rank_positions,
                                     rank_sample_count)
from pipeline.plan.shuffle import SHUFFLES, epoch_order, get_shuffle, shuffle_name

__all__ = [
    "World", "Resume", "Mix", "PlanError", "rank_batch_sizes", "rank_batch_count", "rank_sample_count",
    "rank_positions", "epoch_order", "epoch_samples", "mixed_order", "plan_epoch", "SHUFFLES", "get_shuffle",
    "shuffle_name",
]
