"""Object-storage benchmark: the SA-1B task streamed from SeaweedFS (S3 on 127.0.0.1) vs local disk.

    python bench/s3_loader.py [--images 128] [--workers 2] [--repeats 3]     (or: make bench-s3)

The shards of `bench/sa1b_loader.py` are uploaded to a SeaweedFS server started for the run
(`weed mini`, loopback only). Four ways of reading them, interleaved in rounds so that load on
the machine hits them alike, each with a fresh loader per epoch (num_workers=2, batch 8, image
1024, masks 256, max 64):
  local      the folder on local disk
  s3         s3://bucket/sa1b by byte range, no cache
  s3 cold    with cache_dir/cache_limit, the cache emptied before the epoch
  s3 warm    the same cache, filled by an earlier epoch
Time to first batch runs from `make_stream_loader()` to the first batch in hand (worker start
included); samples/s from the first batch to the end of the epoch. Medians over the rounds.
Then `shard-pack verify` of the dataset from local disk and from s3:// (each shard streamed once
into a temporary file, its samples checked from there), once each.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import tempfile
import time

from sa1b_loader import SETTINGS, prepare  # (bench/ is on the path of a script run from it)

from shard_tools.locals3 import AWS_ENV, SeaweedFS, storage_options
from shard_tools.verify import verify

os.environ["AWS_EC2_METADATA_DISABLED"] = AWS_ENV["AWS_EC2_METADATA_DISABLED"]


def epoch(source: str, workers: int, **kwargs) -> tuple[float, float]:
    """(seconds to the first batch, samples/s after it) of one epoch of a fresh loader."""
    from pipeline import make_stream_loader

    start = time.perf_counter()
    loader = make_stream_loader(source, "train", num_workers=workers, seed=0, **SETTINGS, **kwargs)
    it = iter(loader)
    first = next(it)
    ready = time.perf_counter()
    n = sum(len(batch["keys"]) for batch in it)
    end = time.perf_counter()
    del first, it, loader
    return ready - start, n / (end - ready)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import s3fs

    shards = prepare(args.images) / "shards"
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-s3-"))
    server = SeaweedFS(work / "seaweedfs")
    server.start()
    try:
        options = storage_options(server.endpoint)
        fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        fs.mkdir("bench")
        fs.put(str(shards) + "/", "bench/sa1b/", recursive=True)
        size = sum(p.stat().st_size for p in shards.glob("*.tar"))
        print(f"data: {args.images} images at 1500x2250 in {len(list(shards.glob('*.tar')))} shards "
              f"({size / 1e6:.0f} MB), uploaded to {server.endpoint}; settings {SETTINGS}, num_workers={args.workers}")
        remote, cache = "s3://bench/sa1b", work / "cache"
        ways = {
            "local": lambda: epoch(str(shards), args.workers),
            "s3": lambda: epoch(remote, args.workers, storage_options=options),
            "s3 cold": lambda: (shutil.rmtree(cache, ignore_errors=True),
                                epoch(remote, args.workers, storage_options=options, cache_dir=str(cache),
                                      cache_limit=4 * size))[1],
            "s3 warm": lambda: epoch(remote, args.workers, storage_options=options, cache_dir=str(cache),
                                     cache_limit=4 * size),
        }
        epoch(str(shards), args.workers)  # warm-up: page cache, imports
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, run in ways.items():
                results[name].append(run())
        verified = {}
        for name, source, options_ in (("local", str(shards), None), ("s3", remote, options)):
            start = time.perf_counter()
            problems = verify(source, progress=False, storage_options=options_)
            verified[name] = f"{time.perf_counter() - start:.1f} s ({len(problems)} problems)"
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    local_first, local_rate = (statistics.median(x[i] for x in results["local"]) for i in (0, 1))
    print(f"{'way':<10}{'first batch s':>15}{'x local':>9}{'samples/s':>11}{'of local':>10}")
    for name, runs in results.items():
        first, rate = (statistics.median(x[i] for x in runs) for i in (0, 1))
        print(f"{name:<10}{first:>15.2f}{first / local_first:>9.2f}{rate:>11.1f}{rate / local_rate:>10.0%}")
    print("targets: samples/s >= 80% of local; time to first batch <= 2x local")
    print(f"shard-pack verify (every sample decoded): local {verified['local']}, s3 {verified['s3']}")


if __name__ == "__main__":
    main()
