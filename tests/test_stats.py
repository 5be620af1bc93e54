"""`loader.stats()`: the figures add up to the wall time, counts are exact, workers' figures reach the
main process (persistent or not, fork or spawn), the verdict follows a slow step or a slow input,
`stats_every` logs, and each kind's own decode stages show."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest

from pipeline import LoaderConfig, LoaderStats, make_stream_dataset, make_stream_loader
from pipeline.stats import Clock, WorkerTable
from shard_tools.embeddings import pack_embeddings
from shard_tools.pack import PackOptions
from shard_tools.samples.vqa import write_vqa
from shard_tools.vqa import VqaSource, pack_vqa
from test_loader import corrupted  # noqa: F401  (a fixture: one sample's annotation damaged)

SMALL = dict(image_size=64, mask_size=32, max_masks=5)


def _timed_epoch(loader, epoch: int = 0, step: float = 0.0) -> tuple[float, int, int]:
    """(seconds of a whole epoch as the loop sees it, batches, samples); `step` s of sleep per batch."""
    loader.set_epoch(epoch)
    start, batches, samples = time.perf_counter(), 0, 0
    for batch in loader:
        batches, samples = batches + 1, samples + len(batch["keys"])
        time.sleep(step)
    return time.perf_counter() - start, batches, samples


def _worker_laws(stats: LoaderStats) -> None:
    assert all(seconds >= 0 for seconds in stats.workers.values()), stats.workers
    assert stats.workers["decode (image)"] > 0 and stats.workers["decode (masks)"] > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_the_figures_add_up_to_the_wall_time(sa1b_dataset, workers):
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=workers, **SMALL)
    wall, batches, samples = _timed_epoch(loader, step=0.01)
    stats = loader.stats()
    assert (stats.batches, stats.samples, stats.skipped) == (batches, samples, 0)
    assert sum(stats.main.values()) == pytest.approx(stats.wall_s)
    assert wall * 0.9 - 0.005 <= stats.wall_s <= wall  # (the loop's `for` costs a little outside the loader)
    assert all(seconds >= 0 for seconds in stats.main.values()), stats.main
    assert stats.main["training loop"] >= 0.01 * batches
    assert stats.main["device copy"] < 0.1 * stats.wall_s  # (no device: a generator's step per batch)
    _worker_laws(stats)
    if workers == 0:  # the hand-off is the workers' work, done in this process
        assert stats.main["hand-off"] >= sum(stats.workers.values())


def test_a_slow_step_is_compute_bound_and_a_slow_input_input_bound(sa1b_dataset):
    slow_step = make_stream_loader(sa1b_dataset, "train", batch_size=1, **SMALL)
    batches = iter(slow_step)
    next(batches)
    slow_step.stats(reset=True)  # (the first batch waits for the readers to start)
    for _ in batches:
        time.sleep(0.2)
    stats = slow_step.stats()
    assert stats.verdict.startswith("compute-bound:") and stats.waited < 0.1, str(stats)

    slow_input = make_stream_loader(sa1b_dataset, "train", batch_size=1, image_size=512, mask_size=512)
    list(slow_input)
    stats = slow_input.stats()
    assert stats.verdict.startswith("input-bound:") and stats.waited > 0.5, str(stats)
    assert "dominates the workers' time" in stats.verdict
    assert max(stats.workers, key=stats.workers.__getitem__) in stats.verdict


@pytest.mark.parametrize("persistent, context", [(True, None), (False, None), (False, "spawn")])
def test_workers_figures_reach_the_main_process_every_epoch(sa1b_dataset, persistent, context):
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=2, persistent_workers=persistent,
                                multiprocessing_context=context, **SMALL)
    for epoch in range(2):
        _, batches, samples = _timed_epoch(loader, epoch)
        stats = loader.stats(reset=True)
        assert (stats.batches, stats.samples) == (batches, samples)
        _worker_laws(stats)
    assert loader.stats().batches == 0  # (reset)


def test_a_skipped_sample_counts_as_skipped_not_as_a_sample(corrupted):  # noqa: F811  (the fixture imported)
    root, _, _ = corrupted
    loader = make_stream_loader(root, "train", batch_size=2, num_workers=2, on_error="skip", **SMALL)
    _, batches, samples = _timed_epoch(loader)
    stats = loader.stats()
    assert (stats.batches, stats.samples, stats.skipped) == (batches, samples, 1)
    assert all(seconds >= 0 for seconds in stats.workers.values()), stats.workers


def test_stats_every_logs_the_table(sa1b_dataset, caplog):
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=1, stats_every=3, **SMALL)
    batches = len(list(loader))
    records = [r for r in caplog.records if r.name == "pipeline.loader" and r.levelno == logging.INFO]
    assert len(records) == batches // 3
    assert [r.loader_stats.batches for r in records] == [3 * (i + 1) for i in range(len(records))]
    assert "decode (image)" in records[0].getMessage() and "training loop" in records[0].getMessage()


def test_plain_data_and_table(sa1b_dataset):
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, **SMALL)
    assert loader.stats().verdict == "no batches yet"
    list(loader)
    stats = loader.stats()
    data = json.loads(json.dumps(stats.as_dict()))
    assert data["samples"] == stats.samples and data["workers"] == stats.workers
    lines = str(stats).splitlines()
    assert lines[0] == stats.verdict and "ms/sample" in lines[2]
    assert sum(1 for line in lines if line.startswith("  ")) == len(stats.main) + len(stats.workers)


def test_stats_every_is_checked_and_refused_where_there_are_no_stats(sa1b_dataset):
    with pytest.raises(ValueError, match="stats_every must be an int >= 1"):
        LoaderConfig(batch_size=1, stats_every=0)
    with pytest.raises(ValueError, match="stats_every"):
        make_stream_dataset(sa1b_dataset, "train", batch_size=1, stats_every=2, **SMALL)


def test_each_kind_shows_its_own_decode_stages(tmp_path):
    rng = np.random.default_rng(0)
    src = tmp_path / "emb"
    src.mkdir()
    np.save(src / "emb.npy", rng.standard_normal((40, 4)).astype(np.float16))
    (src / "schema.json").write_text(json.dumps({"fields": {"emb": {"file": "emb.npy"}}}))
    pack_embeddings(str(src), str(tmp_path / "emb-out"), rows_per_block=8, options=PackOptions(splits=None),
                    progress=False)
    loader = make_stream_loader(str(tmp_path / "emb-out"), "train", batch_size=6, num_workers=2)
    rows = sum(len(batch["row"]) for batch in loader)
    stats = loader.stats()
    assert stats.samples == rows == 36 and not any(name.startswith("decode (") for name in stats.workers)
    assert stats.workers["decode"] >= 0

    files = write_vqa(tmp_path / "vqa", "vqa-rad", {"train": 4}, per_image=(1, 3), seed=2)
    source = VqaSource(str(tmp_path / "vqa" / "images"), tuple((k, str(v)) for k, v in files.items()))
    pack_vqa(source, str(tmp_path / "vqa-out"), PackOptions(shard_samples=2), progress=False)
    loader = make_stream_loader(str(tmp_path / "vqa-out"), "train", batch_size=1, image_size=64)
    questions = len(list(loader))
    stats = loader.stats()
    assert stats.samples == questions and stats.workers["decode (image)"] > 0
    assert [name for name in stats.workers if name.startswith("decode")] == ["decode (image)", "decode (rest)"]


def test_a_stage_is_timed_by_its_block_and_not_when_an_error_leaves_it():
    clock = Clock(("a", "b"))
    with clock.stage("a"):
        time.sleep(0.01)
    with pytest.raises(ValueError), clock.stage("b"):
        raise ValueError("b failed")
    assert clock.ns["a"] >= 10_000_000 and clock.ns["b"] == 0
    with pytest.raises(KeyError):
        clock.stage("c")


def test_with_a_rest_the_stages_add_up_to_all_the_time_since_mark():
    clock = Clock(("a", "other"), rest="other")
    start = clock.mark()
    time.sleep(0.002)
    with clock.stage("a"):
        time.sleep(0.002)
    time.sleep(0.002)
    with clock.stage("a"):
        pass
    assert sum(clock.ns.values()) == clock.last - start
    assert clock.ns["other"] >= 4_000_000 and clock.ns["a"] >= 2_000_000


def test_a_workers_batch_counts_its_making_not_its_wait_to_be_asked_for():
    table = WorkerTable((), 1)
    clock = table.clock()

    def made():
        for samples in (2, 3):
            with clock.stage("collate"):
                time.sleep(0.005)
            yield "batch", samples

    for batch in table.timed(0, clock, made()):
        assert batch == "batch"
        time.sleep(0.1)
    figures = dict(zip((*table.stages, "samples", "batches"), table.totals().tolist()))
    assert (figures["samples"], figures["batches"]) == (5, 2)
    assert figures["collate"] >= 10_000_000 and figures["collate"] <= figures["active"] < 100_000_000
