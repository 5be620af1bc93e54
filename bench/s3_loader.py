"""Object-storage benchmark: the SA-1B task streamed from SeaweedFS (S3 on 127.0.0.1), from
fake-gcs-server (GCS on 127.0.0.1, `--scheme gs`) or from Azurite (Azure Blob Storage on 127.0.0.1,
`--scheme az`), vs local disk.

    python bench/s3_loader.py [--scheme s3|gs|az] [--images 256] [--shard-samples 16,64,256] [--workers 2]
                              [--repeats 3]     (or: make bench-s3, make bench-gcs, make bench-az)

The images of `bench/sa1b_loader.py`, packed `--shard-samples` to a shard (each size in turn, its
own prefix), are uploaded to a server started for the run (SeaweedFS's `weed mini`, fake-gcs-server,
or Azurite's blob service in memory; loopback only, on the loader's cores). The ways of reading
them, interleaved in rounds so that load on the machine hits them alike, each with a fresh loader
per epoch (num_workers=2, batch 8, image 1024, masks 256, max 64), named here for s3 (for gs and az,
the same ways named so):
  local      the folder on local disk
  s3         s3://bucket/sa1b by byte range, no cache: samples of a shard read ahead in merged spans
  s3 1/smp   the same, one request per sample (read_ahead_bytes=0): the reference for spans
  s3 blocks  by range, shuffle="shards-then-blocks" (blocks of 8 neighbours: a batch of 8 is one span)
  s3 fsspec  by range through the fsspec filesystem (s3fs, gcsfs, adlfs), given an option the lean client
             (obstore) declines: what the lean client saves
  s3 cold    with cache_dir/cache_limit, the cache emptied before the epoch
  s3 warm    the same cache, filled by an earlier epoch
  s3 cold c  cold, each worker's first batch taken from the downloads too (first_batch_by_range=False)
  wds s3     webdataset reading the same tars from the same server its documented way (`pipe:curl`
             of each whole tar, by presigned URL; on the GCS emulator, which checks no credentials,
             by its plain URL; not on Azurite), its shuffle buffer of 1000, decoded and collated
             by this project's SA-1B decode in its workers (bench/sa1b_peers.py's PeerDecode)
Time to first batch runs from `make_stream_loader()` to the first batch in hand (worker start
included); samples/s from the first batch to the end of the epoch; CPU ms per sample of this
process and its DataLoader workers together (the server's not included). Medians over the rounds.
Then one untimed epoch of each s3 way through a recording proxy: requests per sample, bytes read
per byte of sample used (the server's HEAD and index requests included), and requests per second
of this node at the way's measured samples/s; and where the requests went (manifest, shard
indexes, whole-shard downloads, ranges of samples).
Then `shard-pack verify` of the dataset from local disk and from the server (each shard streamed once
into a temporary file, its samples checked from there), once each, at the first shard size.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import resource
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from sa1b_loader import SETTINGS, packed  # (bench/ is on the path of a script run from it)
from sa1b_peers import WDS_SHUFFLE, PeerDecode

from shard_tools.samples import localazure, localgcs, locals3

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from objectstore import FaultProxy  # noqa: E402  (the tests' recording proxy)
from shard_tools.verify import verify

os.environ["AWS_EC2_METADATA_DISABLED"] = locals3.AWS_ENV["AWS_EC2_METADATA_DISABLED"]
os.environ.update(localgcs.GCS_ENV)  # (no probe of Google's metadata server)


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
    parser.add_argument("--scheme", choices=["s3", "gs", "az"], default="s3", help="the object store: S3 "
                        "(SeaweedFS), Google Cloud Storage (fake-gcs-server) or Azure Blob Storage (Azurite)")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--shard-samples", default="16,64,256", help="samples per shard: one size or several (a,b,c)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from pipeline.storage import filesystem

    scheme, sizes = args.scheme, [int(n) for n in args.shard_samples.split(",")]
    work = pathlib.Path(tempfile.mkdtemp(prefix=f"bench-{scheme}-"))
    server, port, options_at = _server(scheme, work)
    try:
        options = options_at(server.endpoint)
        fs, _ = filesystem(f"{scheme}://bench", options)
        fs.mkdir("bench")
        for per_shard in sizes:
            shards = packed(args.images, per_shard)
            fs.put(str(shards) + "/", f"bench/sa1b-{per_shard}/", recursive=True)
            measure(Served(scheme, server, port, options_at), shards, per_shard, work / f"cache-{per_shard}", args)
        # Last: verify reads the server in this process, whose forked loader workers then could not use the lean client.
        timed = {}
        for name, source, options_ in (("local", str(packed(args.images, sizes[0])), None),
                                       (scheme, f"{scheme}://bench/sa1b-{sizes[0]}", options)):
            start = time.perf_counter()
            problems = verify(source, progress=False, storage_options=options_)
            timed[name] = f"{time.perf_counter() - start:.1f} s ({len(problems)} problems)"
        print(f"\nshard-pack verify, {sizes[0]} a shard (every sample decoded): local {timed['local']}, "
              f"{scheme} {timed[scheme]}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class Served:
    """The object store's server started for the run: its scheme, the port a proxy forwards to, and
    its storage options for an endpoint (the server's own or a proxy's)."""

    scheme: str
    server: Any
    port: int
    options_at: Callable[[str], dict[str, Any]]


def measure(served: Served, shards: pathlib.Path, per_shard: int, cache: pathlib.Path,
            args: argparse.Namespace) -> None:
    """The ways over one packing of the dataset (uploaded to <scheme>://bench/sa1b-<per_shard>): timed
    rounds, then one epoch of each remote way through the recording proxy; the table printed."""
    scheme, prefix = served.scheme, f"bench/sa1b-{per_shard}"
    remote = f"{scheme}://{prefix}"
    size = sum(p.stat().st_size for p in shards.glob("*.tar"))
    print(f"\ndata: {args.images} images at 1500x2250 in {len(list(shards.glob('*.tar')))} shards of {per_shard} "
          f"({size / 1e6:.0f} MB), uploaded to {served.server.endpoint}; settings {SETTINGS}, "
          f"num_workers={args.workers}")

    def ways(endpoint: str) -> dict:
        options = served.options_at(endpoint)
        cached = dict(storage_options=options, cache_dir=str(cache), cache_limit=4 * size)
        urls = [f"pipe:curl -s -f '{url}'" for url in _whole_tars(scheme, endpoint, options, shards, prefix)]
        return {
            "local": lambda: epoch(str(shards), args.workers),
            scheme: lambda: epoch(remote, args.workers, storage_options=options),
            f"{scheme} 1/smp": lambda: epoch(remote, args.workers, storage_options=options, read_ahead_bytes=0),
            f"{scheme} blocks": lambda: epoch(remote, args.workers, storage_options=options,
                                              shuffle="shards-then-blocks"),
            f"{scheme} fsspec": lambda: epoch(remote, args.workers, storage_options={**options, **_DECLINED[scheme]}),
            f"{scheme} cold": lambda: (shutil.rmtree(cache, ignore_errors=True),
                                       epoch(remote, args.workers, **cached))[1],
            f"{scheme} warm": lambda: epoch(remote, args.workers, **cached),
            f"{scheme} cold c": lambda: (shutil.rmtree(cache, ignore_errors=True),
                                         epoch(remote, args.workers, **cached, first_batch_by_range=False))[1],
            **({f"wds {scheme}": lambda: wds_epoch(urls, args.workers)} if urls else {}),
        }

    epoch(str(shards), args.workers)  # warm-up: page cache, imports
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways(served.server.endpoint)}
    for _ in range(args.repeats):
        for name, run in ways(served.server.endpoint).items():
            results[name].append(run())
    proxy = FaultProxy(served.port)
    spans = {p.name: _sample_spans(shards, p.name) for p in shards.glob("*.tar")}
    used = sum(e - s for found in spans.values() for s, e in found)
    samples = sum(len(found) for found in spans.values())
    sizes = {p.name: p.stat().st_size for p in shards.glob("*")}
    shapes, where = {}, {}
    for name, run in ways(proxy.endpoint).items():
        if name != "local":
            proxy.clear()
            run()
            shapes[name] = (len(proxy.requests) / samples, sum(r.response_bytes for r in proxy.gets()) / used)
            where[name] = _where(proxy, sizes)
    proxy.close()
    local = [statistics.median(x[i] for x in results["local"]) for i in range(3)]
    print(f"{'way':<11}{'first batch s':>14}{'x local':>9}{'samples/s':>11}{'of local':>10}{'CPU ms/smp':>12}"
          f"{'x local':>9}{'requests/smp':>14}{'read/used':>11}{'requests/s':>12}")
    for name, runs in results.items():
        first, rate, cpu = (statistics.median(x[i] for x in runs) for i in range(3))
        requests, amplification = shapes.get(name, (0.0, 0.0))
        print(f"{name:<11}{first:>14.2f}{first / local[0]:>9.2f}{rate:>11.1f}{rate / local[1]:>10.0%}{cpu:>12.1f}"
              f"{cpu / local[2]:>9.2f}{requests:>14.3f}{amplification:>11.2f}{requests * rate:>12.1f}")
    print("where the requests went:", "; ".join(f"{name}: {found}" for name, found in where.items()))
    print(f"targets: {scheme} and {scheme} cold samples/s >= 85% of local, CPU <= 1.15x local; first batch <= 1.5x "
          f"local; {scheme} cold c requests <= 2 a shard + the manifest")


def _where(proxy: FaultProxy, sizes: dict[str, int]) -> str:
    """Where an epoch's requests went: the manifest, shard indexes, whole shards, ranges of samples."""
    counts = dict.fromkeys(("manifest", "index", "whole shard", "ranges"), 0)
    for request in proxy.requests:
        name = urllib.parse.unquote(request.target.split("?")[0]).rsplit("/", 1)[1]  # (gcsfs quotes object names)
        if name.endswith(".tar") and request.headers.get("range", f"bytes=0-{sizes[name] - 1}") == \
                f"bytes=0-{sizes[name] - 1}":  # (webdataset's curl asks for the whole object, with no range)
            counts["whole shard"] += 1
        else:
            counts["manifest" if name == "manifest.json" else "index" if name.endswith(".idx") else "ranges"] += 1
    return ", ".join(f"{n} {what}" for what, n in counts.items() if n)


# An option each scheme's lean client declines (its reads then go through s3fs, gcsfs or adlfs), changing nothing
# else.
_DECLINED = {"s3": {"config_kwargs": {"max_pool_connections": 10}}, "gs": {"session_kwargs": {"trust_env": False}},
             "az": {"timeout": None}}


def _server(scheme: str, work: pathlib.Path) -> tuple[Any, int, Callable[[str], dict[str, Any]]]:
    """The object store's server, started for the run: (it, the port a proxy forwards to, its storage
    options for an endpoint: the server's own or a proxy's)."""
    if scheme == "s3":
        weed = locals3.SeaweedFS(work / "seaweedfs")
        weed.start()
        return weed, weed.s3_port, locals3.storage_options
    if scheme == "az":
        azurite = localazure.Azurite(work / "azurite")
        azurite.start()
        return azurite, azurite.port, localazure.storage_options
    fake = localgcs.FakeGCS(work / "fake-gcs")
    fake.start()
    return fake, fake.port, localgcs.storage_options


def _whole_tars(scheme: str, endpoint: str, options: dict[str, Any], shards: pathlib.Path, prefix: str) -> list[str]:
    """HTTP URLs of the train shards on the server, for `curl`: presigned (S3), or plain (the GCS emulator
    checks no credentials; its XML API's address of the object); none on Azurite."""
    names = [p.name for p in sorted(shards.glob("train-*.tar"))]
    if scheme == "az":
        return []
    if scheme == "gs":
        return [f"{endpoint}/{prefix}/{name}" for name in names]
    import s3fs

    signer = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    return [signer.sign(f"{prefix}/{name}", expiration=7200) for name in names]


def _sample_spans(shards: pathlib.Path, name: str) -> list[tuple[int, int]]:
    """Byte spans of a shard's samples (from its index file)."""
    from pipeline.storage import read_manifest, shard_indexes

    manifest = read_manifest(str(shards))
    return [tuple(map(int, index.spans[i])) for shard, index in shard_indexes(str(shards), manifest, "train")
            if shard.name == name for i in range(len(index.key_list()))]


if __name__ == "__main__":
    main()
