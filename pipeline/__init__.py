"""shardstream's streaming side: `make_stream_loader()` for training scripts."""

from pipeline.errors import ManifestError, SampleError, ShardError, ShardstreamError
from pipeline.loader import LoaderConfig, StreamLoader, make_stream_loader, validate_first_batch
from pipeline.plan import World, plan_epoch
from pipeline.tario import ReadLimits

__all__ = [
    "make_stream_loader",
    "validate_first_batch",
    "StreamLoader",
    "LoaderConfig",
    "ReadLimits",
    "World",
    "plan_epoch",
    "ShardstreamError",
    "ManifestError",
    "ShardError",
    "SampleError",
]
