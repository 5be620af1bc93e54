"""All reads and writes of datasets go through this package, one module per job:

- `retry`: the one retry policy (transient failures backed off with jitter; others fail at once);
- `fs`: filesystems by URL (fsspec), the generic ranged read and the atomic small write;
- `ranged`: ranged reads of shards through a client per URL scheme (`s3`, `gcs`: obstore), else fsspec;
- `meta`: a dataset's manifest and shard index files, read whole and checked;
- `places`: where a dataset's names may lead (inside its folder, or under `allowed_roots`);
- `local`: local shards memory-mapped under read leases, pages released after use, hashing (regular files only);
- `locks`: file locks between processes, never kept by a forked child;
- `cache`: the node's shard cache (whole shards on local disk, shared by its processes);
- `reader`: `ShardReader`, which picks among them for each shard.

Clients are made in the process that uses them (`ShardReader` is built inside each DataLoader
worker): s3fs, gcsfs, botocore and obstore are not fork-safe.
"""

from pipeline.storage.cache import ShardCache
from pipeline.storage.fs import PIECE_BYTES, filesystem, is_local, join, read_range, shard_url, write_bytes
from pipeline.storage.local import release_pages, sha256_file
from pipeline.storage.meta import MAX_MANIFEST_BYTES, read_index, read_manifest, shard_indexes
from pipeline.storage.reader import ShardReader
from pipeline.storage.retry import Retry, with_retries

__all__ = [
    "MAX_MANIFEST_BYTES", "PIECE_BYTES", "Retry", "ShardCache", "ShardReader", "join", "filesystem", "is_local",
    "read_manifest", "read_index", "release_pages", "shard_url", "read_range", "shard_indexes", "sha256_file",
    "with_retries", "write_bytes",
]
