"""shardstream's packing side: the `shard-pack` command and the library functions under it."""

from shard_tools.pack import PackError, PackOptions, PackSummary, TooManySkipped, pack
from shard_tools.sa1b import Sa1bSource

__all__ = ["pack", "PackOptions", "PackSummary", "PackError", "TooManySkipped", "Sa1bSource"]
