"""Object storage against a real S3-compatible server (SeaweedFS on 127.0.0.1): packing to and
streaming from s3://, range reads, the shard cache, and every fault mode of the proxy."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import s3fs
import torch
from objectstore import FaultProxy

from pipeline import make_stream_loader, storage
from pipeline.config import LoaderConfig
from pipeline.errors import ManifestError, ShardError, about_sample
from pipeline.format import Manifest
from pipeline.storage import Retry, filesystem, read_range
import pipeline.storage.reader as shard_reader
from pipeline.storage.ranged import ranged_reader
from pipeline.storage.retry import transient
from pipeline.storage.s3 import S3Error
from shard_tools.samples.locals3 import AWS_ENV, SeaweedFS, storage_options
from shard_tools.pack import PackError, PackOptions, pack
from shard_tools.sa1b import Sa1bSource
from shard_tools.verify import upgrade, verify
from conftest import indexed, new_bucket, split_keys
from procs import run_bounded

SMALL = dict(image_size=32, mask_size=8, max_masks=2)
REPO = str(pathlib.Path(__file__).resolve().parent.parent)
FAST = Retry(attempts=4, initial_delay=0.01, max_delay=0.05, throttle_seconds=0)  # (exact tries, throttling too)
os.environ.update({k: v for k, v in AWS_ENV.items() if k == "AWS_EC2_METADATA_DISABLED"})


@pytest.fixture
def proxy(server: SeaweedFS):
    p = FaultProxy(server.s3_port)
    yield p
    p.close()


@pytest.fixture(scope="module")
def remote(server: SeaweedFS, sa1b_dataset: str) -> str:
    """The packed SA-1B fixture uploaded as is: s3://<bucket>/sa1b."""
    fs = s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True)
    bucket = new_bucket(server)
    fs.put(sa1b_dataset + "/", f"{bucket}/sa1b/", recursive=True)
    return f"s3://{bucket}/sa1b"


def _epoch(source: str, **kwargs) -> list[dict]:
    settings = dict(batch_size=2, num_workers=0, seed=5, **SMALL)
    settings.update(kwargs)
    loader = make_stream_loader(source, "train", **settings)
    loader.set_epoch(1)
    return list(loader)


def _same(a: list[dict], b: list[dict]) -> None:
    assert [x["keys"] for x in a] == [y["keys"] for y in b]
    for x, y in zip(a, b, strict=True):
        for name in ("images", "masks", "boxes", "mask_counts"):
            assert torch.equal(x[name], y[name]), name


def test_stream_from_s3_equals_local_disk(remote, sa1b_dataset, proxy):
    local = _epoch(sa1b_dataset)
    _same(_epoch(remote, storage_options=storage_options(proxy.endpoint)), local)
    assert all("range" in r.headers for r in proxy.gets() if not r.target.split("?")[0].endswith("manifest.json"))


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_workers_open_their_own_filesystems(remote, sa1b_dataset, server, context):
    local = _epoch(sa1b_dataset, num_workers=2)
    _same(_epoch(remote, num_workers=2, multiprocessing_context=context,
                 storage_options=storage_options(server.endpoint)), local)


def _alive_after_collection(ref: weakref.ref, out) -> None:
    gc.collect()
    out.put(ref() is not None)


def test_filesystems_are_kept_per_process_and_never_collected_in_a_forked_child(remote, server):
    """s3fs's finalizer of a filesystem collected in a forked child waits a second for the parent's
    event loop, then prints "attached to a different loop" (and it ran in DataLoader workers)."""
    url, options = f"{remote}/manifest.json", storage_options(server.endpoint)
    fs, path = filesystem(url, options)
    assert fs.size(path) > 0 and filesystem(url, options)[0] is fs, "one per process and options"
    ref = weakref.ref(fs)
    del fs
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_alive_after_collection, args=(ref, out))
    child.start()
    assert out.get(timeout=30), "the parent's filesystem, collected in the child"
    child.join()
    forked = context.Process(target=lambda: filesystem(url, options)[0] is not ref() or os._exit(3))
    forked.start()
    forked.join()
    assert forked.exitcode == 0, "a forked child makes its own filesystem"


def test_pack_to_s3_is_byte_identical_to_local(sa1b_src, tmp_path, server, monkeypatch):
    for name, value in {**AWS_ENV, "AWS_ENDPOINT_URL": server.endpoint}.items():
        monkeypatch.setenv(name, value)  # shard-pack takes credentials from the environment, like s3fs
    options = PackOptions(shard_samples=3, splits=(("train", 0.7), ("val", 0.3)), workers=2)
    out = f"s3://{new_bucket(server)}/packed"
    pack(Sa1bSource(), [str(sa1b_src)], out, options, progress=False)
    pack(Sa1bSource(), [str(sa1b_src)], str(tmp_path / "local"), options, progress=False)
    fs, base = filesystem(out, storage_options(server.endpoint))
    remote_files = {p.removeprefix(base + "/"): fs.cat_file(p) for p in fs.find(base)}
    local_files = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    assert remote_files == local_files  # no `_pack` state left, manifest and shards equal
    # Packing again is a no-op, and the streamed samples are those of the local pack.
    assert pack(Sa1bSource(), [str(sa1b_src)], out, options, progress=False).samples == \
        Manifest.from_json(local_files["manifest.json"], "m").samples("train") + \
        Manifest.from_json(local_files["manifest.json"], "m").samples("val")
    _same(_epoch(out, storage_options=storage_options(server.endpoint)), _epoch(str(tmp_path / "local")))


def test_pack_to_a_missing_bucket_is_a_clear_error(sa1b_src, server, monkeypatch):
    for name, value in {**AWS_ENV, "AWS_ENDPOINT_URL": server.endpoint}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(PackError, match="does the bucket exist"):
        pack(Sa1bSource(), [str(sa1b_src)], f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x", PackOptions(),
             progress=False)


def test_range_reads_fetch_only_the_sample(remote, sa1b_dataset, proxy):
    shard, index = indexed(sa1b_dataset)[1]
    fs, base = filesystem(f"{remote}/{shard.name}", storage_options(proxy.endpoint))
    start, end = index.span(1)
    data = read_range(fs, base, shard.name, start, end)
    assert data == pathlib.Path(sa1b_dataset, shard.name).read_bytes()[start:end]
    assert [r.headers["range"] for r in proxy.gets()] == [f"bytes={start}-{end - 1}"]
    assert proxy.gets()[0].response_bytes - (end - start) < 1024  # the sample and the response head


@pytest.mark.parametrize("workers", [0, 2])
def test_samples_of_a_shard_are_read_in_merged_spans(remote, sa1b_dataset, proxy, workers):
    """From object storage the samples asked for together are read by shard in spans: fewer requests
    than samples, within the read amplification, every sample exactly once and equal to local disk;
    `read_ahead_bytes=0` reads each sample by a request of its own."""
    options = storage_options(proxy.endpoint)
    settings = dict(num_workers=workers, batch_size=2, shuffle=False)
    local = _epoch(sa1b_dataset, **settings)
    used = sum(int(np.diff(index.spans[i])[0]) for _, index in indexed(sa1b_dataset) for i in range(len(index.key_list())))
    samples = sum(len(b["keys"]) for b in local)
    for ahead_bytes in (0, 256 << 20):
        proxy.clear()
        _same(_epoch(remote, storage_options=options, read_ahead_bytes=ahead_bytes, read_amplification=1.5, **settings),
              local)
        tars = [r for r in proxy.gets() if r.target.split("?")[0].endswith(".tar")]
        if ahead_bytes:
            assert len(tars) < samples and sum(r.response_bytes for r in tars) <= 1.5 * used + 1024 * len(tars)
        else:
            assert len(tars) == samples


def test_a_span_that_fails_fails_each_of_its_samples_by_key(remote, sa1b_dataset, proxy):
    shard, index = indexed(sa1b_dataset)[0]
    proxy.fault("error500", count=1000, match=_is_shard_read)
    with pytest.raises(ShardError, match=rf"{remote}/{shard.name}: sample '{index.key(0)}': cannot read bytes .*after 4 "
                       "tries") as info:  # (the first sample of a span that reads the whole first shard)
        _epoch(remote, storage_options=storage_options(proxy.endpoint), retry=FAST, batch_size=len(index.key_list()),
               shuffle=False, read_ahead=0)
    assert "internal error" in str(info.value)
    assert proxy.served("error500") == 4  # the span's 4 tries; its samples are not read again one by one


def test_first_batch_reads_the_manifest_its_shards_indexes_and_its_samples_only(remote, sa1b_dataset, proxy):
    loader = make_stream_loader(remote, "train", batch_size=2, num_workers=0, read_ahead=0,
                                storage_options=storage_options(proxy.endpoint), **SMALL)
    batch = next(iter(loader))
    where = {k: (shard, index, i) for shard, index in indexed(sa1b_dataset) for i, k in enumerate(index.key_list())}
    touched = {where[k][0].name: where[k][0].index for k in batch["keys"]}
    needed = sum(int(np.diff(where[k][1].spans[where[k][2]])[0]) for k in batch["keys"])
    manifest_bytes = len(pathlib.Path(sa1b_dataset, "manifest.json").read_bytes())
    gets = proxy.gets()
    names = sorted(r.target.split("?")[0].rsplit("/", 1)[1] for r in gets)
    tars = [n for n in names if n.endswith(".tar")]  # samples of one shard are read by one request (merged spans)
    assert sorted(set(tars)) == sorted(touched) and len(tars) <= len(batch["keys"]), tars
    assert [n for n in names if not n.endswith(".tar")] == sorted(["manifest.json", *(i.name for i in touched.values())])
    fetched = sum(r.response_bytes for r in gets)
    indexes = sum(i.bytes for i in touched.values())
    allowed = manifest_bytes + indexes + LoaderConfig(batch_size=1).read_amplification * needed + len(gets) * 1024
    assert fetched < allowed, (fetched, manifest_bytes, indexes, needed)


def test_workers_read_ahead_and_download_only_once_the_first_batch_is_out(remote, sa1b_dataset, proxy, tmp_path,
                                                                         monkeypatch):
    """Until the main process has the loader's first batch, the workers read their first batches only: no
    read-ahead, no shard download into the cache (they would take the cores and the network from it).
    The first batch is held up in the main process here, so that the workers had time to run ahead."""
    loader = make_stream_loader(remote, "train", batch_size=2, num_workers=2, storage_options=storage_options(
        proxy.endpoint), cache_dir=str(tmp_path / "cache"), cache_limit=1 << 30, seed=5, **SMALL)
    loader.set_epoch(1)
    finish, out = type(loader.stream.kind).finish, []

    def slow_finish(kind, batch):  # (the main process's last step before the first batch is out)
        if not out:
            time.sleep(1.0)
            out.append(time.monotonic())
        return finish(kind, batch)

    monkeypatch.setattr(type(loader.stream.kind), "finish", slow_finish)
    batches = list(loader)
    sizes = {s.name: s.bytes for s in Manifest.from_json(pathlib.Path(sa1b_dataset, "manifest.json").read_bytes(),
                                                         "m").splits["train"]}
    tars = [(r, r.target.split("?")[0].rsplit("/", 1)[1]) for r in proxy.gets() if r.target.split("?")[0].endswith(".tar")]
    before = [r for r, _ in tars if r.at < out[0]]
    whole = [r for r, name in tars if r.headers["range"] == f"bytes=0-{sizes[name] - 1}"]
    assert whole and all(r.at > out[0] for r in whole), "downloads began after the first batch"
    assert 0 < len(before) <= 2 * 2, "each worker's first batch, by range"  # (2 workers, 2 samples a batch)
    _same(batches, _epoch(sa1b_dataset))


def _shard_gets(proxy: FaultProxy) -> list[str]:
    return [r.target.split("?")[0].rsplit("/", 1)[1] for r in proxy.gets() if r.target.split("?")[0].endswith(".tar")]


def test_cache_fetches_each_shard_once_for_two_workers_then_serves_locally(remote, sa1b_dataset, proxy, tmp_path):
    options = dict(storage_options=storage_options(proxy.endpoint), cache_dir=str(tmp_path / "cache"),
                   cache_limit=1 << 30, num_workers=2)
    local = _epoch(sa1b_dataset)
    _same(_epoch(remote, **options), local)  # cold: two worker processes share the directory
    manifest = Manifest.from_json(pathlib.Path(sa1b_dataset, "manifest.json").read_bytes(), "m")
    train = {s.name for s in manifest.splits["train"]}
    sizes = {s.name: s.bytes for s in manifest.splits["train"]}
    whole = [r.target.split("?")[0].rsplit("/", 1)[1] for r in proxy.gets() if r.headers.get("range", "").startswith("bytes=0-")
             and int(r.headers["range"].split("-")[1]) + 1 == sizes.get(r.target.split("?")[0].rsplit("/", 1)[1])]
    assert sorted(whole) == sorted(train)  # each shard downloaded once, whole (beside its samples' range reads)
    assert sorted(p.name for p in (tmp_path / "cache").glob("*.tar")) == \
        sorted(f"{s.sha256}.tar" for s in manifest.splits["train"])
    assert not list((tmp_path / "cache").glob("*.partial-*"))
    gets = [r.target.split("?")[0].rsplit("/", 1)[1] for r in proxy.gets()]
    assert gets.count("manifest.json") == 1, "the manifest fetched once (then read from the cache)"
    assert sorted(n for n in gets if n.endswith(".idx")) == sorted({s.index.name for s in manifest.splits["train"]}), \
        "each index fetched once, for both workers"
    proxy.clear()
    _same(_epoch(remote, **options), local)  # warm: no shard, index or manifest download at all
    assert [r.target for r in proxy.gets()] == [] and {r.method for r in proxy.requests} <= {"HEAD"}


def _node_rank(source: str, endpoint: str, cache: str, rank: int, by_range: bool, out) -> None:
    """One rank of a node of two (a process of its own, 2 DataLoader workers, batches of 1), through the
    node's cache, one download at a time per process (so that downloads wait their turn): its batches'
    keys and the SHA-256 of their tensors."""
    shard_reader.DOWNLOADS = 1  # (the workers forked from this process inherit it)
    loader = make_stream_loader(source, "train", batch_size=1, num_workers=2, multiprocessing_context="fork",
                                rank=rank, world_size=2, seed=5, storage_options=storage_options(endpoint),
                                cache_dir=cache, cache_limit=1 << 30, first_batch_by_range=by_range, **SMALL)
    loader.set_epoch(1)
    out.put((rank, _digests(loader)))


def _digests(batches) -> list[tuple[list[str], dict[str, str]]]:
    return [(batch["keys"], {name: hashlib.sha256(batch[name].numpy().tobytes()).hexdigest()
                             for name in ("images", "masks", "boxes", "mask_counts")}) for batch in batches]


@pytest.mark.parametrize("by_range", [True, False])
def test_a_node_of_two_ranks_fetches_each_shard_and_index_once_and_only_first_batches_by_range(
        sa1b_src, server, proxy, tmp_path, by_range):
    """Two ranks of one node, 2 workers each, sharing the cache: the node's requests are the manifest
    (a HEAD per rank, one GET), each shard's index and each shard's download (one request each), and
    each worker's first batch by range (none with `first_batch_by_range=False`); no sample waiting for
    its shard's download is read by range (before: 1 download at a time per process left the others'
    samples to ranges). Each rank's batches are those from local disk, sample for sample."""
    bucket = new_bucket(server)
    pack(Sa1bSource(), [str(sa1b_src)], f"{tmp_path}/two", PackOptions(shard_samples=1), progress=False)
    s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True).put(
        f"{tmp_path}/two/", f"{bucket}/two/", recursive=True)
    shards = Manifest.from_json((tmp_path / "two" / "manifest.json").read_bytes(), "m").splits["train"]
    sizes = {s.name: s.bytes for s in shards}

    def download(request) -> bool:
        name = request.target.split("?")[0].rsplit("/", 1)[1]
        return name in sizes and request.headers.get("range") == f"bytes=0-{sizes[name] - 1}"

    proxy.fault("delay", count=1000, seconds=0.5, match=download)  # (downloads take a while: others wait their turn)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    ranks = [context.Process(target=_node_rank, args=(f"s3://{bucket}/two", proxy.endpoint, str(tmp_path / "cache"),
                                                      rank, by_range, out)) for rank in (0, 1)]
    for rank in ranks:
        rank.start()
    results = dict(out.get(timeout=300) for _ in ranks)
    for rank in ranks:
        rank.join(timeout=60)
    for rank in (0, 1):
        local = make_stream_loader(f"{tmp_path}/two", "train", batch_size=1, num_workers=0, rank=rank, world_size=2,
                                   seed=5, **SMALL)
        local.set_epoch(1)
        assert results[rank] == _digests(local), f"rank {rank}"
    named = [(r, r.target.split("?")[0].rsplit("/", 1)[1]) for r in proxy.requests]
    whole = sorted(n for r, n in named if download(r))
    spans = [n for r, n in named if r.method == "GET" and n in sizes and not download(r)]
    assert whole == sorted(sizes), "each shard downloaded once, by one request"
    assert sorted(n for _, n in named if n.endswith(".idx")) == sorted(s.index.name for s in shards), \
        "each index fetched once for the node"
    assert [(r.method, n) for r, n in named if n == "manifest.json"].count(("GET", "manifest.json")) == 1
    first_batches = 2 * 2 * 1 if by_range else 0
    assert len(spans) <= first_batches, f"only each worker's first batch by range: {spans}"
    assert len(proxy.requests) <= 2 * len(shards) + 1 + 2 + first_batches, \
        "2 a shard, the manifest, a HEAD per rank, first batches"


def test_cache_stays_under_its_limit_evicting_least_recently_used(remote, sa1b_dataset, proxy, tmp_path):
    manifest = Manifest.from_json(pathlib.Path(sa1b_dataset, "manifest.json").read_bytes(), "m")
    limit = 2 * max(s.bytes for s in manifest.splits["train"])
    cache = tmp_path / "cache"
    result = _epoch(remote, storage_options=storage_options(proxy.endpoint), cache_dir=str(cache), cache_limit=limit,
                    num_workers=2)
    _same(result, _epoch(sa1b_dataset))
    assert sum(p.stat().st_size for p in cache.glob("*.tar")) <= limit
    assert len(_shard_gets(proxy)) >= len(manifest.splits["train"])
    with pytest.raises(ValueError, match="cannot hold the largest shard"):
        _epoch(remote, storage_options=storage_options(proxy.endpoint), cache_dir=str(tmp_path / "c2"), cache_limit=100)


def test_a_downloaded_shard_is_hashed_once_as_it_arrives(remote, sa1b_dataset, proxy, tmp_path, monkeypatch):
    """A download's SHA-256 is computed as its bytes arrive and recorded with the file: the cache does
    not read the shard back to hash it again (it did: a second SHA-256 of every shard of a cold epoch)."""
    hashed = []
    monkeypatch.setattr(storage.cache, "sha256_file", lambda path: hashed.append(path) or storage.sha256_file(path))
    options = dict(storage_options=storage_options(proxy.endpoint), cache_dir=str(tmp_path / "cache"),
                   cache_limit=1 << 30)
    _same(_epoch(remote, **options), _epoch(sa1b_dataset))
    assert list((tmp_path / "cache").glob("*.tar")) and hashed == []
    _epoch(remote, **options)  # (warm)
    assert hashed == []


def test_corrupted_cached_shard_is_fetched_again(remote, sa1b_dataset, proxy, tmp_path):
    options = dict(storage_options=storage_options(proxy.endpoint), cache_dir=str(tmp_path / "cache"),
                   cache_limit=1 << 30)
    local = _epoch(sa1b_dataset)
    _epoch(remote, **options)
    victim = sorted((tmp_path / "cache").glob("*.tar"))[0]
    data = bytearray(victim.read_bytes())
    data[700] ^= 0xFF  # inside the first sample's first member
    victim.write_bytes(bytes(data))
    proxy.clear()
    _same(_epoch(remote, **options), local)
    assert any(r.headers["range"] == f"bytes=0-{victim.stat().st_size - 1}" for r in proxy.gets())  # fetched again
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == victim.stem


def _is_shard_read(request) -> bool:
    return request.method == "GET" and request.target.split("?")[0].endswith(".tar")


@pytest.mark.parametrize("mode", ["slowdown", "error500", "reset", "cut"])
def test_transient_faults_are_retried_without_loss(remote, sa1b_dataset, proxy, mode):
    proxy.fault(mode, count=3, after_bytes=1000, match=_is_shard_read)
    result = _epoch(remote, storage_options=storage_options(proxy.endpoint), retry=FAST)
    _same(result, _epoch(sa1b_dataset))
    assert proxy.served(mode) == 3


def test_a_cut_long_read_resumes_from_the_piece_reached(remote, sa1b_dataset, proxy, monkeypatch):
    monkeypatch.setattr(storage.fs, "PIECE_BYTES", 4096)
    manifest = Manifest.from_json(pathlib.Path(sa1b_dataset, "manifest.json").read_bytes(), "m")
    shard = manifest.splits["train"][0]
    fs, base = filesystem(f"{remote}/{shard.name}", storage_options(proxy.endpoint))
    nth = iter(range(100))
    proxy.fault("cut", count=1, after_bytes=1000, match=lambda r: next(nth) == 2)  # the third piece
    data = read_range(fs, base, shard.name, 0, shard.bytes, retry=FAST)
    assert data == pathlib.Path(sa1b_dataset, shard.name).read_bytes()
    ranges = [r.headers["range"] for r in proxy.gets()]
    pieces = [f"bytes={i}-{min(i + 4096, shard.bytes) - 1}" for i in range(0, shard.bytes, 4096)]
    assert ranges == pieces[:3] + pieces[2:]  # only the cut piece is asked for twice


def test_a_cut_stream_resumes_from_the_byte_reached(remote, sa1b_dataset, proxy, monkeypatch):
    """A download streams a shard by one request; cut, it is asked for again from the byte reached."""
    monkeypatch.setattr(storage.s3, "STREAM_CHUNK", 256)
    shard = Manifest.from_json(pathlib.Path(sa1b_dataset, "manifest.json").read_bytes(), "m").splits["train"][0]
    reader = ranged_reader(f"{remote}/{shard.name}", storage_options(proxy.endpoint), FAST)
    assert hasattr(reader.client, "stream")  # (the lean client)
    proxy.fault("cut", count=1, after_bytes=1000, match=_is_shard_read)
    data = b"".join(bytes(chunk) for chunk in reader.stream(0, shard.bytes))
    assert data == pathlib.Path(sa1b_dataset, shard.name).read_bytes()
    first, second = (r.headers["range"] for r in proxy.gets())
    resumed = int(second.removeprefix("bytes=").split("-")[0])
    assert first == f"bytes=0-{shard.bytes - 1}" and 0 < resumed <= 1000, (first, second)  # (not from 0)
    proxy.clear()
    proxy.fault("reset", count=1000, match=_is_shard_read)
    with pytest.raises(ShardError, match=rf"{shard.name}: cannot read bytes 0-{shard.bytes} after 4 tries"):
        list(reader.stream(0, shard.bytes))
    assert proxy.served("reset") == 4


def test_stall_past_the_read_timeout_is_retried(remote, sa1b_dataset, proxy):
    proxy.fault("stall", count=1, seconds=4, match=_is_shard_read)
    options = storage_options(proxy.endpoint, read_timeout=1, connect_timeout=1)
    _same(_epoch(remote, storage_options=options, retry=FAST), _epoch(sa1b_dataset))
    assert proxy.served("stall") == 1


# Options for each ranged client: the lean one (obstore), and s3fs (an option the lean one cannot honour).
CLIENT_OPTIONS = {"lean": {}, "s3fs": {"max_pool_connections": 10}}


@pytest.mark.parametrize("client", ["lean", "s3fs"])
@pytest.mark.parametrize("mode", ["slowdown", "reset"])
def test_faults_past_the_bound_fail_naming_url_and_cause(remote, proxy, mode, client):
    proxy.fault(mode, count=1000, match=_is_shard_read)
    with pytest.raises(ShardError, match=rf"{remote}/train-\d+\.tar: sample .*after 4 tries") as info:
        _epoch(remote, storage_options=storage_options(proxy.endpoint, **CLIENT_OPTIONS[client]), retry=FAST,
               read_ahead=0, batch_size=1)
    if mode == "slowdown":
        assert "reduce your request rate" in str(info.value)
        assert proxy.served(mode) == 4  # exactly `attempts` tries: the clients' own retries are off
    elif client == "lean":
        assert proxy.served(mode) == 4
    else:  # aiohttp repeats an idempotent request once when the connection drops (RFC 9112 section 9.3.1)
        assert proxy.served(mode) == 2 * 4


@pytest.mark.parametrize("client", ["lean", "s3fs"])
def test_an_epoch_under_30_percent_throttling_finishes(remote, sa1b_dataset, proxy, client):
    """503 SlowDown on 30% of GETs, one try allowed for any other failure: throttling is ridden out
    within the time budget, and the epoch is what local disk gives."""
    gets = itertools.count()
    proxy.fault("slowdown", count=1 << 30, match=lambda r: r.method == "GET" and next(gets) % 10 < 3)
    retry = Retry(attempts=1, initial_delay=0.01, max_delay=0.05, throttle_seconds=30)
    result = _epoch(remote, storage_options=storage_options(proxy.endpoint, **CLIENT_OPTIONS[client]), retry=retry,
                    num_workers=2, read_ahead_bytes=0)  # (a request per sample)
    _same(result, _epoch(sa1b_dataset))
    assert proxy.served("slowdown") >= 0.25 * len(proxy.gets()) >= 5


class _RetryClock:
    """The retry policy's `time` and `random` (`storage.retry`): a clock that moves only by its waits,
    and the middle of each jitter range."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    @staticmethod
    def uniform(low: float, high: float) -> float:
        return (low + high) / 2


def test_throttling_past_its_time_budget_fails_naming_it_and_other_faults_keep_exact_tries(remote, proxy,
                                                                                          monkeypatch):
    """On the policy's own clock (its waits move it; the requests take no time on it): waits of 0.125
    s, then 0.25 s, keep a throttled request within its 1 s budget up to its 5th failure, whose wait
    would end at 1.125 s; from there throttling uses up tries: with attempts=2, the 6th failure ends it."""
    shard = f"{remote}/train-000000.tar"
    reader = ranged_reader(shard, storage_options(proxy.endpoint), Retry(attempts=2, initial_delay=0.125,
                                                                         max_delay=0.25, throttle_seconds=1.0))
    proxy.fault("slowdown", count=1000)
    with monkeypatch.context() as patched:  # (the reset's retry below waits for real: its connection is closed first)
        clock = _RetryClock()
        patched.setattr(storage.retry, "time", clock)
        patched.setattr(storage.retry, "random", clock)
        with pytest.raises(ShardError, match=r"cannot read bytes 0-100 after 6 tries over 1\.1 s of throttling "
                                             r"\(throttle_seconds=1\): S3Error: 503 SlowDown"):
            reader.read(0, 100)
    assert proxy.served("slowdown") == 6 and clock.now == 1000.0 + 0.125 + 4 * 0.25
    proxy.clear()
    proxy.fault("reset", count=1000)
    with pytest.raises(ShardError, match=r"cannot read bytes 0-100 after 2 tries: "):
        reader.read(0, 100)
    assert proxy.served("reset") == 2
    with pytest.raises(ValueError, match="throttle_seconds must be a finite number of seconds >= 0"):
        Retry(throttle_seconds=-1)


def test_bad_credentials_and_missing_bucket_are_clear_errors(remote, server):
    with pytest.raises(ManifestError, match="access denied"):
        make_stream_loader(remote, "train", batch_size=2, num_workers=0,
                           storage_options=storage_options(server.endpoint, secret="wrong"), **SMALL)
    with pytest.raises(ManifestError, match="bucket does not exist"):
        make_stream_loader("s3://no-such-bucket/sa1b", "train", batch_size=2, num_workers=0,
                           storage_options=storage_options(server.endpoint), **SMALL)


def test_upgrade_in_place_on_object_storage(server, sa1b_dataset, tmp_path):
    from test_index import _downgrade

    old = tmp_path / "old"
    shutil.copytree(sa1b_dataset, old)
    _downgrade(old)
    fs = s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True)
    url = f"s3://{new_bucket(server)}/old"
    fs.put(str(old) + "/", url.removeprefix("s3://") + "/", recursive=True)
    _same(_epoch(url, storage_options=storage_options(server.endpoint)), _epoch(sa1b_dataset))  # schema 2, as it is
    assert "upgraded from schema 2" in upgrade(url, progress=False, storage_options=storage_options(server.endpoint))
    for path in pathlib.Path(sa1b_dataset).iterdir():
        assert fs.cat_file(f"{url}/{path.name}".removeprefix("s3://")) == path.read_bytes(), path.name
    _same(_epoch(url, storage_options=storage_options(server.endpoint)), _epoch(sa1b_dataset))


# A training process that stops after its first batch until told to go on (the test cuts the shards
# meanwhile); with "hold", it first opens every shard for writing, so that no read lease can be had.
_CUT_CHILD = r"""
import pathlib, sys
from pipeline import make_stream_loader
root, workers, hold = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "hold"
held = [open(p, "r+b") for p in sorted(pathlib.Path(root).glob("*.tar"))] if hold else []
loader = make_stream_loader(root, "train", batch_size=1, num_workers=workers, shuffle=False, image_size=32,
                            mask_size=8, max_masks=2)
for i, batch in enumerate(loader):
    if i == 0:
        print("first batch", flush=True)
        sys.stdin.readline()
print("epoch done", flush=True)
"""


def _cut_in_place(path: pathlib.Path) -> None:
    """Truncate a shard in place, as a tool rewriting it would; where a reader maps it, only start to:
    the open fails at once but the reader's lease break has begun (a blocking truncate would wait)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except BlockingIOError:
        return
    try:
        os.ftruncate(fd, os.fstat(fd).st_size // 3)
    finally:
        os.close(fd)


@pytest.mark.parametrize(("workers", "hold"), [(0, ""), (2, ""), (2, "hold")])
def test_a_shard_cut_in_place_mid_epoch_ends_in_a_named_error_never_a_signal(sa1b_dataset, tmp_path, workers, hold):
    root = tmp_path / "ds"
    shutil.copytree(sa1b_dataset, root)
    child = subprocess.Popen([sys.executable, "-c", _CUT_CHILD, str(root), str(workers), hold or "-"], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": REPO}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "first batch\n"
        for shard in sorted(root.glob("train-*.tar")):
            _cut_in_place(shard)
        out, err = child.communicate("go\n", timeout=300)
    finally:
        child.kill()
    assert child.returncode == 1, f"ended by signal {-child.returncode}" if child.returncode < 0 else err[-3000:]
    assert re.search(r"ShardError: \S+/train-\d{6}\.tar: ", err), err[-3000:]
    assert "epoch done" not in out
    if hold:  # (without it, a worker mapping a shard while the test has it open for writing reads it by copy too)
        assert "read by copy instead of memory-mapped" in err


@pytest.mark.parametrize("workers", [0, 2])
def test_verify_sha256_names_a_shard_changed_at_the_same_size(sa1b_dataset, tmp_path, workers):
    root = tmp_path / "ds"
    shutil.copytree(sa1b_dataset, root)
    options = dict(batch_size=2, num_workers=workers, seed=5, **SMALL)
    clean = list(make_stream_loader(str(root), "train", **options))
    _same(list(make_stream_loader(str(root), "train", verify="sha256", **options)), clean)
    shard, index = indexed(str(root))[1]
    data = bytearray((root / shard.name).read_bytes())
    jpeg = index.span(1)[0] + 512  # (after the member's tar header)
    assert data[jpeg : jpeg + 4] == b"\xff\xd8\xff\xe0" and data[jpeg + 6 : jpeg + 10] == b"JFIF"
    data[jpeg + 15] ^= 0x01  # the JPEG's pixel density: it still decodes; the same size, the same keys
    (root / "replacement").write_bytes(bytes(data))
    os.replace(root / "replacement", root / shard.name)
    assert len(list(make_stream_loader(str(root), "train", **options))) == len(clean), "the size check cannot see it"
    with pytest.raises(ShardError, match=rf"{shard.name}: sample 'sa_\d+': content has SHA-256 [0-9a-f]{{64}}, the manifest says "
                                         rf"{shard.sha256}"):
        list(make_stream_loader(str(root), "train", verify="sha256", **options))
    with pytest.raises(ValueError, match="verify must be 'size' or 'sha256'"):
        make_stream_loader(str(root), "train", verify="md5", **options)


_FORK_WHILE_HASHING = """
import hashlib, os, sys, threading
import numpy as np
from pipeline import make_stream_loader
from pipeline.format import ShardInfo
from pipeline.storage import Retry, ShardReader
root, name, size, sha256 = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
parent, gate, hashing, plain = os.getpid(), threading.Event(), threading.Event(), hashlib.sha256

class Held:  # the first loader's hash of the shard, held (in this process only) until the gate opens
    def __init__(self, data=b""):
        self.digest = plain(data)
    def update(self, data):
        if os.getpid() == parent and not gate.is_set():
            hashing.set()
            gate.wait()
        self.digest.update(data)
    def hexdigest(self):
        return self.digest.hexdigest()

hashlib.sha256 = Held
reader = ShardReader(root, None, Retry(), verified=(np.zeros((1, 3), np.int64), [name]))
way = reader.way(ShardInfo(name, 1, 1, size, sha256, None))
threading.Thread(target=way.read, args=(0, 512)).start()
assert hashing.wait(30)  # this process holds the lock of the shard it is hashing
loader = make_stream_loader(root, "train", batch_size=2, num_workers=2, verify="sha256", multiprocessing_context="fork",
                            image_size=32, mask_size=8, max_masks=2)
batches = iter(loader)  # (its workers forked now)
threading.Timer(0.5, gate.set).start()
print(sum(len(b["keys"]) for b in batches))
"""


def test_workers_forked_while_a_shard_is_hashed_never_wait_for_its_lock(sa1b_dataset):
    """verify="sha256" hashes a shard under a lock, which a DataLoader's fork copied into its workers
    (an flock belongs to the open file): once the hash was done, the workers waited forever for a
    lock only their own copies held. The main process holds it as they fork; they finish."""
    shard, _ = indexed(sa1b_dataset)[0]
    out, err = run_bounded([sys.executable, "-c", _FORK_WHILE_HASHING, sa1b_dataset, shard.name, str(shard.bytes),
                            shard.sha256], 90, "the loader's workers hung on the lock of a shard hashed as they were forked")
    assert out.split() == [str(len(split_keys(sa1b_dataset)) // 2 * 2)], err


_FORK_AFTER_OBSTORE = """
import json, logging, sys
from pipeline import make_stream_loader
from pipeline.storage.s3 import _CLIENTS
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
remote, options = sys.argv[1], json.loads(sys.argv[2])
settings = dict(batch_size=2, seed=5, storage_options=options, image_size=32, mask_size=8, max_masks=2)
first = [b["keys"] for b in make_stream_loader(remote, "train", num_workers=0, **settings)]
assert _CLIENTS, "the main process read through obstore"
forked = make_stream_loader(remote, "train", num_workers=2, multiprocessing_context="fork", **settings)
print(json.dumps([first, [b["keys"] for b in forked]]))
"""


def test_workers_forked_after_obstore_ran_read_through_s3fs_and_say_so(server, remote):
    """obstore's runtime does not survive a fork: a worker forked from a process that read through it
    reads through s3fs instead (the same samples, ~5x the CPU per request) and says why, once, as a
    warning (one that hung or crashed there would end this process by its time bound)."""
    out, err = run_bounded([sys.executable, "-c", _FORK_AFTER_OBSTORE, remote, json.dumps(storage_options(
        server.endpoint))], 120, "workers forked after obstore ran in the main process hung")
    first, forked = json.loads(out)
    assert first == forked and first, err
    assert err.count("cannot run here (use the 'spawn' or 'forkserver' multiprocessing context") == 2, err  # (a worker each)
    assert err.count("WARNING") == 2, err


def _changed_upstream(server: SeaweedFS, sa1b_dataset: str) -> tuple[str, str, list[str]]:
    """The packed fixture uploaded, then one shard rewritten upstream at the same size (a byte of a
    JPEG's header: it still decodes): (the dataset's URL, that shard's URL, its keys)."""
    fs = s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True)
    source = f"s3://{new_bucket(server)}/sa1b"
    fs.put(sa1b_dataset + "/", source + "/", recursive=True)
    shard, index = indexed(sa1b_dataset)[1]
    data = bytearray(pathlib.Path(sa1b_dataset, shard.name).read_bytes())
    data[index.span(0)[0] + 512 + 15] ^= 0x01  # (the JPEG's pixel density)
    fs.pipe_file(f"{source}/{shard.name}", bytes(data))
    return source, f"{source}/{shard.name}", index.key_list()


def test_a_shard_changed_upstream_is_an_error_with_the_cache_never_a_warning(server, sa1b_dataset, tmp_path):
    """Before: the cache found the SHA-256 mismatch, logged 'caching failed' as a warning, and the
    changed bytes were yielded from the object by range, run after run. Now the mismatch is an
    error under the on_error policy, and no later read of the shard serves its object's bytes."""
    source, url, keys = _changed_upstream(server, sa1b_dataset)
    options = dict(storage_options=storage_options(server.endpoint), cache_dir=str(tmp_path / "cache"),
                   cache_limit=1 << 30)
    with pytest.raises(ShardError, match=rf"{url}: .*downloaded shard has SHA-256 [0-9a-f]{{64}}, the manifest says"):
        _epoch(source, **options)  # (on_error="raise"; samples taken before the check ended are said to be used)
    with pytest.raises(ShardError, match=rf"{url}: sample '{keys[0]}': downloaded shard has SHA-256 .* it is not read "
                                         r"for this shard again \(remove .*\.bad once the object is restored\)"):
        _epoch(source, **options, shuffle=False)  # (its first sample: refused at once)
    loader = make_stream_loader(source, "train", batch_size=2, num_workers=2, seed=5, on_error="skip", drop_last=False,
                                **options, **SMALL)  # (its workers read the record the first run left)
    seen = [k for batch in loader for k in batch["keys"]]
    assert not set(seen) & set(keys) and loader.skipped == len(keys)
    assert sorted(seen) == sorted(set(split_keys(sa1b_dataset)) - set(keys))


def test_a_shard_larger_in_the_manifest_than_its_object_evicts_nothing(remote, sa1b_dataset, server, tmp_path):
    """Before: the cache reserved the size the manifest claims (fallocate), evicting the cached shards
    to make room, then yielded the object's samples. Now its size is asked for first: every sample
    of that shard is an error, and nothing is reserved or evicted."""
    fs = s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True)
    source = f"s3://{new_bucket(server)}/sa1b"
    fs.put(sa1b_dataset + "/", source + "/", recursive=True)
    manifest = json.loads(pathlib.Path(sa1b_dataset, "manifest.json").read_text())
    table = manifest["splits"]["train"]["shards"]
    claimed, real = table["bytes"][1] + (64 << 20), table["bytes"][1]
    cache, options = tmp_path / "cache", dict(storage_options=storage_options(server.endpoint))
    _epoch(source, cache_dir=str(cache), cache_limit=claimed + real, **options)  # (every train shard cached)
    (cache / f"{table['sha256'][1]}.tar").unlink()  # (but that one)
    cached = sorted(p.name for p in cache.glob("*.tar"))
    table["bytes"][1] = claimed  # (and its index says so too, as a crafted dataset's would)
    index = indexed(sa1b_dataset)[1][1].to_bytes(claimed)
    table["index_bytes"][1], table["index_sha256"][1] = len(index), hashlib.sha256(index).hexdigest()
    fs.pipe_file(f"{source}/{table['index'][1]}", index)
    fs.pipe_file(f"{source}/manifest.json", json.dumps(manifest).encode())
    loader = make_stream_loader(source, "train", batch_size=2, num_workers=0, seed=5, on_error="skip",
                                cache_dir=str(cache), cache_limit=claimed + real, **options, **SMALL)
    seen = [k for batch in loader for k in batch["keys"]]
    keys = indexed(sa1b_dataset)[1][1].key_list()
    assert not set(seen) & set(keys) and loader.skipped == len(keys)
    assert sorted(p.name for p in cache.glob("*.tar")) == cached, "nothing evicted"
    assert not list(cache.glob("*.partial-*")) and sum(p.stat().st_blocks for p in cache.iterdir()) * 512 < claimed


@pytest.mark.parametrize("change", ["longer", "shorter"])
@pytest.mark.parametrize("read_ahead_bytes", [0, 256 << 20], ids=["by sample", "in spans"])
def test_a_shard_resized_upstream_is_named_by_the_answers_without_asking_its_size(
        server, sa1b_dataset, proxy, change, read_ahead_bytes):
    """Every ranged answer of the lean client says the object's size: each read checks it against the
    manifest's, so that no HEAD is sent (one per shard and process before), and a resized shard is
    still named before any of its samples is used; cut short, its last sample's range runs past the
    end (416, or fewer bytes), and that too is said as the two sizes."""
    fs = s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True)
    source = f"s3://{new_bucket(server)}/sa1b"
    fs.put(sa1b_dataset + "/", source + "/", recursive=True)
    shard, index = indexed(sa1b_dataset)[1]
    data = pathlib.Path(sa1b_dataset, shard.name).read_bytes()
    changed = data + bytes(1024) if change == "longer" else data[: index.span(len(index.key_list()) - 1)[0] + 600]
    fs.pipe_file(f"{source}/{shard.name}", changed)
    options = dict(storage_options=storage_options(proxy.endpoint), read_ahead_bytes=read_ahead_bytes)
    with pytest.raises(ShardError, match=rf"{source}/{shard.name}: sample '[^']+': shard is {len(changed)} bytes, "
                                         rf"the manifest says {len(data)}"):
        _epoch(source, **options, shuffle=False)
    proxy.clear()
    loader = make_stream_loader(source, "train", batch_size=2, num_workers=0, seed=5, on_error="skip",
                                drop_last=False, **options, **SMALL)
    seen = [k for batch in loader for k in batch["keys"]]
    assert sorted(seen) == sorted(set(split_keys(sa1b_dataset)) - set(index.key_list()))
    assert loader.skipped == len(index.key_list())
    heads = [r.target for r in proxy.requests if r.method == "HEAD" and ".tar" in r.target]
    assert not heads, heads


def test_verify_sha256_refuses_object_storage(remote, server):
    with pytest.raises(ValueError, match=r"verify='sha256' checks shards on local disk; s3://"):
        make_stream_loader(remote, "train", batch_size=2, num_workers=0, storage_options=storage_options(server.endpoint),
                           verify="sha256", **SMALL)


def _cached_epochs(source: str, endpoint: str, cache: str, limit: int, seed: int, out) -> None:
    loader = make_stream_loader(source, "train", batch_size=1, num_workers=2, seed=seed, cache_dir=cache,
                                cache_limit=limit, storage_options=storage_options(endpoint), **SMALL)
    out.put(sorted(k for b in loader for k in b["keys"]))


def _watch(cache: storage.ShardCache, stop: threading.Event, peaks: dict[str, int]) -> None:
    """The largest bytes seen in the cache's directory: of shards and downloads, and of every file.
    Each look is taken under the cache's lock, so that it is of one moment (files only grow under it)."""
    while not stop.is_set():
        every = {}
        with cache.locked():
            for entry in os.scandir(cache.directory):
                with contextlib.suppress(FileNotFoundError):
                    every[entry.name] = entry.stat().st_size
        shards = {k: v for k, v in every.items() if k.endswith(".tar") or ".tar.partial-" in k}
        peaks["shards"] = max(peaks["shards"], sum(shards.values()))
        peaks["all"] = max(peaks["all"], sum(every.values()))


def test_two_processes_sharing_a_cache_stay_within_its_limit(sa1b_src, server, tmp_path):
    bucket = new_bucket(server)
    pack(Sa1bSource(), [str(sa1b_src)], f"{tmp_path}/one", PackOptions(shard_samples=1), progress=False)
    s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True).put(
        f"{tmp_path}/one/", f"{bucket}/one/", recursive=True)
    shards = Manifest.from_json((tmp_path / "one" / "manifest.json").read_bytes(), "m").splits["train"]
    limit = 3 * max(s.bytes for s in shards)  # room for 3 of the 14 shards; 2 processes x 2 workers download
    cache = tmp_path / "cache"
    cache.mkdir()
    peaks, stop = {"shards": 0, "all": 0}, threading.Event()
    watcher = threading.Thread(target=_watch, args=(storage.ShardCache(str(cache), limit), stop, peaks), daemon=True)
    watcher.start()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    children = [context.Process(target=_cached_epochs, args=(f"s3://{bucket}/one", server.endpoint, str(cache), limit,
                                                             seed, out)) for seed in (1, 2)]
    for child in children:
        child.start()
    results = [out.get(timeout=300) for _ in children]
    for child in children:
        child.join(timeout=60)
    stop.set()
    watcher.join()
    every = sorted(split_keys(f"{tmp_path}/one"))
    assert all(keys == every for keys in results), "every sample, cached or by range"
    assert 0 < peaks["shards"] <= limit, f"shards and downloads peaked at {peaks['shards']} bytes, over the {limit} limit"
    assert peaks["all"] <= limit + 100 * len(shards), peaks  # (+ the .ok stamps)
    left = [p.name for p in cache.iterdir() if not p.name.endswith((".tar", ".tar.ok", ".idx", ".json"))]
    assert left == [], "no lock or download left (beside shards, their stamps, indexes and the manifest)"


def _rss_file_kb() -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["RssFile"].split()[0])


def test_a_released_mapped_sample_leaves_resident_memory(tmp_path):
    """Pages of a mapped shard that a sample touched count in the process's RSS until released;
    released, they leave it (the page cache keeps them) and read back the same bytes."""
    from pipeline.format import ShardInfo
    from pipeline.storage import Retry, ShardReader, release_pages

    data = np.random.default_rng(0).integers(0, 256, 48 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "s.tar").write_bytes(data)
    reader = ShardReader(str(tmp_path), None, Retry())
    view = reader.way(ShardInfo("s.tar", 1, 1, len(data), "0" * 64, None)).read(4096, len(data) - 4096)
    if not isinstance(view, memoryview):
        pytest.skip("no read lease here: shards are read by copy")
    before = _rss_file_kb()
    assert int(np.frombuffer(view, np.uint8)[::4096].astype(np.int64).sum()) >= 0  # touch every page
    touched = _rss_file_kb()
    release_pages(view)
    released = _rss_file_kb()
    assert touched - before > 40_000  # ~48 MB faulted in
    assert touched - released > 40_000  # and out again
    assert bytes(view[:1000]) == data[4096:5096] and bytes(view[-1000:]) == data[-5096:-4096]
    release_pages(b"copied bytes")  # (read by copy: nothing to do)


def test_verify_on_object_storage_reads_each_shard_once_and_checks_every_sample(server, sa1b_dataset, proxy):
    """`shard-pack verify` of an s3:// dataset streams each shard front to back once (its samples are
    checked from that copy), not a range request per sample; a damaged sample is still named."""
    fs = s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True)
    root = f"s3://{new_bucket(server)}/sa1b"
    fs.put(sa1b_dataset + "/", root[5:] + "/", recursive=True)
    options = storage_options(proxy.endpoint)
    assert verify(root, progress=False, storage_options=options) == []
    manifest = Manifest.from_json(pathlib.Path(sa1b_dataset, "manifest.json").read_bytes(), sa1b_dataset)
    shards = {s.name: s for split in manifest.splits.values() for s in split}
    tar_gets = [r.target.split("?")[0].rsplit("/", 1)[1] for r in proxy.gets() if r.target.split("?")[0].endswith(".tar")]
    assert sorted(set(tar_gets)) == sorted(shards) and all(tar_gets.count(name) == 1 for name in shards), tar_gets
    assert sum(s.samples for s in shards.values()) > len(shards)

    shard, index = indexed(sa1b_dataset)[0]
    name = shard.name
    data = bytearray(pathlib.Path(sa1b_dataset, name).read_bytes())
    start, end = index.span(1)
    data[start + 2048 : end - 1024] = bytes(end - 1024 - start - 2048)  # the sample's bytes zeroed, the size kept
    fs.pipe(f"{root[5:]}/{name}", bytes(data))
    problems = verify(root, progress=False, storage_options=options)
    assert any(f"{name}: SHA-256" in p for p in problems)
    assert any(f"sample {index.key(1)!r}" in p for p in problems), problems


def _verify_victim(server: SeaweedFS, sa1b_dataset: str) -> tuple[str, str, int]:
    """A fresh copy of the dataset on the server: (its root, the shard the tests below fault, its size)."""
    fs = s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True)
    root = f"s3://{new_bucket(server)}/sa1b"
    fs.put(sa1b_dataset + "/", root[5:] + "/", recursive=True)
    shard, _ = indexed(sa1b_dataset)[1]
    return root, shard.name, shard.bytes


def _tar_gets(proxy: FaultProxy, name: str | None = None) -> list[str]:
    """The ranges asked for by GETs of shard `name` (or the names of every shard GET)."""
    gets = [r for r in proxy.gets() if r.target.split("?")[0].endswith(".tar")]
    if name is None:
        return [r.target.split("?")[0].rsplit("/", 1)[1] for r in gets]
    return [r.headers.get("range") for r in gets if r.target.split("?")[0].endswith(f"/{name}")]


def _backoffs(seed: int, initial: float, most: float, tries: int) -> list[float]:
    """The waits before tries 2, 3, ... of a request, as `Retry` documents them: `initial * 2**n`, at
    most `most`, times a factor drawn in [0.5, 1.5) from `random` seeded with `seed`."""
    draw = random.Random(seed)
    return [min(most, initial * 2 ** n) * draw.uniform(0.5, 1.5) for n in range(tries)]


@pytest.mark.parametrize("then", [None, "reset", "error500", "slowdown"])
def test_verify_resumes_a_cut_stream_from_the_byte_reached(server, sa1b_dataset, proxy, monkeypatch, then):
    """A shard's stream cut in the middle is asked for again from the byte reached (not from its
    start), also when the requests that resume it meet a reset, a 500 or a 503 SlowDown first, each
    after its own backoff with jitter; verify reports OK."""
    monkeypatch.setattr(storage.s3, "STREAM_CHUNK", 1)  # (bytes handed over as they arrive: the cut's own byte)
    root, name, size = _verify_victim(server, sa1b_dataset)
    half = size // 2
    victim = lambda r: r.method == "GET" and r.target.split("?")[0].endswith(f"/{name}")  # noqa: E731
    proxy.fault("cut", count=1, after_bytes=half, match=victim)
    if then is not None:
        proxy.fault(then, count=2, match=victim)
    waited = []
    retry = Retry(attempts=4, initial_delay=0.1, max_delay=0.25, throttle_seconds=0, sleep=waited.append)
    random.seed(23)
    assert verify(root, progress=False, storage_options=storage_options(proxy.endpoint), retry=retry) == []
    resumed = [f"bytes={half}-{size - 1}"] * (1 if then is None else 3)
    assert _tar_gets(proxy, name) == [f"bytes=0-{size - 1}", *resumed]
    assert proxy.served("cut") == 1 and (then is None or proxy.served(then) == 2)
    assert waited == _backoffs(23, 0.1, 0.25, 1 if then is None else 3), "each try after its own backoff, in turn"
    names = _tar_gets(proxy)
    assert all(names.count(other) == 1 for other in set(names) - {name}), "every other shard: one request"


@pytest.mark.parametrize("then", ["reset", "error500"])
def test_verify_past_the_retry_bound_names_the_shard(server, sa1b_dataset, proxy, monkeypatch, then, capsys):
    """Cut, then failing every try: a problem naming the shard, the bytes and the cause after exactly
    `attempts` tries from the byte reached; the other shards are still verified."""
    monkeypatch.setattr(storage.s3, "STREAM_CHUNK", 1)
    root, name, size = _verify_victim(server, sa1b_dataset)
    half = size // 2
    victim = lambda r: r.method == "GET" and r.target.split("?")[0].endswith(f"/{name}")  # noqa: E731
    proxy.fault("cut", count=1, after_bytes=half, match=victim)
    proxy.fault(then, count=1000, match=victim)
    cause = "S3Error: 500 InternalError: We encountered an internal error." if then == "error500" else "ConnectionError"
    problems = verify(root, progress=False, storage_options=storage_options(proxy.endpoint), retry=FAST)
    assert len(problems) == 1 and problems[0].startswith(f"{root}/{name}: cannot read bytes {half}-{size} after 4 "
                                                         f"tries: {cause}"), problems
    assert problems[0].endswith("; its samples are not checked")
    assert _tar_gets(proxy, name) == [f"bytes=0-{size - 1}"] + [f"bytes={half}-{size - 1}"] * 3
    names = _tar_gets(proxy)
    assert all(names.count(other) == 1 for other in set(names) - {name}) and len(set(names)) > 1


def _user_agents(proxy: FaultProxy, shards: bool) -> set[str]:
    return {r.headers.get("user-agent", "").split("/")[0] for r in proxy.requests
            if r.target.split("?")[0].endswith(".tar") == shards}


def test_s3_shards_are_read_by_the_lean_client_and_options_it_cannot_honour_by_s3fs(remote, sa1b_dataset, proxy,
                                                                                    caplog):
    local = _epoch(sa1b_dataset)
    _same(_epoch(remote, storage_options=storage_options(proxy.endpoint)), local)
    assert _user_agents(proxy, shards=True) == {"object_store"}  # ranges and sizes: obstore
    assert "object_store" not in {r.headers.get("user-agent", "").split("/")[0] for r in proxy.requests
                                  if r.target.split("?")[0].endswith("manifest.json")}  # the manifest: s3fs
    proxy.clear()
    caplog.set_level(logging.DEBUG, "pipeline.storage")
    _same(_epoch(remote, storage_options=storage_options(proxy.endpoint, max_pool_connections=10)), local)
    assert "object_store" not in _user_agents(proxy, shards=True)
    assert "read through s3fs, not the lean client: options config_kwargs['max_pool_connections']" in caplog.text


def test_slowdown_on_the_lean_client_backs_off_with_jitter_for_exact_tries(remote, sa1b_dataset, proxy):
    shard, index = indexed(sa1b_dataset)[1]
    start, end = index.span(1)
    waited = []
    retry = Retry(attempts=4, initial_delay=0.1, max_delay=0.25, throttle_seconds=0, sleep=waited.append)
    reader = ranged_reader(f"{remote}/{shard.name}", storage_options(proxy.endpoint), retry)
    proxy.fault("slowdown", count=3)
    waits = _backoffs(23, 0.1, 0.25, 3)
    assert all(abs(wait / bare - 1) > 0.05 for wait, bare in zip(waits, (0.1, 0.2, 0.25))), "jitter: " + str(waits)
    random.seed(23)
    assert reader.read(start, end) == pathlib.Path(sa1b_dataset, shard.name).read_bytes()[start:end]
    gets = proxy.gets()
    assert [r.fault for r in gets] == ["slowdown"] * 3 + [None] and {r.headers["range"] for r in gets} == \
        {f"bytes={start}-{end - 1}"}
    assert waited == waits, "each retry after its own backoff, no extra tries"
    proxy.clear()
    proxy.fault("slowdown", count=1000)
    with pytest.raises(ShardError, match=rf"{shard.name}: cannot read bytes {start}-{end} after 4 tries: "
                                         r"S3Error: 503 SlowDown: Please reduce your request rate\."):
        reader.read(start, end)
    assert proxy.served("slowdown") == len(proxy.requests) == 4


def test_a_cut_long_read_on_the_lean_client_resumes_from_the_piece_reached(remote, sa1b_dataset, proxy, monkeypatch):
    monkeypatch.setattr(storage.fs, "PIECE_BYTES", 4096)
    shard, _ = indexed(sa1b_dataset)[0]
    reader = ranged_reader(f"{remote}/{shard.name}", storage_options(proxy.endpoint), FAST)
    nth = iter(range(100))
    proxy.fault("cut", count=1, after_bytes=1000, match=lambda r: next(nth) == 2)  # the third piece
    assert reader.read(0, shard.bytes) == pathlib.Path(sa1b_dataset, shard.name).read_bytes()
    ranges = [r.headers["range"] for r in proxy.gets()]
    pieces = [f"bytes={i}-{min(i + 4096, shard.bytes) - 1}" for i in range(0, shard.bytes, 4096)]
    assert ranges == pieces[:3] + pieces[2:]  # only the cut piece is asked for twice
    assert _user_agents(proxy, shards=True) == {"object_store"}


def test_refused_credentials_fail_at_once_naming_the_shard_and_sample(remote, sa1b_dataset, server):
    shard, index = indexed(sa1b_dataset)[0]
    start, end = index.span(0)
    expired = FaultProxy(server.s3_port, credentials=lambda key: "expired")
    try:
        for options, said in [(storage_options(server.endpoint, secret="wrong"), "403 SignatureDoesNotMatch"),
                              (storage_options(expired.endpoint), "400 ExpiredToken: The provided token has expired")]:
            way = storage.ShardReader(remote, options, FAST).way(shard)
            url = f"{remote}/{shard.name}"
            with pytest.raises(ShardError, match=rf"{url}: sample '{index.key(0)}': cannot read bytes "
                                                 rf"{start}-{end}: PermissionError: {said}"):  # (no "after 4 tries")
                with about_sample(url, index.key(0)):  # (as the read stage names what it reads)
                    way.read(start, end)
            with pytest.raises(ShardError, match=rf"{url}: cannot stat shard: (PermissionError: 403 "
                                                 r"Forbidden|S3Error: 400 Bad Request)$"):  # (a HEAD answer has no body)
                way.size()
        assert [(r.method, r.fault) for r in expired.requests] == [("GET", "expired"), ("HEAD", "expired")]
    finally:
        expired.close()


# Temporary credentials as a credential_process hands them out (AWS config file): each call a new
# access key, valid for as many seconds as the file `lifetime` says then; issued ones are listed in
# the file `issued`.
_CREDENTIAL_PROCESS = r"""
import datetime, json, pathlib, sys
issued, lifetime = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
n = len(issued.read_text().splitlines()) + 1 if issued.exists() else 1
expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=float(lifetime.read_text()))
with issued.open("a") as f:
    f.write(f"gen{n}\n")
print(json.dumps({"Version": 1, "AccessKeyId": f"gen{n}", "SecretAccessKey": "unused", "Expiration": expiry.isoformat()}))
"""


def test_temporary_credentials_are_refreshed_before_they_expire(remote, sa1b_dataset, server, tmp_path, monkeypatch):
    """botocore treats temporary credentials as due for refresh 10 minutes before they expire; the
    lean client asks for new ones then. To see it in seconds, credentials are issued for 10 min 2 s
    (due 2 s after issue), and the server refuses a credential as expired once a newer one was issued:
    reads go on while new ones are issued, each read with the newest. Then credentials issued for a
    day are not due: 5 reads, all with the one credential, and none issued (not one per request)."""
    (tmp_path / "creds.py").write_text(_CREDENTIAL_PROCESS)
    issued, lifetime = tmp_path / "issued", tmp_path / "lifetime"
    lifetime.write_text("602")
    (tmp_path / "config").write_text(f"[profile temporary]\ncredential_process = {sys.executable} {tmp_path}/creds.py "
                                     f"{issued} {lifetime}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)

    def keys() -> list[str]:
        return issued.read_text().split() if issued.exists() else []

    def state(key: str | None) -> str:
        return "unknown" if key not in keys() else "valid" if key == keys()[-1] else "expired"

    proxy = FaultProxy(server.s3_port, credentials=state)
    try:
        options = {"profile": "temporary", "client_kwargs": {"endpoint_url": proxy.endpoint, "region_name": "us-east-1"}}
        shard, index = indexed(sa1b_dataset)[0]
        reader = ranged_reader(f"{remote}/{shard.name}", options, FAST)
        start, end = index.span(0)
        expected = pathlib.Path(sa1b_dataset, shard.name).read_bytes()[start:end]

        def read_until(done: Callable[[], bool], what: str) -> None:
            bound = time.monotonic() + 60  # (a bound on a wait for an event: a refresh is due every 2 s)
            while not done():
                assert time.monotonic() < bound, what
                assert reader.read(start, end) == expected
                time.sleep(0.05)  # (pacing: the event is the credential process's, not this loop's)

        read_until(lambda: len(keys()) >= 3, "credentials due 2 s after issue: never refreshed")
        lifetime.write_text(str(86400 + 602))
        before = len(keys())
        read_until(lambda: len(keys()) > before, "a credential due 2 s after issue: never refreshed")
        lasting, requests = keys()[-1], len(proxy.requests)
        for _ in range(5):
            assert reader.read(start, end) == expected
        used = [r.access_key for r in proxy.requests]
        assert [r.fault for r in proxy.requests] == [None] * len(used), "every request with the newest credential"
        assert used[requests:] == [lasting] * 5 and keys()[-1] == lasting, "a credential not due: kept, not per request"
        assert [int(k[3:]) for k in used] == sorted(int(k[3:]) for k in used), "in the order issued"
        assert set(keys()) - set(used) <= {"gen1"}, "each credential issued is used (the first, issued as the client " \
            "is made, is in botocore's 15-minute advisory window: refreshed at the first request)"
    finally:
        proxy.close()


def test_credentials_set_or_dropped_later_in_the_process_are_the_ones_read_with(monkeypatch):
    """A filesystem made after the AWS_ environment changed resolves credentials from the environment
    as it is now: not from a botocore session that cached those of an earlier one (it was shared by
    the whole process, and a process whose credentials were dropped still read with them)."""
    import asyncio

    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)

    def access_key() -> str | None:
        fs, _ = filesystem("s3://bucket/key")
        credentials = asyncio.run(fs.session.get_credentials())
        return None if credentials is None else credentials.access_key

    for key in ("first", "second", None):
        if key is None:
            monkeypatch.delenv("AWS_ACCESS_KEY_ID")
            monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        else:
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
        assert access_key() == key


def _reads_in_a_forked_child(url: str, options: dict, parent, out) -> None:
    reader = ranged_reader(url, options, FAST)
    try:
        parent.client.cat_file(parent.path, 0, 10)
        refused = "used"
    except RuntimeError as exc:
        refused = str(exc)
    out.put((type(reader.client).__name__, reader.read(0, 1000), refused))


def test_a_forked_child_never_uses_a_client_of_its_parent(remote, sa1b_dataset, server):
    """obstore cannot run in a process forked after it ran (its runtime's threads stay behind): there,
    s3fs reads, and the parent's client refuses to serve instead of waiting forever."""
    shard, _ = indexed(sa1b_dataset)[0]
    url, options = f"{remote}/{shard.name}", storage_options(server.endpoint)
    parent = ranged_reader(url, options, FAST)
    data = pathlib.Path(sa1b_dataset, shard.name).read_bytes()
    assert type(parent.client).__name__ == "S3Client" and parent.read(0, 1000) == data[:1000]
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_reads_in_a_forked_child, args=(url, options, parent, out))
    child.start()
    kind, read, refused = out.get(timeout=60)
    child.join(30)
    assert (kind, read) == ("S3FileSystem", data[:1000])
    assert "s3:// client made in process" in refused and "clients are not fork-safe" in refused


# A training process (fresh: obstore never ran in it) whose 2 DataLoader workers are forked.
_FORKED_WORKERS = r"""
import hashlib, json, logging, os, sys
from pipeline import make_stream_loader
from shard_tools.samples.locals3 import storage_options
logging.basicConfig(level=logging.WARNING, format="%(process)d %(name)s %(message)s")
logging.getLogger("pipeline.storage").setLevel(logging.DEBUG)
loader = make_stream_loader(sys.argv[1], "train", batch_size=2, num_workers=2, seed=5, multiprocessing_context="fork",
                            storage_options=storage_options(sys.argv[2]), image_size=32, mask_size=8, max_masks=2)
loader.set_epoch(1)
digest = lambda t: hashlib.sha256(t.numpy().tobytes()).hexdigest()
print(json.dumps({"pid": os.getpid(), "batches": [{"keys": b["keys"], **{n: digest(b[n]) for n in
                  ("images", "masks", "boxes", "mask_counts")}} for b in loader]}))
"""


def test_forked_loader_workers_each_read_through_their_own_lean_client(remote, sa1b_dataset, proxy):
    run = subprocess.run([sys.executable, "-c", _FORKED_WORKERS, remote, proxy.endpoint], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    made = {int(pid) for pid in re.findall(r"^(\d+) pipeline\.storage s3://\S+: lean client made in process \1$",
                                           run.stderr, re.MULTILINE)}
    assert len(made) == 2 and result["pid"] not in made, run.stderr[-3000:]  # one per worker, none in the parent
    assert "read through s3fs" not in run.stderr
    assert _user_agents(proxy, shards=True) == {"object_store"}
    local = _epoch(sa1b_dataset, num_workers=2)
    keys = [k for b in result["batches"] for k in b["keys"]]
    assert len(set(keys)) == len(keys) and set(keys) <= set(split_keys(sa1b_dataset))  # each sample once at most
    assert result["batches"] == [{"keys": b["keys"], **{n: hashlib.sha256(b[n].numpy().tobytes()).hexdigest()
                                                        for n in ("images", "masks", "boxes", "mask_counts")}}
                                 for b in local]


def _obstore_error(name: str, message: str) -> Exception:
    import obstore.exceptions

    return getattr(obstore.exceptions, name)(message)


@pytest.mark.parametrize(("error", "expected"), [
    (lambda: _obstore_error("GenericError", "Generic S3 error: Error performing GET http://h/b/k in 1ms - Server "
                            "returned non-2xx status code: 503 Service Unavailable: <Code>SlowDown</Code>"), True),
    (lambda: _obstore_error("GenericError", "Generic S3 error: ... status code: 500 Internal Server Error: "), True),
    (lambda: _obstore_error("GenericError", "Generic S3 error: ... status code: 429 Too Many Requests: "), True),
    (lambda: _obstore_error("GenericError", "Generic S3 error: Error performing GET http://h/b/k in 1s - HTTP error: "
                            "error sending request"), True),  # a reset, a timeout
    (lambda: _obstore_error("GenericError", "Generic S3 error: HTTP error: request or response body error"), True),
    (lambda: _obstore_error("GenericError", "Generic S3 error: ... status code: 416 Range Not Satisfiable: "), False),
    (lambda: _obstore_error("PermissionDeniedError", "The operation lacked the necessary privileges"), False),
    (lambda: _obstore_error("UnauthenticatedError", "The operation lacked valid authentication credentials"), False),
    (lambda: FileNotFoundError("Object at location b/k not found"), False),  # (obstore's NotFound)
    (lambda: S3Error(503, "SlowDown", "Please reduce your request rate."), True),
    (lambda: S3Error(400, "RequestTimeout", "Your socket connection to the server was not read from"), True),
    (lambda: S3Error(416, "InvalidRange", "The requested range is not satisfiable"), False),
    (lambda: PermissionError("400 ExpiredToken: The provided token has expired."), False),
], ids=["503-slowdown", "500", "429", "reset-or-timeout", "body-cut", "416", "permission-denied", "unauthenticated",
        "not-found", "S3Error-slowdown", "S3Error-request-timeout", "S3Error-416", "expired-token"])
def test_obstore_failures_are_classified_for_retry(error, expected):
    assert transient(error()) is expected
