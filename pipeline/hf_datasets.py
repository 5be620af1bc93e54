"""The `datasets` library's side of `pipeline.trl_dataset` (the `hf` extra): the loader's stream as a
`datasets.IterableDataset` whose epoch reaches the plan, through every dataset derived from it.

`datasets` gives a derived dataset (`map`, `filter`, `split_dataset_by_node`, TRL's repeat) an epoch
of its own, so a `set_epoch` override on the first one would be lost. What does reach the source
of examples of the dataset being iterated is `shift_rngs(epoch)`: datasets shifts every random
source by the epoch (and, in a DataLoader worker, by the worker's index: 0 for the one worker that
reads our single data source). The source here reads the plan of that epoch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np
from datasets.iterable_dataset import ExamplesIterable

__all__ = ["PlanExamples", "iterable_dataset"]


def _nothing() -> Iterator[tuple[int, dict[str, Any]]]:
    return iter(())


class PlanExamples(ExamplesIterable):
    """One data source: the stream's samples of `epoch`, in the plan's order, keyed by position.

    `stream` is a `make_stream_dataset(..., flatten=True, split_workers=False)`: whichever process
    or worker iterates this source reads the rank's whole share."""

    def __init__(self, stream: Any, epoch: int = 0) -> None:
        super().__init__(_nothing, {})
        self.stream, self.epoch = stream, epoch

    @property
    def num_shards(self) -> int:
        return 1

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        self.stream.set_epoch(self.epoch)
        done = self._state_dict["shard_example_idx"] if self._state_dict else 0  # (resuming: the stream is replayed)
        for key, sample in enumerate(itertools.islice(self.stream, done, None), done):
            if self._state_dict:
                self._state_dict["shard_example_idx"] += 1
            yield key, sample

    def shift_rngs(self, value: int) -> PlanExamples:
        return PlanExamples(self.stream, self.epoch + value)

    def shuffle_data_sources(self, generator: np.random.Generator) -> PlanExamples:
        return PlanExamples(self.stream, self.epoch)  # one source, ordered by the plan

    def shard_data_sources(self, num_shards: int, index: int, contiguous: bool = True) -> ExamplesIterable:
        if self.split_shard_indices_by_worker(num_shards, index, contiguous):
            return PlanExamples(self.stream, self.epoch)
        return ExamplesIterable(_nothing, {})

    def reshard_data_sources(self) -> PlanExamples:
        return PlanExamples(self.stream, self.epoch)


def iterable_dataset(stream: Any, split: str) -> datasets.IterableDataset:
    """`stream` as a `datasets.IterableDataset` of one data source; `info.splits[split].num_examples`
    is the samples of an epoch."""
    info = datasets.DatasetInfo(splits=datasets.SplitDict({split: datasets.SplitInfo(split, num_examples=len(stream))}))
    return datasets.IterableDataset(PlanExamples(stream), info=info, split=datasets.NamedSplit(split))
