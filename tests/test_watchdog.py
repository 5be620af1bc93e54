"""The stall watchdog (`pipeline.watchdog`): a worker stuck on a sample ends the iteration with a
StallError naming the stage, shard, sample and the worker's Python stack, and leaves no worker
behind; a slow worker that moves is never stopped. The stuck runs happen in a fresh process, bounded
from outside: a watchdog that never fires fails the test instead of hanging the suite."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import sys

import pytest

import pipeline.loader as loader_module
from pipeline import LoaderConfig, make_stream_loader, watchdog
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


class _WatchdogClock:
    """The watchdog's clock in the tests of slow workers (`Progress(clock=...)`): nanoseconds that move
    only where a worker's step moves them, shared by the main process and the workers it forks. The
    main process reading it is the watchdog looking at its workers (`looks`): a slow step lasts, in
    real time, until the watchdog has looked during it, instead of sleeping past a tick."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("fork")
        self.ns, self.looks, self.looked = context.Value("q", 0), context.Value("q", 0), context.Condition()
        self.main = os.getpid()

    def __call__(self) -> int:
        if os.getpid() == self.main:
            with self.looked:
                self.looks.value += 1
                self.looked.notify_all()
        return self.ns.value

    def slow_step(self, seconds: float) -> None:
        """In a worker: `seconds` pass on the clock, and the step ends once the main process has looked
        twice since it began (one may be the iteration's `begin`; the other is then a tick's)."""
        with self.looked:
            before = self.looks.value
            self.ns.value += int(seconds * 1e9)
            if not self.looked.wait_for(lambda: self.looks.value >= before + 2, timeout=60):
                raise AssertionError("the watchdog never looked at its workers while one was slow")


@pytest.fixture
def slow_decode(monkeypatch):
    """Each SA-1B sample's decode takes 0.09 s on the watchdog's clock (`_WatchdogClock`) and lasts until
    the watchdog looked at the workers during it. With stall_timeout 0.2 (a tick of 0.1 s, real), two
    workers move the clock by 0.18 s at most between two notes of progress: never a stall, on any
    machine; any sample's decode is a tick or more, and every ~3 samples' are past stall_timeout."""
    clock, decode = _WatchdogClock(), Sa1b.decode

    def slow(self, members, **kwargs):
        if os.getpid() != clock.main:  # (a reference loader's own decodes, num_workers=0, have no watchdog)
            clock.slow_step(0.09)
        return decode(self, members, **kwargs)

    monkeypatch.setattr(Sa1b, "decode", slow)  # (forked workers inherit it, and the clock)
    monkeypatch.setattr(loader_module, "Progress", functools.partial(watchdog.Progress, clock=clock))
    return clock


def test_a_slow_worker_that_moves_is_not_stopped(sa1b_dataset, slow_decode):
    """Each sample takes a tick of the watchdog or more and the whole epoch longer than its timeout;
    every worker keeps moving, so the epoch ends as without the watchdog."""
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=2, stall_timeout=0.2, **SMALL)
    reference = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=0, **SMALL)
    assert [b["keys"] for b in loader] == [b["keys"] for b in reference]
    samples = len(split_keys(sa1b_dataset)) // 2 * 2
    assert slow_decode.ns.value == samples * 90_000_000 > 0.2e9, "the epoch: far past stall_timeout"


def test_a_new_iteration_waits_for_workers_finishing_slow_batches_of_the_last(sa1b_dataset, slow_decode):
    """A loop that breaks out of an epoch and begins the next while each worker still makes the
    batches asked of it before (each sample a tick or more): torch resumes its persistent workers only
    once they are done, and that wait, which runs into ticks, is no stall, however many it takes."""
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=2, stall_timeout=0.2, seed=3,
                                **SMALL)
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
