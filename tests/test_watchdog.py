"""The stall watchdog (`pipeline.watchdog`): a worker stuck on a sample ends the iteration with a
StallError naming the stage, shard, sample and the worker's Python stack, and leaves no worker
behind; a slow worker that moves is never stopped. The stuck runs happen in a fresh process, bounded
from outside: a watchdog that never fires fails the test instead of hanging the suite."""

from __future__ import annotations

import json
import sys
import time

import pytest

from pipeline import LoaderConfig, make_stream_loader
from pipeline.errors import ConfigError
from pipeline.kinds.sa1b import Sa1b
from conftest import split_keys
from procs import alive, run_bounded

SMALL = dict(image_size=32, mask_size=16, max_masks=2)

_STUCK = """
import json, multiprocessing, sys, threading
from pipeline import StallError, make_stream_loader
from pipeline.kinds.sa1b import Sa1b

root, stuck, mode = sys.argv[1], sys.argv[2], sys.argv[3]
decode = Sa1b.decode

def decode_or_hang(self, members, *, key, **kwargs):  # (forked workers inherit it)
    if key == stuck:
        threading.Event().wait()
    return decode(self, members, key=key, **kwargs)

Sa1b.decode = decode_or_hang
loader = make_stream_loader(root, "train", batch_size=2, num_workers=2, stall_timeout=5, seed=3, image_size=32,
                            mask_size=16, max_masks=2)
batches = 0
try:
    if mode == "next iteration":  # (a loop that breaks out after a batch and begins the next epoch)
        next(iter(loader))
        loader.set_epoch(1)
    for batch in loader:
        batches += 1
except StallError as exc:
    print(json.dumps({"error": str(exc), "key": exc.key, "batches": batches,
                      "left": [p.pid for p in multiprocessing.active_children()]}))
"""


@pytest.mark.parametrize("mode", ["in an iteration", "next iteration"])
def test_a_worker_stuck_on_a_sample_ends_the_iteration_naming_it(sa1b_dataset, mode):
    """Stuck while making a batch of the iteration, or one its last iteration had asked for (the
    next waits for it: torch resumes persistent workers only once they are done)."""
    if mode == "in an iteration":
        stuck = split_keys(sa1b_dataset)[3]
    else:  # (worker 0's second batch of epoch 0, asked for ahead while the first is taken)
        stuck = list(make_stream_loader(sa1b_dataset, "train", batch_size=2, seed=3, **SMALL))[2]["keys"][0]
    out, err = run_bounded([sys.executable, "-c", _STUCK, sa1b_dataset, stuck, mode], 90,
                           "a worker stuck on a sample hung the loader: the watchdog never fired")
    assert out.strip(), err
    found = json.loads(out)
    report = found["error"]
    assert "no DataLoader worker made progress for 5 s (stall_timeout)" in report
    assert f"decoding sample {stuck!r} of {sa1b_dataset}/train-" in report  # (stage, sample, shard)
    assert "in decode_or_hang" in report, "the stuck worker's Python stack"
    assert found["left"] == [], "the workers are ended"
    worker_pids = [int(line.split("(pid ")[1].split(")")[0]) for line in report.splitlines()
                   if line.startswith("worker ")]
    assert len(worker_pids) == 2 and not any(alive(pid) for pid in worker_pids)


def test_a_slow_worker_that_moves_is_not_stopped(sa1b_dataset, monkeypatch):
    """Each sample takes longer than the watchdog's tick and the whole epoch longer than its timeout;
    every worker keeps moving, so the epoch ends as without the watchdog."""
    decode = Sa1b.decode

    def slow(self, members, **kwargs):
        time.sleep(0.5)
        return decode(self, members, **kwargs)

    monkeypatch.setattr(Sa1b, "decode", slow)  # (forked workers inherit it)
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=2, stall_timeout=4, **SMALL)
    reference = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=0, **SMALL)
    assert [b["keys"] for b in loader] == [b["keys"] for b in reference]


def test_a_new_iteration_waits_for_workers_finishing_slow_batches_of_the_last(sa1b_dataset, monkeypatch):
    """A loop that breaks out of an epoch and begins the next while each worker still makes the
    batches asked of it before (2 s each, past the watchdog's 1 s tick): torch resumes its persistent
    workers only once they are done, and that wait is no stall, however many ticks it takes."""
    decode = Sa1b.decode

    def slow(self, members, **kwargs):
        time.sleep(1.0)
        return decode(self, members, **kwargs)

    monkeypatch.setattr(Sa1b, "decode", slow)  # (forked workers inherit it)
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=2, stall_timeout=2, seed=3, **SMALL)
    reference = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=0, seed=3, **SMALL)
    reference.set_epoch(1)
    next(iter(loader))
    loader.set_epoch(1)
    assert [b["keys"] for b in loader] == [b["keys"] for b in reference]


@pytest.mark.parametrize("context", [None, "spawn"])
def test_stats_go_to_a_callback_every_n_batches(sa1b_dataset, context):
    """In the main process only: spawned workers never receive the callback (a lambda would not pickle)."""
    seen = []
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=2, stats_every=2,
                                stats_callback=lambda stats: seen.append(stats), multiprocessing_context=context,
                                **SMALL)
    batches = len(list(loader))
    assert len(seen) == batches // 2 and all(s.samples > 0 for s in seen)
    assert [s.samples for s in seen] == sorted(s.samples for s in seen)


@pytest.mark.parametrize("settings, message", [
    (dict(stall_timeout=0), "stall_timeout must be None or a number of seconds > 0, got 0"),
    (dict(stall_timeout="5"), "stall_timeout must be None or a number of seconds > 0, got '5'"),
    (dict(stats_callback=print), "stats_callback must be a function taking loader.stats(), with stats_every"),
    (dict(stats_callback=3, stats_every=2), "stats_callback must be a function"),
])
def test_watchdog_and_callback_settings_are_checked(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LoaderConfig(batch_size=2, **settings)
