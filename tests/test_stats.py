"""`loader.stats()`: the figures add up to the wall time, counts are exact, workers' figures reach the
main process (persistent or not, fork or spawn), the verdict follows a slow step or a slow input,
`stats_every` logs, and each kind's own decode stages show."""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import pytest

from pipeline import LoaderConfig, make_stream_dataset, make_stream_loader
from pipeline.kinds import sa1b, sa1b_batch
from pipeline.kinds.embeddings import Embeddings
from pipeline.stats import Clock, WorkerTable
from shard_tools.embeddings import pack_embeddings
from shard_tools.pack import PackOptions
from shard_tools.samples.vqa import write_vqa
from shard_tools.vqa import VqaSource, pack_vqa
from test_loader import corrupted  # noqa: F401  (a fixture: one sample's annotation damaged)
from procs import with_startup_code

SMALL = dict(image_size=64, mask_size=32, max_masks=5)


MS = 1_000_000  # nanoseconds


class FakeClock:
    """`time.perf_counter_ns` for the loader's clocks: it stands still but where a test moves it. A
    forked worker moves its own copy (spawned workers do not see it)."""

    def __init__(self) -> None:
        self.now = 1 << 40

    def __call__(self) -> int:
        return self.now

    def advance(self, ns: int) -> None:
        self.now += ns


@pytest.fixture
def fake_clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter_ns", fake)
    return fake


class Costs:
    """What the SA-1B kind's image decoding, mask rasterizing and `finish` cost on the fake clock:
    each moves it by its nanoseconds before doing its work (in the process that does it)."""

    def __init__(self, monkeypatch, clock: FakeClock) -> None:
        self.image = self.masks = self.finish = 0
        for name, cost in (("decode_image", "image"), ("bits_at", "masks")):  # (where the kind calls them)
            monkeypatch.setattr(sa1b_batch, name, self._costing(clock, getattr(sa1b_batch, name), cost))
        monkeypatch.setattr(sa1b.Sa1b, "finish", self._costing(clock, sa1b.Sa1b.finish, "finish"))

    def _costing(self, clock: FakeClock, work, cost: str):
        def costing(*args, **kwargs):
            clock.advance(getattr(self, cost))
            return work(*args, **kwargs)
        return costing


def _timed_epoch(loader, epoch: int = 0, step=lambda: None) -> tuple[int, int]:
    """(batches, samples) of a whole epoch; `step()` after each batch (the training step)."""
    loader.set_epoch(epoch)
    batches, samples = 0, 0
    for batch in loader:
        batches, samples = batches + 1, samples + len(batch["keys"])
        step()
    return batches, samples


def _decoding(samples: int, costs: Costs) -> dict[str, float]:
    """The workers' figures of an SA-1B epoch on the fake clock: its image and mask decoding, nothing else."""
    return {"read wait": 0.0, "open": 0.0, "decode (image)": samples * costs.image / 1e9,
            "decode (masks)": samples * costs.masks / 1e9, "decode (rest)": 0.0, "collate": 0.0, "other": 0.0}


# A spawned worker's own fake clock and costs (`FakeClock`, `Costs`): its startup code.
_SPAWNED_COSTS = """
import time
from pipeline.kinds import sa1b_batch
from pipeline.kinds.embeddings import Embeddings

now = [1 << 40]
time.perf_counter_ns = lambda: now[0]

def costing(work, cost):
    def costed(*args, **kwargs):
        now[0] += cost
        return work(*args, **kwargs)
    return costed

sa1b_batch.decode_image = costing(sa1b_batch.decode_image, {image})
sa1b_batch.bits_at = costing(sa1b_batch.bits_at, {masks})
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_the_figures_add_up_to_the_wall_time(sa1b_dataset, workers, fake_clock, monkeypatch):
    """On a clock that moves only by the work's costs (the step, `finish`, image and mask decoding),
    each figure is exactly its work's time, and the main process's add up to the wall time the loop
    sees. With num_workers=0 the workers' work is done in the hand-off; forked workers move their own
    copy of the clock, so the main process's hand-off (its wait for them) is 0 on it."""
    costs = Costs(monkeypatch, fake_clock)
    costs.image, costs.masks, costs.finish, step = 5 * MS, 2 * MS, 3 * MS, 100 * MS
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=workers, **SMALL)
    start = fake_clock()
    batches, samples = _timed_epoch(loader, step=lambda: fake_clock.advance(step))
    wall = fake_clock() - start
    stats = loader.stats()
    assert (stats.batches, stats.samples, stats.skipped) == (batches, samples, 0) and batches > 1
    decode = samples * (costs.image + costs.masks) / 1e9
    assert stats.main == pytest.approx({"hand-off": decode if workers == 0 else 0.0, "device copy": 0.0,
                                        "finish": batches * costs.finish / 1e9, "other": 0.0,
                                        "training loop": batches * step / 1e9}), stats.main
    assert stats.wall_s == pytest.approx(wall / 1e9) == pytest.approx(sum(stats.main.values()))
    assert stats.workers == pytest.approx({"read wait": 0.0, "open": 0.0, "decode (image)": samples * costs.image / 1e9,
                                           "decode (masks)": samples * costs.masks / 1e9, "decode (rest)": 0.0,
                                           "collate": 0.0, "other": 0.0}), stats.workers


def test_a_slow_step_is_compute_bound_and_a_slow_input_input_bound(sa1b_dataset, fake_clock, monkeypatch):
    """The verdict follows the share of the wall time the step waited: on the fake clock, a step of
    200 ms beside 2 ms of decoding a batch waits 2/202 of the time; 1 ms beside 201 ms, 201/202."""
    costs = Costs(monkeypatch, fake_clock)
    costs.image, costs.masks = 1 * MS, 1 * MS
    slow_step = make_stream_loader(sa1b_dataset, "train", batch_size=1, **SMALL)
    _timed_epoch(slow_step, step=lambda: fake_clock.advance(200 * MS))
    stats = slow_step.stats()
    assert stats.waited == pytest.approx(2 / 202) and stats.verdict.startswith("compute-bound:"), str(stats)

    costs.image = 200 * MS
    slow_input = make_stream_loader(sa1b_dataset, "train", batch_size=1, **SMALL)
    _timed_epoch(slow_input, step=lambda: fake_clock.advance(1 * MS))
    stats = slow_input.stats()
    assert stats.waited == pytest.approx(201 / 202) and stats.verdict.startswith("input-bound:"), str(stats)
    assert stats.verdict.endswith("; decode (image) dominates the workers' time"), stats.verdict


@pytest.mark.parametrize("persistent, context", [(True, None), (False, None), (False, "spawn")])
def test_workers_figures_reach_the_main_process_every_epoch(sa1b_dataset, persistent, context, fake_clock, monkeypatch,
                                                            tmp_path):
    """Each epoch's workers' figures are what their decoding cost on the fake clock (spawned workers set
    up their own, `_SPAWNED_COSTS`): they reach the main process, persistent or not, forked or spawned."""
    costs = Costs(monkeypatch, fake_clock)
    costs.image, costs.masks = 5 * MS, 2 * MS
    if context == "spawn":
        code = _SPAWNED_COSTS.format(image=costs.image, masks=costs.masks)
        monkeypatch.setenv("PYTHONPATH", with_startup_code(dict(os.environ), tmp_path / "startup", code)["PYTHONPATH"])
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=2, persistent_workers=persistent,
                                multiprocessing_context=context, **SMALL)
    for epoch in range(2):
        batches, samples = _timed_epoch(loader, epoch)
        stats = loader.stats(reset=True)
        assert (stats.batches, stats.samples) == (batches, samples)
        assert stats.workers == pytest.approx(_decoding(samples, costs)), stats.workers
    assert loader.stats().batches == 0  # (reset)


def test_a_skipped_sample_counts_as_skipped_not_as_a_sample(corrupted, fake_clock, monkeypatch):  # noqa: F811
    """(`corrupted`: a fixture imported.) The skipped sample's annotation fails to unpack before its
    image or masks are decoded: on the fake clock, the workers' figures are the other samples' decoding."""
    root, _, _ = corrupted
    costs = Costs(monkeypatch, fake_clock)
    costs.image, costs.masks = 5 * MS, 2 * MS
    loader = make_stream_loader(root, "train", batch_size=2, num_workers=2, on_error="skip", **SMALL)
    batches, samples = _timed_epoch(loader)
    stats = loader.stats()
    assert (stats.batches, stats.samples, stats.skipped) == (batches, samples, 1)
    assert stats.workers == pytest.approx(_decoding(samples, costs)), stats.workers


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


def test_embeddings_show_one_decode_stage(tmp_path, fake_clock, monkeypatch):
    """Embeddings have no stages of their own: one decode stage, on the fake clock what decoding each
    batch's rows cost."""
    rng = np.random.default_rng(0)
    src = tmp_path / "emb"
    src.mkdir()
    np.save(src / "emb.npy", rng.standard_normal((40, 4)).astype(np.float16))
    (src / "schema.json").write_text(json.dumps({"fields": {"emb": {"file": "emb.npy"}}}))
    pack_embeddings(str(src), str(tmp_path / "emb-out"), rows_per_block=8, options=PackOptions(splits=None),
                    progress=False)
    decode = Embeddings.decode

    def costing(self, block, *, unit, **kwargs):  # (forked workers inherit it and the fake clock)
        fake_clock.advance(len(unit) * MS)
        return decode(self, block, unit=unit, **kwargs)

    monkeypatch.setattr(Embeddings, "decode", costing)
    loader = make_stream_loader(str(tmp_path / "emb-out"), "train", batch_size=6, num_workers=2)
    rows = sum(len(batch["row"]) for batch in loader)
    stats = loader.stats()
    assert stats.samples == rows == 36
    assert stats.workers == pytest.approx({"read wait": 0.0, "open": 0.0, "decode": rows * MS / 1e9, "collate": 0.0,
                                           "other": 0.0}), stats.workers


def test_vqa_shows_its_own_decode_stages(tmp_path):
    files = write_vqa(tmp_path / "vqa", "vqa-rad", {"train": 4}, per_image=(1, 3), seed=2)
    source = VqaSource(str(tmp_path / "vqa" / "images"), tuple((k, str(v)) for k, v in files.items()))
    pack_vqa(source, str(tmp_path / "vqa-out"), PackOptions(shard_samples=2), progress=False)
    loader = make_stream_loader(str(tmp_path / "vqa-out"), "train", batch_size=1, image_size=64)
    questions = len(list(loader))
    stats = loader.stats()
    assert stats.samples == questions and stats.workers["decode (image)"] > 0
    assert [name for name in stats.workers if name.startswith("decode")] == ["decode (image)", "decode (rest)"]


def test_a_stage_is_timed_by_its_block_and_not_when_an_error_leaves_it(fake_clock):
    clock = Clock(("a", "b"))
    fake_clock.advance(7 * MS)  # (before the block: not its)
    with clock.stage("a"):
        fake_clock.advance(10 * MS)
    with pytest.raises(ValueError), clock.stage("b"):
        fake_clock.advance(3 * MS)
        raise ValueError("b failed")
    assert clock.ns == {"a": 10 * MS, "b": 0}
    with pytest.raises(KeyError):
        clock.stage("c")


def test_with_a_rest_the_stages_add_up_to_all_the_time_since_mark(fake_clock):
    clock = Clock(("a", "other"), rest="other")
    fake_clock.advance(7 * MS)  # (before the mark: not counted)
    start = clock.mark()
    fake_clock.advance(2 * MS)
    with clock.stage("a"):
        fake_clock.advance(3 * MS)
    fake_clock.advance(4 * MS)
    with clock.stage("a"):
        pass
    assert sum(clock.ns.values()) == clock.last - start == 9 * MS
    assert clock.ns == {"a": 3 * MS, "other": 6 * MS}


def test_a_workers_batch_counts_its_making_not_its_wait_to_be_asked_for(fake_clock):
    table = WorkerTable((), 1)
    clock = table.clock()

    def made():
        for samples in (2, 3):
            fake_clock.advance(1 * MS)  # (the batch's making, in no stage)
            with clock.stage("collate"):
                fake_clock.advance(5 * MS)
            yield "batch", samples

    for batch in table.timed(0, clock, made()):
        assert batch == "batch"
        fake_clock.advance(100 * MS)  # (the wait to be asked for the next)
    figures = dict(zip((*table.stages, "samples", "batches"), table.totals().tolist()))
    assert (figures["samples"], figures["batches"]) == (5, 2)
    assert (figures["collate"], figures["active"]) == (10 * MS, 12 * MS)
