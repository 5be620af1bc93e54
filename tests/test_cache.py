"""pipeline.storage.cache alone: downloads that stream into the cache, read while they arrive by this
or another process, hashed as they arrive."""

from __future__ import annotations

import fcntl
import hashlib
import multiprocessing
import os
import random
import threading
import time

import pytest

import pipeline.storage.cache as cache_module
import pipeline.storage.reader as reader
from pipeline.errors import ShardError
from pipeline.format import ShardInfo
from pipeline.storage import ShardCache, locks
from pipeline.storage.cache import Mismatch
from pipeline.storage.local import MappedFiles

DATA = random.Random(0).randbytes(3 * 1000 + 17)  # (the same in a spawned process)
SHA = hashlib.sha256(DATA).hexdigest()


def _reader(data: bytes, chunk: int = 100, pause: float = 0.0, gate: threading.Event | None = None,
            hold: threading.Event | None = None):
    """`read(start, end)` over `data`, in chunks; with a gate, it stops before the chunk that reaches
    past half of the data until the gate opens; with a hold, before the last chunk until it opens
    (a gate or hold not opened within a minute fails the download)."""

    def wait(event: threading.Event) -> None:
        if not event.wait(60):
            raise AssertionError("the test never let the download go on")

    def read(start: int, end: int):
        for at in range(start, end, chunk):
            if gate is not None and at + chunk > len(data) // 2:
                wait(gate)
            if hold is not None and at + chunk >= len(data):
                wait(hold)
            time.sleep(pause)
            yield data[at : min(at + chunk, end)]

    return read


@pytest.mark.parametrize("chunk", [1, 100, 1 << 20])
def test_a_download_is_the_shard_and_leaves_no_debris(tmp_path, chunk):
    cache = ShardCache(str(tmp_path), 1 << 20)
    path = cache.fetch("u", len(DATA), SHA, _reader(DATA, chunk))
    assert open(path, "rb").read() == DATA
    assert sorted(os.listdir(tmp_path)) == sorted([f"{SHA}.tar", f"{SHA}.tar.ok"])


def test_bytes_are_read_while_the_shard_arrives(tmp_path, monkeypatch):
    """A reader takes bytes of the first half while the download is held before the second half; it
    waits for bytes of the second half until they arrive (the download is held again before its last
    chunk, so that it cannot end before the waiting reader has its bytes)."""
    cache, gate, hold = ShardCache(str(tmp_path), 1 << 20), threading.Event(), threading.Event()
    looked = threading.Event()  # the waiting reader looked for bytes 2000-2100 and found them not there
    arrived = cache_module._arrived

    def watched(path):
        found = arrived(path)
        if found is not None and found < 2100 and threading.current_thread().name == "waiter":
            looked.set()
        return found

    monkeypatch.setattr(cache_module, "_arrived", watched)
    download = threading.Thread(target=cache.fetch, args=("u", len(DATA), SHA, _reader(DATA, gate=gate, hold=hold)))
    download.start()
    try:
        deadline = time.monotonic() + 30
        while (got := cache.read_arriving(SHA, 10, 400, patience=0.05)) is None and time.monotonic() < deadline:
            pass
        assert got == DATA[10:400]
        assert cache.lookup("u", SHA) is None  # (not in place yet)
        assert cache.read_arriving(SHA, 2000, 2100, patience=0.1) is None  # (not there, and impatient)
        later = []
        waiter = threading.Thread(target=lambda: later.append(cache.read_arriving(SHA, 2000, 2100, patience=60)),
                                  name="waiter")
        waiter.start()
        assert looked.wait(30), "the reader never looked for the bytes"
        assert waiter.is_alive() and later == []  # (it waits: the bytes are not there)
        gate.set()  # (the download goes on to its last chunk, and holds there)
        waiter.join(60)
        assert later == [DATA[2000:2100]]
        assert cache.lookup("u", SHA) is None  # (still arriving: the bytes were read from the download)
    finally:
        gate.set()
        hold.set()
        download.join(60)
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
    # A reader that waited for bytes that never come would wait an hour: it returns only because it
    # finds the download's lock let go (nobody is writing it). The join's bound fails the test.
    later = []
    reader = threading.Thread(target=lambda: later.append(cache.read_arriving(SHA, 500, 600, patience=3600)),
                              daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "the reader waits for a download whose process was killed"
    assert later == [None]
    assert open(cache.fetch("u", len(DATA), SHA, _reader(DATA)), "rb").read() == DATA


def test_a_download_of_other_bytes_is_refused_recorded_and_not_read_again(tmp_path):
    cache = ShardCache(str(tmp_path), 1 << 20)
    other = bytearray(DATA)
    other[-1] ^= 1
    with pytest.raises(Mismatch, match="SHA-256"):
        cache.fetch("u", len(DATA), SHA, _reader(bytes(other)))
    assert os.listdir(tmp_path) == [f"{SHA}.bad"] and "SHA-256" in cache.failed(SHA)

    def unread(start: int, end: int):
        raise AssertionError("the object was read again")

    with pytest.raises(Mismatch, match=rf"u: downloaded shard has SHA-256 .* \(remove .*{SHA}\.bad once"):
        cache.fetch("u", len(DATA), SHA, unread)
    os.unlink(tmp_path / f"{SHA}.bad")
    with pytest.raises(ShardError, match="gave 3000 bytes") as info:  # (a short read: a failed download, not a mismatch)
        cache.fetch("u", len(DATA), SHA, _reader(DATA[:3000]))
    assert not isinstance(info.value, Mismatch) and os.listdir(tmp_path) == []


def test_an_object_of_another_size_reserves_nothing_and_evicts_nothing(tmp_path):
    """The manifest says the shard is larger than the object: the object's size is asked for before
    space is reserved, so nothing is evicted for it (before: the cache made room for the size the
    manifest claims, evicting 2 of 3 cached shards, then downloaded a shard that fails its check)."""
    cache = ShardCache(str(tmp_path), 4 * len(DATA))
    others = [random.Random(n).randbytes(len(DATA)) for n in (1, 2, 3)]
    for data in others:
        cache.fetch("v", len(data), hashlib.sha256(data).hexdigest(), _reader(data))
    claimed = 3 * len(DATA)
    with pytest.raises(Mismatch, match=f"the object is {len(DATA)} bytes, the manifest says {claimed}"):
        cache.fetch("u", claimed, SHA, _reader(DATA), actual_size=lambda: len(DATA))
    assert all(cache.lookup("v", hashlib.sha256(data).hexdigest()) for data in others), "nothing evicted"
    assert sorted(n.rsplit(".", 1)[1] for n in os.listdir(tmp_path)) == ["bad"] + ["ok"] * 3 + ["tar"] * 3


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_process_forked_during_a_download_holds_none_of_its_locks(tmp_path):
    """A DataLoader forks its workers while a thread of the main process may be downloading: the
    worker must not keep the download's locks (an flock is held by every copy of its descriptor)."""
    cache, gate = ShardCache(str(tmp_path), 1 << 20), threading.Event()
    download = threading.Thread(target=cache.fetch, args=("u", len(DATA), SHA, _reader(DATA, gate=gate)))
    download.start()
    child = None
    try:
        deadline = time.monotonic() + 10
        while cache.read_arriving(SHA, 0, 100, patience=0.05) is None and time.monotonic() < deadline:
            pass  # (the download runs, holding its locks)
        child = multiprocessing.get_context("fork").Process(target=_sleep, args=(30,))
        child.start()
        gate.set()
        download.join(10)
        path = cache.lookup("u", SHA)
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (before: BlockingIOError, the child's copy held it)
        finally:
            os.close(fd)
        with cache.locked():  # (the cache's lock, and the shard's download lock, are free too)
            pass
        assert cache.fetch("u", len(DATA), SHA, _reader(DATA)) == path
    finally:
        gate.set()
        download.join(10)
        if child is not None:
            child.kill()
            child.join()


def test_a_failing_read_stops_the_download_and_leaves_no_debris(tmp_path):
    cache = ShardCache(str(tmp_path), 1 << 20)

    def read(start: int, end: int):
        yield DATA[:1000]
        raise ShardError("cannot read bytes 1000-3017", url="u")

    with pytest.raises(ShardError, match="cannot read bytes"):
        cache.fetch("u", len(DATA), SHA, read)
    assert os.listdir(tmp_path) == []


def test_a_shard_is_one_request_whatever_its_size(tmp_path):
    """The node's requests for a shard are its index and its download: one `read` (one streamed
    request), not one per piece (before: up to 4 of a shard over 16 MiB)."""
    asked = []
    read = _reader(DATA)
    cache = ShardCache(str(tmp_path), 1 << 20)
    path = cache.fetch("u", len(DATA), SHA, lambda start, end: asked.append((start, end)) or read(start, end))
    with open(path, "rb") as f:
        assert asked == [(0, len(DATA))] and f.read() == DATA


def _still_open(fd: int, out) -> None:
    """Sends the file the descriptor is open at in this process, if any."""
    try:
        out.put(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        out.put(None)


def test_a_forked_child_closes_only_the_locked_files_it_was_given(tmp_path):
    """The child closes its copies of locked descriptors, and nothing else: not a descriptor whose
    number a file of the parent's reuses after a locked one was closed without letting go."""
    held, stale = os.open(tmp_path / "held", os.O_RDWR | os.O_CREAT), os.open(tmp_path / "stale", os.O_RDWR | os.O_CREAT)
    try:
        assert locks.lock(held) and locks.lock(stale)
        os.close(stale)  # (closed without `locks.close`: its entry stays)
        reused = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
        assert reused == stale
        context, out = multiprocessing.get_context("fork"), multiprocessing.get_context("fork").Queue()
        for fd, name in ((held, "held"), (reused, "other")):
            child = context.Process(target=_still_open, args=(fd, out))
            child.start()
            assert (out.get(timeout=30) == str(tmp_path / name)) == (name == "other"), name
            child.join(30)
    finally:
        locks.close(held)
        locks.unlock(reused)
        os.close(reused)


class _Polls:
    """`time` for the cache module: its `sleep`s (a reader polling for a download's bytes or file) are
    noted in `polled`, so that a test waits for a reader to be waiting instead of sleeping on it."""

    def __init__(self) -> None:
        self.polled = threading.Event()
        self.monotonic, self.time_ns = time.monotonic, time.time_ns

    def sleep(self, seconds: float) -> None:
        self.polled.set()
        time.sleep(seconds)


def test_a_reader_waits_for_a_download_about_to_start_instead_of_reading_by_range(tmp_path, monkeypatch):
    """A process that took the shard's download lock but has not made its file yet: a reader waits for
    the file (before: it found none and read the bytes by range, a request the node's download saves),
    then takes its bytes from the download while it runs; with no lock there, it does not wait."""
    polls = _Polls()
    monkeypatch.setattr(cache_module, "time", polls)
    cache = ShardCache(str(tmp_path), 1 << 20)
    assert cache.read_arriving(SHA, 0, 100, patience=30) is None  # (no download: at once)
    assert not polls.polled.is_set(), "no download: no wait"
    (tmp_path / f"{SHA}.tar.lock").touch()  # (taken, the download's file not made yet)
    later = []
    reader = threading.Thread(target=lambda: later.append(cache.read_arriving(SHA, 0, 100, patience=30)))
    reader.start()
    assert polls.polled.wait(30) and later == [], "the reader waits for the download's file"
    gate = threading.Event()  # (the download is held before its second half until the reader has its bytes)
    download = threading.Thread(target=cache.fetch, args=("u", len(DATA), SHA, _reader(DATA, gate=gate)))
    download.start()
    try:
        reader.join(30)
        assert later == [DATA[:100]], "the bytes from the download, while it runs"
        assert download.is_alive(), "(held at its gate: the reader did not wait for its end)"
    finally:
        gate.set()
        download.join(30)
    assert cache.lookup("u", SHA) is not None and open(cache.lookup("u", SHA), "rb").read() == DATA


class _Object:
    """A shard's object behind a `Ranged`'s names: `stream` (a download) waits for `gate`; every
    request is recorded."""

    def __init__(self, data: bytes, gate: threading.Event | None = None) -> None:
        self.url, self.data, self.gate, self.requests = "s3://b/s.tar", data, gate, []

    def stream(self, start: int, end: int):
        self.requests.append(("stream", start, end))
        if self.gate is not None and not self.gate.wait(60):
            raise AssertionError("the test never let the download go on")
        yield self.data[start:end]

    def known_size(self) -> int:
        return len(self.data)

    def read(self, start: int, end: int) -> bytes:
        self.requests.append(("read", start, end))
        return self.data[start:end]


def test_a_read_takes_another_process_download_while_its_own_waits_its_turn(tmp_path, monkeypatch):
    """This process's one download slot is taken; the shard asked for is being downloaded by another
    process of the node: its bytes come from that download at once, with no request of this process
    (not after this process's own download of it has waited its turn)."""
    monkeypatch.setattr(reader, "DOWNLOADS", 1)
    cache, gate, hold = ShardCache(str(tmp_path), 1 << 20), threading.Event(), threading.Event()
    downloads = reader.Downloads(cache, MappedFiles(str(tmp_path)))
    other = random.Random(1).randbytes(500)
    busy = _Object(other, gate)
    downloads.start(ShardInfo("other.tar", 1, 1, len(other), hashlib.sha256(other).hexdigest(), None), busy)
    elsewhere = threading.Thread(target=cache.fetch, args=("u", len(DATA), SHA, _reader(DATA, hold=hold)))
    elsewhere.start()  # (the other process's download, held before its last chunk)
    wanted = _Object(DATA)
    got = []
    try:
        deadline = time.monotonic() + 30
        while cache.read_arriving(SHA, 0, 100, patience=0.05) is None and time.monotonic() < deadline:
            pass
        asking = threading.Thread(target=lambda: got.append(
            reader.Cached(downloads, wanted, ShardInfo("s.tar", 1, 1, len(DATA), SHA, None)).read(0, 100)))
        asking.start()
        asking.join(10)
        assert got == [DATA[:100]] and wanted.requests == [], "from the other process's download, at once"
    finally:
        gate.set()
        hold.set()
        elsewhere.join(60)
        downloads.settle()
    assert busy.requests == [("stream", 0, len(other))] and wanted.requests == []


def test_a_download_file_appears_only_once_locked(tmp_path, monkeypatch):
    """A reader that finds a download's file takes it for a live download and waits for its bytes
    (before: the file was made, then locked; a reader between the two took it for a killed
    process's download and read its bytes by range). Every exclusive lock is slowed to widen the gap."""
    lock = locks.lock

    def slow(fd: int, **options) -> bool:
        if not options.get("shared"):
            time.sleep(0.3)
        return lock(fd, **options)

    monkeypatch.setattr(locks, "lock", slow)
    cache, gate = ShardCache(str(tmp_path), 1 << 20), threading.Event()
    download = threading.Thread(target=cache.fetch, args=("u", len(DATA), SHA, _reader(DATA, gate=gate)))
    download.start()
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / f"{SHA}.tar.lock").exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert cache.read_arriving(SHA, 0, 100, patience=30) == DATA[:100]
    finally:
        gate.set()
        download.join(30)
    assert open(cache.lookup("u", SHA), "rb").read() == DATA
    assert sorted(os.listdir(tmp_path)) == sorted([f"{SHA}.tar", f"{SHA}.tar.ok"])


def test_a_read_that_looked_before_its_download_began_looks_again(tmp_path, monkeypatch):
    """A read that found no download of its shard, this process's own having begun just after it
    looked: it takes the bytes from that download (before: the download, begun by the time the read
    asked, counted as seen, and the bytes were read by range, a request the download saves)."""
    cache = ShardCache(str(tmp_path), 1 << 20)
    downloads = reader.Downloads(cache, MappedFiles(str(tmp_path)))
    wanted, looks = _Object(DATA), []
    read_arriving = cache.read_arriving

    def late(sha256: str, start: int, end: int, patience: float = 60.0) -> bytes | None:
        looks.append(patience)
        if len(looks) > 1:
            return read_arriving(sha256, start, end, patience=patience)
        deadline = time.monotonic() + 30  # (the first look's answer comes once the download has begun)
        while not wanted.requests and time.monotonic() < deadline:
            time.sleep(0.001)
        return None

    monkeypatch.setattr(cache, "read_arriving", late)
    try:
        got = reader.Cached(downloads, wanted, ShardInfo("s.tar", 1, 1, len(DATA), SHA, None)).read(0, 100)
    finally:
        downloads.settle()
    assert bytes(got) == DATA[:100] and len(looks) == 2
    assert wanted.requests == [("stream", 0, len(DATA))], "no read by range"
