"""Datasets for other libraries' training loops: `trainer_dataset` for any trainer that batches samples
in its own DataLoader (HF Trainer, accelerate, Lightning, a plain loop), `trl_dataset` for TRL's
GRPOTrainer (needs the `hf` extra: the `datasets` library), and `resume_callback`, which resumes
HF Trainer mid-epoch without decoding the epoch's start again (needs transformers).

These adapters import the loader; the loader never imports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.utils.data import IterableDataset

from pipeline.checks import is_int_at_least
from pipeline.errors import ConfigError
from pipeline.loader import make_stream_dataset
from pipeline.tario import ReadLimits

if TYPE_CHECKING:
    import datasets

__all__ = ["trainer_dataset", "trl_dataset", "resume_callback"]


def _positive(name: str, value: Any) -> int:
    if not is_int_at_least(value, 1):
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): as given, else torch.distributed's when it is initialised, else (0, 1)."""
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    _positive("world_size", world_size)
    if not (is_int_at_least(rank, 0) and rank < world_size):
        raise ConfigError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    return rank, world_size


def trainer_dataset(
    source: str | Sequence[str],
    split: str,
    *,
    batch_size: int,
    shard_ranks: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    drop_last: bool = True,
    max_workers: int = 16,
    **kwargs: Any,
) -> IterableDataset:
    """A torch IterableDataset of samples (row i of each batch, same keys; see `make_stream_dataset`)
    for a trainer whose DataLoader batches them by `batch_size`, its per-process batch size.

    `len()` is the samples an epoch yields on this process, and `len(DataLoader(ds, batch_size))` the
    batches it yields, for any `num_workers`: each worker takes whole global batches in turn, so no
    worker ends on a short batch.

    - `shard_ranks=False` (HF Trainer, accelerate): every process yields the same stream, in global
      batches of `batch_size x world_size`, and accelerate hands each process its slice of each (by
      `IterableDatasetShard`, or with `dispatch_batches` from process 0). Every sample once per epoch.
    - `shard_ranks=True` (Lightning, a plain DDP loop): each rank yields only its own share, in
      batches of `batch_size`, the same count on every rank.

    `rank`/`world_size` default to torch.distributed's. The plan leaves out the epoch's last
    `samples mod (batch_size x world_size)`; `drop_last=False` keeps them (one short batch), on a
    single process only: with several, accelerate would pad a short global batch with repeats.
    `set_epoch(epoch)` (HF Trainer and accelerate call it) selects the plan. Other arguments as
    `make_stream_dataset`'s.
    """
    _positive("batch_size", batch_size)
    rank, world_size = _world(rank, world_size)
    if not drop_last and world_size > 1:
        raise ConfigError(f"drop_last=False needs a single process, got world_size={world_size}: a short last batch "
                          "is padded with repeated samples by accelerate, or leaves ranks out of step")
    if shard_ranks:
        return make_stream_dataset(source, split, batch_size=batch_size, flatten=True, drop_last=drop_last, rank=rank,
                                   world_size=world_size, max_workers=max_workers, **kwargs)
    return make_stream_dataset(source, split, batch_size=batch_size * world_size, flatten=True, drop_last=drop_last,
                               rank=0, world_size=1, max_workers=max_workers, **kwargs)


def trl_dataset(
    source: str | Sequence[str],
    split: str,
    *,
    seed: int = 0,
    image_size: int | None = 448,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    pixel_factor: int | None = None,
    shuffle: bool = True,
    on_error: str = "raise",
    max_errors: int | float | None = None,
    shuffle_window: int = 16384,
    storage_options: dict[str, Any] | None = None,
    limits: ReadLimits | None = None,
    chunk: int = 16,
) -> datasets.IterableDataset:
    """A VQA split as a `datasets.IterableDataset` of per-question dicts in the conversational form of
    TRL's GRPOTrainer: `{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text",
    "text": question}]}], "image": PIL RGB image, "question", "answer", "key", "image_path", ...every
    original field}`.

    Every epoch yields every question once, in the loader's plan order for (seed, epoch); the epoch
    is the one `set_epoch` gives this dataset or any dataset derived from it (TRL's repeat, `map`,
    `split_dataset_by_node`). Every process yields the whole split in the same order: accelerate
    hands each its slice of each global batch. One data source: in a DataLoader, one worker reads it.
    `info.splits[split].num_examples` is the questions per epoch. `chunk` questions are decoded at a
    time; with `on_error="skip"` a bad sample is left out. Needs the `hf` extra (`datasets`).
    Images are at long side `image_size`; with `image_size=None`, as stored, or given `min_pixels`,
    `max_pixels` or `pixel_factor`, at Qwen2-VL's `smart_resize` of their original size (see the vqa kind).
    """
    try:
        from pipeline.hf_datasets import iterable_dataset
    except ImportError as exc:
        raise ImportError(f"trl_dataset needs the datasets library ({exc}): install the package's hf extra, "
                          "or pip install 'datasets>=5.2'") from exc
    stream = make_stream_dataset(source, split, batch_size=_positive("chunk", chunk), flatten=True, split_workers=False,
                                 max_workers=1, shuffle=shuffle, seed=seed, drop_last=False, on_error=on_error,
                                 max_errors=max_errors, shuffle_window=shuffle_window, rank=0, world_size=1,
                                 storage_options=storage_options, limits=limits, per="question", image_size=image_size,
                                 min_pixels=min_pixels, max_pixels=max_pixels, pixel_factor=pixel_factor, form="trl")
    return iterable_dataset(stream, split)


def resume_callback(dataset: IterableDataset) -> Any:
    """A `transformers.TrainerCallback` for HF Trainer over `dataset` (a `trainer_dataset`):
    `Trainer(..., train_dataset=dataset, callbacks=[resume_callback(dataset)])`. With it,
    `trainer.train(resume_from_checkpoint=...)` continues at the exact next sample, nothing decoded
    twice: the dataset is positioned from the checkpoint's global step, instead of HF's data skip
    (which it turns off). A checkpoint of another dataset, split, order, kind options or global
    batch (`per_device_train_batch_size x world_size`) is refused; the same global batch resumes on
    any number of processes. See docs/trainers.md."""
    try:
        from pipeline.hf_trainer import StreamResume
    except ImportError as exc:
        raise ImportError(f"resume_callback needs transformers ({exc}): pip install 'transformers>=5'") from exc
    return StreamResume(dataset)
