"""shardstream's streaming side: `make_stream_loader()` for training scripts; `make_stream_dataset()`,
`trainer_dataset()` and `trl_dataset()` for trainers with their own DataLoader; `resume_callback()`
to resume HF Trainer mid-epoch without replay; `OutputWriter` to keep outputs computed from the
samples (a teacher's), attached to them later by `attach=`."""

from pipeline.errors import ManifestError, SampleError, ShardError, ShardstreamError, StallError
from pipeline.config import LoaderConfig
from pipeline.loader import LoaderStats, StreamLoader, make_stream_dataset, make_stream_loader, validate_first_batch
from pipeline.outputs.writer import OutputWriter
from pipeline.plan import World, plan_epoch
from pipeline.tario import ReadLimits
from pipeline.trainers import resume_callback, trainer_dataset, trl_dataset

__all__ = [
    "make_stream_loader",
    "validate_first_batch",
    "make_stream_dataset",
    "trainer_dataset",
    "trl_dataset",
    "resume_callback",
    "OutputWriter",
    "StreamLoader",
    "LoaderStats",
    "LoaderConfig",
    "ReadLimits",
    "World",
    "plan_epoch",
    "ShardstreamError",
    "ManifestError",
    "ShardError",
    "SampleError",
    "StallError",
]
