"""Mid-epoch resumption through the loader: equal to an uninterrupted run, in any world."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from pipeline import make_stream_loader
from pipeline.stream import ShardStream
from conftest import split_keys

SMALL = dict(image_size=48, mask_size=16, max_masks=3)


def _loader(root, **kw):
    return make_stream_loader(root, "train", **{"batch_size": 2, "num_workers": 0, "seed": 5, **SMALL, **kw})


def _keys(batches):
    return [b["keys"] for b in batches]


def _assert_same(got, expected):
    assert _keys(got) == _keys(expected)
    for a, b in zip(got, expected):
        for name, value in a.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b[name]), name


def _run(loader, epoch, stop=None):
    """The epoch's batches, or the first `stop`: the loop a trainer breaks out of to checkpoint."""
    loader.set_epoch(epoch)
    batches = []
    if stop == 0:
        return batches
    for batch in loader:
        batches.append(batch)
        if len(batches) == stop:
            break
    return batches


@pytest.mark.parametrize(("workers", "persistent"), [(0, None), (2, True), (2, False)])
def test_resume_equals_uninterrupted(sa1b_dataset, workers, persistent):
    full = _run(_loader(sa1b_dataset), 3)
    for k in (0, 1, len(full) - 1, len(full)):
        first = _loader(sa1b_dataset, num_workers=workers, persistent_workers=persistent)
        assert _keys(_run(first, 3, stop=k)) == _keys(full[:k])
        state = first.state_dict()
        assert state["epoch"] == 3 and state["history"] == ([[1, k]] if k else [])
        resumed = _loader(sa1b_dataset, num_workers=workers, persistent_workers=persistent)
        resumed.load_state_dict(state)
        assert len(resumed) == len(full) and resumed.remaining == len(full) - k, "len(): the epoch's, as Lightning counts"
        _assert_same(_run(resumed, 3), full[k:])
        assert len(resumed) == resumed.remaining == len(full), "once the epoch is done, it plays whole again"
        _assert_same(_run(resumed, 4), _run(_loader(sa1b_dataset), 4))


def test_resume_across_the_epoch_boundary(sa1b_dataset):
    loader = _loader(sa1b_dataset, num_workers=2)
    _run(loader, 0)
    state = loader.state_dict()  # saved after the last batch of epoch 0
    resumed = _loader(sa1b_dataset, num_workers=2)
    resumed.load_state_dict(state)
    assert _run(resumed, 0) == [] and len(resumed) == len(loader)
    _assert_same(_run(resumed, 1), _run(_loader(sa1b_dataset), 1))


def _resume_in_fresh_process(root, state, queue):
    loader = _loader(root, num_workers=2)
    loader.load_state_dict(state)
    queue.put(_keys(_run(loader, state["epoch"])))


def test_resume_in_a_fresh_process(sa1b_dataset):
    full = _keys(_run(_loader(sa1b_dataset), 2))
    first = _loader(sa1b_dataset)
    _run(first, 2, stop=2)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_resume_in_fresh_process, args=(sa1b_dataset, first.state_dict(), queue))
    process.start()
    assert queue.get(timeout=120) == full[2:]
    process.join(timeout=60)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (3, 2)])
def test_elastic_resume_takes_every_sample_once(sa1b_dataset, before, after):
    split = sorted(split_keys(sa1b_dataset))
    loaders = [_loader(sa1b_dataset, rank=r, world_size=before, drop_last=False) for r in range(before)]
    seen = [k for loader in loaders for b in _run(loader, 1, stop=1) for k in b["keys"]]
    state = loaders[0].state_dict()
    assert all(loader.state_dict()["history"] == state["history"] for loader in loaders), "ranks move in step"
    resumed = [_loader(sa1b_dataset, rank=r, world_size=after, drop_last=False) for r in range(after)]
    counts = set()
    for loader in resumed:
        loader.load_state_dict(state)
        batches = _run(loader, 1)
        counts.add(len(batches))
        seen += [k for b in batches for k in b["keys"]]
    assert len(counts) == 1
    assert sorted(seen) == split


_LATE = {"slept": False}  # (per process: a forked worker inherits it unset)


def _late_world(self):
    """ShardStream._world, but worker 1 first starts 2 s late (a worker under load)."""
    info = torch.utils.data.get_worker_info()
    if info is not None and info.id == 1 and not _LATE["slept"]:
        _LATE["slept"] = True
        time.sleep(2.0)
    return _WORLD(self)


_WORLD = ShardStream._world


@pytest.mark.parametrize("persistent", [True, False])
def test_a_worker_that_starts_late_plays_the_iteration_it_was_started_for(sa1b_dataset, monkeypatch, persistent):
    """Resumed with one batch left (worker 0's), a trainer takes it and begins the next epoch before
    worker 1 has even started: worker 1 must play the resumed epoch it was started for (nothing left
    for it), not the next one that the shared state says by then: that one's batches would be made
    for the old iteration's requests and dropped, and its wait for the next iteration's first batch
    would hold torch's resuming of the workers (persistent ones) past its timeout."""
    whole = [_keys(_run(_loader(sa1b_dataset), epoch)) for epoch in (0, 1)]
    first = _loader(sa1b_dataset, num_workers=2)
    _run(first, 0, stop=len(whole[0]) - 1)
    state = first.state_dict()
    monkeypatch.setattr(ShardStream, "_world", _late_world)
    resumed = _loader(sa1b_dataset, num_workers=2, persistent_workers=persistent)
    resumed.load_state_dict(state)
    taken = next(iter(resumed))  # (the epoch's last batch; a trainer stops at len(): no next())
    assert taken["keys"] == whole[0][-1]
    assert _keys(_run(resumed, 1)) == whole[1]
    resumed.close()


def test_a_state_saved_before_the_fine_tuning_options_existed_resumes_exactly(sa1b_dataset):
    """A state of an earlier release, whose kind options lack those added since (each at its default
    here, so the batches are the same), resumes as an uninterrupted run goes on; one that sets one
    of them is still refused, naming it."""
    whole = _keys(_run(_loader(sa1b_dataset), 1))
    loader = _loader(sa1b_dataset)
    first = _keys(_run(loader, 1, stop=2))
    state = loader.state_dict()
    added = ("max_mask_area", "min_predicted_iou", "min_stability_score", "fill_masks", "points_per_mask",
             "box_noise", "box_noise_mode", "hflip", "resize", "scale_jitter")
    old = {**state, "options": {k: v for k, v in state["options"].items() if k not in added}}
    assert set(state["options"]) - set(old["options"]) == set(added)
    resumed = _loader(sa1b_dataset)
    resumed.load_state_dict(old)
    assert first + _keys(_run(resumed, 1)) == whole
    with pytest.raises(ValueError, match=r"other options of the kind \(hflip: 0.0 there, 0.5 here\)"):
        _loader(sa1b_dataset, hflip=0.5).load_state_dict(old)


def test_mismatched_state_is_refused(sa1b_dataset, sa1b_src, tmp_path):
    from shard_tools.pack import PackOptions, pack
    from shard_tools.sa1b import Sa1bSource

    state = _loader(sa1b_dataset).state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        _loader(sa1b_dataset, batch_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        _loader(sa1b_dataset, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match=r"other options of the kind \(image_size: 48 there, 64 here; max_masks: 3 "
                                         r"there, 4 here\)"):
        _loader(sa1b_dataset, image_size=64, max_masks=4).load_state_dict(state)
    with pytest.raises(ValueError, match="the state's version is 3, this loader's is 4"):
        _loader(sa1b_dataset).load_state_dict({**state, "version": 3})
    with pytest.raises(ValueError, match="split"):
        make_stream_loader(sa1b_dataset, "val", batch_size=2, num_workers=0, seed=5, **SMALL).load_state_dict(state)
    pack(Sa1bSource(), [str(sa1b_src)], str(tmp_path), PackOptions(shard_samples=5), progress=False)
    with pytest.raises(ValueError, match="fingerprint"):
        _loader(str(tmp_path)).load_state_dict(state)
    with pytest.raises(ValueError, match="malformed"):
        _loader(sa1b_dataset).load_state_dict({**state, "history": [["x"]]})
    with pytest.raises(Exception, match="cannot resume after batch"):
        _loader(sa1b_dataset).load_state_dict({**state, "history": [[1, 999]]})


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterator_left_open_never_counts_in_the_state(sa1b_dataset, workers):
    full = _run(_loader(sa1b_dataset), 1)
    saved = _loader(sa1b_dataset)
    _run(saved, 1, stop=1)
    state = saved.state_dict()  # epoch 1, one batch taken
    loader = _loader(sa1b_dataset, num_workers=workers)
    loader.set_epoch(0)
    old = iter(loader)
    next(old), next(old)
    loader.load_state_dict(state)
    with pytest.raises(RuntimeError, match="no longer valid: load_state_dict"):
        for _ in old:  # (before: it went on with epoch 0, and the state counted its batches as epoch 1's)
            pass
    assert loader.state_dict() == state
    _assert_same(_run(loader, 1), full[1:])

    loader.set_epoch(2)
    first = iter(loader)
    next(first)
    second = iter(loader)
    with pytest.raises(RuntimeError, match="no longer valid"):
        next(first)
    next(second)
    loader.set_epoch(3)
    with pytest.raises(RuntimeError, match="no longer valid"):
        next(second)
    assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["history"] == []


REPO = str(pathlib.Path(__file__).resolve().parent.parent)
# A training loop that checkpoints the loader's state after each batch, and hangs after `stop` of them.
_TRAIN = r"""
import json, os, sys, time
from pipeline import make_stream_loader
root, checkpoint, stop = sys.argv[1], sys.argv[2], int(sys.argv[3])
loader = make_stream_loader(root, "train", batch_size=2, num_workers=2, seed=5, image_size=48, mask_size=16, max_masks=3)
loader.set_epoch(2)
for i, batch in enumerate(loader):
    with open(checkpoint + ".tmp", "w") as f:
        json.dump(loader.state_dict(), f)
    os.replace(checkpoint + ".tmp", checkpoint)
    if i + 1 == stop:
        print("checkpointed", flush=True)
        time.sleep(600)
"""


def test_a_training_process_killed_mid_epoch_resumes_exactly(sa1b_dataset, tmp_path):
    full = _run(_loader(sa1b_dataset), 2)
    stop = len(full) // 2
    checkpoint = str(tmp_path / "loader.json")
    child = subprocess.Popen([sys.executable, "-c", _TRAIN, sa1b_dataset, checkpoint, str(stop)], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "checkpointed\n"
    finally:
        child.kill()  # SIGKILL, mid-epoch
        child.wait()
    with open(checkpoint) as f:
        state = json.load(f)
    assert state["history"] == [[1, stop]]
    resumed = _loader(sa1b_dataset, num_workers=2)
    resumed.load_state_dict(state)
    _assert_same(_run(resumed, 2), full[stop:])


def test_an_iterator_not_begun_plays_the_position_it_finds(sa1b_dataset):
    """Lightning makes its iterator, then sets the epoch (or loads a state) before its first batch."""
    expected = _run(_loader(sa1b_dataset), 1)
    loader = _loader(sa1b_dataset, num_workers=2)
    batches = iter(loader)
    loader.set_epoch(1)
    _assert_same(list(batches), expected)
    partial = _loader(sa1b_dataset)
    _run(partial, 1, stop=2)
    batches = iter(loader)
    loader.load_state_dict(partial.state_dict())
    _assert_same(list(batches), expected[2:])


def test_leaving_a_resumed_epoch_unfinished_is_said(sa1b_dataset, caplog):
    partial = _loader(sa1b_dataset)
    _run(partial, 1, stop=2)
    loader = _loader(sa1b_dataset)
    loader.load_state_dict(partial.state_dict())
    loader.set_epoch(1)  # the saved epoch: nothing said
    assert "not played" not in caplog.text
    loader.set_epoch(2)
    rest = len(_run(_loader(sa1b_dataset), 1)) - 2
    assert f"set_epoch(2) leaves epoch 1 with {rest} of its {rest + 2} batches not played" in caplog.text
    caplog.clear()
    loader.load_state_dict(partial.state_dict())
    batches = iter(loader)
    for _ in range(len(loader) - 2):  # (Lightning takes len() batches, and never asks past the last)
        next(batches)
    loader.set_epoch(2)
    assert "not played" not in caplog.text
