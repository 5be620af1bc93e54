"""pipeline.storage.cache alone: downloads that stream into the cache in parallel pieces, read while
they arrive by this or another process, hashed as they arrive."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import threading
import time

import pytest

from pipeline.errors import ShardError
from pipeline.storage import ShardCache

DATA = random.Random(0).randbytes(3 * 1000 + 17)  # (the same in a spawned process)
SHA = hashlib.sha256(DATA).hexdigest()


def _reader(data: bytes, chunk: int = 100, pause: float = 0.0, gate: threading.Event | None = None):
    """`read(start, end)` over `data`, in chunks; with a gate, it stops before the chunk that reaches
    past half of the data until the gate opens."""

    def read(start: int, end: int):
        for at in range(start, end, chunk):
            if gate is not None and at + chunk > len(data) // 2:
                gate.wait(10)
            time.sleep(pause)
            yield data[at : min(at + chunk, end)]

    return read


@pytest.mark.parametrize(("parallel", "piece"), [(1, 1 << 20), (4, 500), (3, 1)])
def test_a_download_in_pieces_is_the_shard_and_leaves_no_debris(tmp_path, parallel, piece):
    cache = ShardCache(str(tmp_path), 1 << 20)
    path = cache.fetch("u", len(DATA), SHA, _reader(DATA), parallel=parallel, piece=piece)
    assert open(path, "rb").read() == DATA
    assert sorted(os.listdir(tmp_path)) == sorted([f"{SHA}.tar", f"{SHA}.tar.ok"])


def test_bytes_are_read_while_the_shard_arrives(tmp_path):
    """A reader takes bytes of the first half while the download is held before the second half; it
    waits for bytes of the second half until they arrive."""
    cache, gate = ShardCache(str(tmp_path), 1 << 20), threading.Event()
    download = threading.Thread(target=cache.fetch, args=("u", len(DATA), SHA, _reader(DATA, gate=gate)),
                                kwargs=dict(parallel=1))
    download.start()
    try:
        deadline = time.monotonic() + 10
        while (got := cache.read_arriving(SHA, 10, 400, patience=0.05)) is None and time.monotonic() < deadline:
            pass
        assert got == DATA[10:400]
        assert cache.lookup("u", SHA) is None  # (not in place yet)
        assert cache.read_arriving(SHA, 2000, 2100, patience=0.1) is None  # (not there, and impatient)
        later = []
        waiter = threading.Thread(target=lambda: later.append(cache.read_arriving(SHA, 2000, 2100, patience=10)))
        waiter.start()
        time.sleep(0.1)
        gate.set()
        waiter.join(10)
        assert later in ([DATA[2000:2100]], [None])  # (None: it finished between two looks: then it is in place)
    finally:
        gate.set()
        download.join(10)
    assert open(cache.lookup("u", SHA), "rb").read() == DATA
    assert cache.read_arriving(SHA, 0, 10) is None  # (no download running)


def _download_then_hang(directory: str, ready: multiprocessing.Event) -> None:
    cache = ShardCache(directory, 1 << 20)

    def read(start: int, end: int):
        yield DATA[start : start + 100]
        ready.set()
        time.sleep(60)

    cache.fetch("u", len(DATA), SHA, read)


def test_a_killed_download_is_not_waited_for_and_is_redone(tmp_path):
    ready = multiprocessing.get_context("spawn").Event()
    process = multiprocessing.get_context("spawn").Process(target=_download_then_hang, args=(str(tmp_path), ready))
    process.start()
    try:
        assert ready.wait(30)
        cache = ShardCache(str(tmp_path), 1 << 20)
        assert cache.read_arriving(SHA, 0, 50) == DATA[:50]  # (from the other process's download)
    finally:
        process.kill()
        process.join()
    start = time.monotonic()
    assert cache.read_arriving(SHA, 500, 600, patience=30) is None
    assert time.monotonic() - start < 5  # (the download's lock is gone: nobody is writing it)
    assert open(cache.fetch("u", len(DATA), SHA, _reader(DATA)), "rb").read() == DATA


def test_a_download_of_other_bytes_is_refused_and_removed(tmp_path):
    cache = ShardCache(str(tmp_path), 1 << 20)
    other = bytearray(DATA)
    other[-1] ^= 1
    with pytest.raises(ShardError, match="SHA-256"):
        cache.fetch("u", len(DATA), SHA, _reader(bytes(other)), piece=1000)
    with pytest.raises(ShardError, match="gave 3000 bytes"):
        cache.fetch("u", len(DATA), SHA, _reader(DATA[:3000]), piece=1 << 20)
    assert os.listdir(tmp_path) == []


def test_a_failing_piece_stops_the_download(tmp_path):
    cache = ShardCache(str(tmp_path), 1 << 20)

    def read(start: int, end: int):
        if start:
            raise ShardError("u", f"cannot read bytes {start}-{end}")
        yield from _reader(DATA, pause=0.01)(start, end)

    with pytest.raises(ShardError, match="cannot read bytes"):
        cache.fetch("u", len(DATA), SHA, read, piece=1000)
    assert os.listdir(tmp_path) == []
