"""The lazy plan: `plan_epoch`, the batches one DataLoader worker of one rank yields, in order.

Workers: worker w of W yields the rank's batches w, w + W, ... The DataLoader takes batches from
its workers round-robin, so a rank yields the same batches in the same order for any number of
workers (and for persistent or fresh workers). The plan is a lazy sequence that computes its
batches a chunk at a time: a worker's plan costs time in proportion to what it yields and memory
of a chunk.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from typing import overload

import numpy as np

from pipeline.errors import ConfigError
from pipeline.plan.mixing import Mix, MixedOrder, epoch_samples
from pipeline.plan.partition import RankSpan, Resume, World, rank_span
from pipeline.plan.shuffle import get_shuffle

__all__ = ["Item", "plan_epoch"]

_CHUNK = 8192  # positions a lazy plan computes at once

Item = tuple[int, np.ndarray, np.ndarray]
_SourceOrder = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # positions -> (source, id in source) of each


class _Plan(Sequence[Item]):
    """A worker's batches (see `plan_epoch`), computed a chunk of batches at a time when asked for,
    the last two chunks kept: cheap in order with a small look-ahead, correct in any order."""

    def __init__(self, span: RankSpan, world: World, order: _SourceOrder) -> None:
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
        raise ConfigError("need seed >= 0, epoch >= 0, batch_size >= 1, window >= 1; "
                          f"got {seed}, {epoch}, {batch_size}, {window}")
    span = rank_span(epoch_samples(sources, mix), world.world_size, world.rank, batch_size, drop_last, history)
    order: _SourceOrder
    if mix is None:
        single = get_shuffle(shuffle)(sources[0], [seed, epoch], window)
        order = lambda positions: (np.zeros(positions.size, np.int64), single(positions))  # noqa: E731
    else:
        order = MixedOrder(sources, mix, seed, epoch, shuffle, window)
    return _Plan(span, world, order)
