"""pipeline.read alone: samples read ahead through real shard readers, their members checked against
the limits; the LRU of open samples by bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline import LoaderConfig, ShardError
from pipeline.format import EMB_DATA, EMB_TABLE
from pipeline.index import SplitIndex, resolve
from pipeline.read import Opened, ProcessReaders, SampleReads, merge_spans
from pipeline.storage import read_manifest
from pipeline.tario import ReadLimits
from shard_tools.embeddings import pack_embeddings


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("emb") / "out"
    np.save(src / "x.npy", np.arange(64, dtype=np.float32).reshape(16, 4))
    (src / "schema.json").write_text(json.dumps({"fields": {"x": {"file": "x.npy"}}}))
    pack_embeddings(str(src), str(out), rows_per_block=4, progress=False)
    manifest = read_manifest(str(out))
    return str(out), manifest


def _reads(blocks, **settings):
    root, manifest = blocks
    sources = [SplitIndex.of(root, manifest, "train", by_units=True)]
    config = LoaderConfig(batch_size=1, **settings)
    readers, _ = ProcessReaders(sources, config, None).get()
    return SampleReads(sources, readers, config)


def _located(reads, samples):
    """The samples' locations, their shards' indexes fetched together (as `schedule.Schedule` does)."""
    source = reads.sources[0]
    indexes = reads.indexes(0, sorted({source.where(s)[0] for s in samples}))
    return [resolve(source, (0, s), indexes) for s in samples]


def test_samples_read_ahead_give_their_members_and_pages_kept_only_when_asked(blocks):
    reads = _reads(blocks)
    samples = _located(reads, range(int(blocks[1].splits["train"].samples)))
    assert [s.units for s in samples] == [4] * len(samples) and len({s.key for s in samples}) == len(samples)
    try:
        reads.ahead(samples)
        assert set(reads.inflight) == {s.where for s in samples}
        for i, sample in enumerate(samples):
            members, held = reads.take(sample, keep=i % 2 == 1)
            assert sorted(members) == sorted([EMB_DATA, EMB_TABLE]) and held == 0  # (views of the mapped shard)
        assert set(reads.taken) == {s.where for s in samples[::2]}  # (released at `done`; kept ones are not)
        for sample in samples:
            reads.done(sample)
        assert not reads.taken and not reads.inflight
    finally:
        reads.close()


def test_a_sample_over_the_size_limit_is_named(blocks):
    reads = _reads(blocks, limits=ReadLimits(max_sample_bytes=64))
    sample, = _located(reads, [0])
    try:
        with pytest.raises(ShardError, match=rf"{sample.url}: sample '{sample.key}': spans \d+ bytes, "
                                             "more than max_sample_bytes=64"):
            reads.take(sample)
    finally:
        reads.close()


def test_open_samples_are_dropped_past_their_bytes():
    opened = Opened(limit=10)
    for i, size in enumerate([4, 4, 4, 20]):
        opened.keep((0, i), (i, size))
        if i == 2:
            assert list(opened) == [(0, 1), (0, 2)] and opened.held == 8
    assert list(opened) == [(0, 3)] and opened.held == 20  # the newest stays, whatever its size


def test_merge_spans_joins_neighbours_within_the_amplification_bound():
    ranges = [(300, 400), (0, 100), (100, 200), (1000, 1100)]  # (given out of order)
    assert merge_spans(ranges, 1.0) == [(0, 200, [1, 2]), (300, 400, [0]), (1000, 1100, [3])]
    assert merge_spans(ranges, 2.0) == [(0, 400, [1, 2, 0]), (1000, 1100, [3])]  # 400 bytes for 300 used
    assert merge_spans(ranges, 11.0) == [(0, 1100, [1, 2, 0, 3])]
    assert merge_spans([], 2.0) == []


@pytest.mark.parametrize("amplification", [1.0, 1.5, 2.0, 4.0])
def test_merge_spans_covers_every_range_once_and_keeps_its_bound(amplification):
    rng = np.random.default_rng(int(amplification * 10))
    for _ in range(200):
        edges = np.sort(rng.choice(10_000, size=2 * rng.integers(1, 30), replace=False))
        ranges = [(int(a), int(b)) for a, b in edges.reshape(-1, 2)]
        rng.shuffle(ranges)
        spans = merge_spans(ranges, amplification)
        assert sorted(n for _, _, members in spans for n in members) == list(range(len(ranges)))
        for first, last, members in spans:
            used = sum(ranges[n][1] - ranges[n][0] for n in members)
            assert all(first <= ranges[n][0] and ranges[n][1] <= last for n in members)
            assert last - first <= amplification * used
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint, in order
