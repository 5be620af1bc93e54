"""The `datasets` library's side of `pipeline.trl_dataset` (the `hf` extra): the loader's stream as a
`datasets.IterableDataset` whose epoch reaches the plan, through every dataset derived from it.

`datasets` gives a derived dataset (`map`, `filter`, `split_dataset_by_node`, TRL's repeat) an epoch
of its own, so a `set_epoch` override on the first one would be lost. What does reach the source
of examples of the dataset being iterated is `shift_rngs(epoch)`: datasets shifts every random
source by the epoch (and, in a DataLoader worker, by the worker's index: 0 for the one worker that
reads our single data source). The source here reads the plan of that epoch.

Resuming (`pipeline.resume_callback`): HF Trainer counts an iterable dataset's epochs afresh from 0
after a resume. `Start` says which epoch of the plan its epoch 0 is, and how many samples of it
were taken: the source begins there without decoding them (as it does for `datasets`' own state).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np
from datasets.iterable_dataset import ExamplesIterable

__all__ = ["PlanExamples", "Start", "iterable_dataset"]


@dataclasses.dataclass
class Start:
    """Where iteration resumes: the plan's epoch for the dataset's epoch 0, and the samples of it taken."""

    epoch: int = 0
    taken: int = 0


def _nothing() -> Iterator[tuple[int, dict[str, Any]]]:
    return iter(())


class PlanExamples(ExamplesIterable):
    """One data source: the stream's samples of `epoch`, in the plan's order, keyed by position.

    `stream` is a `make_stream_dataset(..., flatten=True, split_workers=False)`: whichever process
    or worker iterates this source reads the rank's whole share."""

    def __init__(self, stream: Any, epoch: int = 0, start: Start | None = None) -> None:
        super().__init__(_nothing, {})
        self.stream, self.epoch, self.start = stream, epoch, start if start is not None else Start()

    def _like(self, epoch: int) -> PlanExamples:
        return PlanExamples(self.stream, epoch, self.start)

    @property
    def num_shards(self) -> int:
        return 1

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        self.stream.set_epoch(self.epoch + self.start.epoch)
        done = self._state_dict["shard_example_idx"] if self._state_dict else 0
        skip = done + (self.start.taken if self.epoch == 0 else 0)
        if skip and self.stream.config.on_error == "raise":
            self.stream.start_at(skip)  # (positioned: nothing decoded again)
            samples = iter(self.stream)
        else:  # (with on_error="skip", samples yielded no longer tell batches apart: replayed)
            samples = itertools.islice(self.stream, skip, None)
        for key, sample in enumerate(samples, done):
            if self._state_dict:
                self._state_dict["shard_example_idx"] += 1
            yield key, sample

    def shift_rngs(self, value: int) -> PlanExamples:
        return self._like(self.epoch + value)

    def shuffle_data_sources(self, generator: np.random.Generator) -> PlanExamples:
        return self._like(self.epoch)  # one source, ordered by the plan

    def shard_data_sources(self, num_shards: int, index: int, contiguous: bool = True) -> ExamplesIterable:
        if self.split_shard_indices_by_worker(num_shards, index, contiguous):
            return self._like(self.epoch)
        return ExamplesIterable(_nothing, {})

    def reshard_data_sources(self) -> PlanExamples:
        return self._like(self.epoch)


def iterable_dataset(stream: Any, split: str) -> datasets.IterableDataset:
    """`stream` as a `datasets.IterableDataset` of one data source; `info.splits[split].num_examples`
    is the samples of an epoch. Its `shardstream` attribute holds the stream and the `Start` that
    `resume_callback` sets (datasets derived from it share both)."""
    info = datasets.DatasetInfo(splits=datasets.SplitDict({split: datasets.SplitInfo(split, num_examples=len(stream))}))
    examples = PlanExamples(stream)
    dataset = datasets.IterableDataset(examples, info=info, split=datasets.NamedSplit(split))
    dataset.shardstream = (stream, examples.start)
    return dataset
