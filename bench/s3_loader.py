"""Object-storage benchmark: the SA-1B task streamed from SeaweedFS (S3 on 127.0.0.1), or from Azurite
(Azure Blob Storage on 127.0.0.1, `--scheme az`), vs local disk.

    python bench/s3_loader.py [--scheme s3|az] [--images 256] [--shard-samples 16] [--workers 2] [--repeats 3]
                                                                           (or: make bench-s3, make bench-az)

The images of `bench/sa1b_loader.py`, packed `--shard-samples` to a shard, are uploaded to a
server started for the run (SeaweedFS's `weed mini`, or Azurite's blob service in memory; loopback
only, on the loader's cores). The ways of reading them, interleaved in rounds so that load on the
machine hits them alike, each with a fresh loader per epoch (num_workers=2, batch 8, image 1024,
masks 256, max 64); with `--scheme az`, `az` in their names for `s3`, and no `wds s3`:
  local      the folder on local disk
  s3         s3://bucket/sa1b by byte range, no cache: samples of a shard read ahead in merged spans
  s3 1/smp   the same, one request per sample (read_ahead_bytes=0): the reference for spans
  s3 cold    with cache_dir/cache_limit, the cache emptied before the epoch
  s3 warm    the same cache, filled by an earlier epoch
  wds s3     webdataset reading the same tars from the same server its documented way (`pipe:curl`
             of each whole tar, by presigned URL), its shuffle buffer of 1000, decoded and collated
             by this project's SA-1B decode in its workers (bench/sa1b_peers.py's PeerDecode)
Time to first batch runs from `make_stream_loader()` to the first batch in hand (worker start
included); samples/s from the first batch to the end of the epoch; CPU ms per sample of this
process and its DataLoader workers together (the server's not included). Medians over the rounds.
Then one untimed epoch of each s3 way through a recording proxy: requests per sample and bytes
read per byte of sample used (the server's HEAD and index requests included).
Then `shard-pack verify` of the dataset from local disk and from s3:// (each shard streamed once
into a temporary file, its samples checked from there), once each.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import shutil
import statistics
import sys
import tempfile
import time

from sa1b_loader import SETTINGS, packed  # (bench/ is on the path of a script run from it)
from sa1b_peers import WDS_SHUFFLE, PeerDecode

from shard_tools.samples import localazure
from shard_tools.samples.locals3 import AWS_ENV, SeaweedFS, storage_options

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from objectstore import FaultProxy  # noqa: E402  (the tests' recording proxy)
from shard_tools.verify import verify
from pipeline.storage import filesystem

os.environ["AWS_EC2_METADATA_DISABLED"] = AWS_ENV["AWS_EC2_METADATA_DISABLED"]


def _cpu() -> float:
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def epoch(source: str, workers: int, **kwargs) -> tuple[float, float, float]:
    """(seconds to the first batch, samples/s after it, CPU ms per sample) of one epoch of a fresh loader."""
    from pipeline import make_stream_loader

    cpu, start = _cpu(), time.perf_counter()
    loader = make_stream_loader(source, "train", num_workers=workers, seed=0, **SETTINGS, **kwargs)
    it = iter(loader)
    first = next(it)
    ready = time.perf_counter()
    n = sum(len(batch["keys"]) for batch in it)
    end = time.perf_counter()
    n += len(first["keys"])
    del first, it, loader  # (the workers end and are waited for: their CPU counts)
    return ready - start, (n - SETTINGS["batch_size"]) / (end - ready), 1000 * (_cpu() - cpu) / n


def wds_epoch(urls: list[str], workers: int) -> tuple[float, float, float]:
    """`epoch` for webdataset over `urls`, decoded by this project's SA-1B decode in its workers."""
    import webdataset as wds

    cpu, start = _cpu(), time.perf_counter()
    decode = PeerDecode(**{k: v for k, v in SETTINGS.items() if k != "batch_size"})
    dataset = (wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False)
               .shuffle(WDS_SHUFFLE)
               .map(lambda item: decode.sample(item, item["__key__"], item["__url__"]))
               .batched(SETTINGS["batch_size"], collation_fn=decode.batch, partial=False))
    it = iter(wds.WebLoader(dataset, batch_size=None, num_workers=workers))
    first = next(it)
    ready = time.perf_counter()
    n = sum(len(batch["keys"]) for batch in it)
    end = time.perf_counter()
    n += len(first["keys"])
    del first, it
    return ready - start, (n - SETTINGS["batch_size"]) / (end - ready), 1000 * (_cpu() - cpu) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--shard-samples", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scheme", choices=["s3", "az"], default="s3", help="s3 (SeaweedFS) or az (Azurite)")
    args = parser.parse_args()

    shards = packed(args.images, args.shard_samples)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-s3-"))
    server, options_at, remote = _serve(args.scheme, work, shards)
    try:
        options, at = options_at(server.endpoint), args.scheme
        size = sum(p.stat().st_size for p in shards.glob("*.tar"))
        print(f"data: {args.images} images at 1500x2250 in {len(list(shards.glob('*.tar')))} shards of "
              f"{args.shard_samples} "
              f"({size / 1e6:.0f} MB), uploaded to {server.endpoint}; settings {SETTINGS}, num_workers={args.workers}")
        cache = work / "cache"

        def ways(options: dict) -> dict:
            return {
                "local": lambda: epoch(str(shards), args.workers),
                at: lambda: epoch(remote, args.workers, storage_options=options),
                f"{at} 1/smp": lambda: epoch(remote, args.workers, storage_options=options, read_ahead_bytes=0),
                f"{at} cold": lambda: (shutil.rmtree(cache, ignore_errors=True),
                                       epoch(remote, args.workers, storage_options=options, cache_dir=str(cache),
                                             cache_limit=4 * size))[1],
                f"{at} warm": lambda: epoch(remote, args.workers, storage_options=options, cache_dir=str(cache),
                                            cache_limit=4 * size),
                **({"wds s3": _wds(options, shards, args.workers)} if at == "s3" else {}),
            }

        epoch(str(shards), args.workers)  # warm-up: page cache, imports
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways(options)}
        for _ in range(args.repeats):
            for name, run in ways(options).items():
                results[name].append(run())
        proxy = FaultProxy(server.port if at == "az" else server.s3_port)
        used = sum(e - s for p in shards.glob("*.tar") for s, e in _sample_spans(shards, p.name))
        samples = sum(1 for p in shards.glob("*.tar") for _ in _sample_spans(shards, p.name))
        shapes = {}
        for name, run in ways(options_at(proxy.endpoint)).items():
            if name != "local":
                proxy.clear()
                run()
                shapes[name] = (len(proxy.requests) / samples, sum(r.response_bytes for r in proxy.gets()) / used)
        proxy.close()
        verified = {}
        for name, source, options_ in (("local", str(shards), None), (at, remote, options)):
            start = time.perf_counter()
            problems = verify(source, progress=False, storage_options=options_)
            verified[name] = f"{time.perf_counter() - start:.1f} s ({len(problems)} problems)"
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    local = [statistics.median(x[i] for x in results["local"]) for i in range(3)]
    print(f"{'way':<10}{'first batch s':>15}{'x local':>9}{'samples/s':>11}{'of local':>10}{'CPU ms/smp':>12}"
          f"{'x local':>9}{'requests/smp':>14}{'read/used':>11}")
    for name, runs in results.items():
        first, rate, cpu = (statistics.median(x[i] for x in runs) for i in range(3))
        requests, amplification = shapes.get(name, (0.0, 0.0))
        print(f"{name:<10}{first:>15.2f}{first / local[0]:>9.2f}{rate:>11.1f}{rate / local[1]:>10.0%}{cpu:>12.1f}"
              f"{cpu / local[2]:>9.2f}{requests:>14.3f}{amplification:>11.2f}")
    print(f"targets: {at} and {at} cold samples/s >= 85% of local, CPU <= 1.15x local; first batch <= 1.5x local; "
          "requests/sample <= 1/8")
    print(f"shard-pack verify (every sample decoded): local {verified['local']}, {at} {verified[at]}")


def _serve(scheme: str, work: pathlib.Path, shards: pathlib.Path):
    """The server started for the run, with the folder uploaded: (it, its storage options by endpoint, the URL)."""
    if scheme == "az":
        azurite = localazure.Azurite(work / "azurite")
        azurite.start()
        container = azurite.new_container()
        fs, _ = filesystem(f"az://{container}", localazure.storage_options(azurite.endpoint))
        fs.put(str(shards) + "/", f"{container}/sa1b/", recursive=True)
        return azurite, localazure.storage_options, f"az://{container}/sa1b"
    import s3fs

    server = SeaweedFS(work / "seaweedfs")
    server.start()
    fs = s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True)
    fs.mkdir("bench")
    fs.put(str(shards) + "/", "bench/sa1b/", recursive=True)
    return server, storage_options, "s3://bench/sa1b"


def _wds(options: dict, shards: pathlib.Path, workers: int):
    """webdataset's epoch over the bucket's shards, each by `pipe:curl` of a presigned URL."""
    import s3fs

    signer = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    urls = [f"pipe:curl -s -f '{signer.sign(f'bench/sa1b/{p.name}', expiration=7200)}'"
            for p in sorted(shards.glob("train-*.tar"))]
    return lambda: wds_epoch(urls, workers)


def _sample_spans(shards: pathlib.Path, name: str) -> list[tuple[int, int]]:
    """Byte spans of a shard's samples (from its index file)."""
    from pipeline.storage import read_manifest, shard_indexes

    manifest = read_manifest(str(shards))
    return [tuple(map(int, index.spans[i])) for shard, index in shard_indexes(str(shards), manifest, "train")
            if shard.name == name for i in range(len(index.key_list()))]


if __name__ == "__main__":
    main()
