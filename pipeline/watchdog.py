"""The stall watchdog: each DataLoader worker notes in shared memory what it is doing (stage, shard
URL, sample key, since when), and the main process, while it waits for a batch, ends the iteration
with a `StallError` once no worker has moved for `stall_timeout` seconds: per worker what it was
doing and for how long, with its Python stack (dumped by `faulthandler` on a signal, which works
even while the worker is blocked). Slow but moving is not a stall."""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np
import torch

from pipeline.errors import StallError

__all__ = ["Progress", "STAGES", "next_batch", "started", "tick"]

STAGES = ("starting", "reading", "decoding", "collating", "handing over a batch", "done")
_TEXT = 512  # bytes of "URL key" kept per worker
_DUMP = signal.SIGUSR1


class Progress:
    """What each worker of a stream is doing, shared with the main process: per worker its pid, since
    when it is in its stage (on `clock`, nanoseconds: `time.monotonic_ns` is one clock for all the
    processes of a machine), the stage's number in `STAGES`, and the sample it is at ("URL key")."""

    def __init__(self, workers: int, *, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.clock = clock
        self.table = torch.zeros(max(1, workers), 3, dtype=torch.int64).share_memory_()  # pid, since, stage
        self.text = torch.zeros(max(1, workers), _TEXT, dtype=torch.uint8).share_memory_()
        self.directory = tempfile.mkdtemp(prefix="shardstream-stacks-")  # (each worker's stack, on a stall)
        weakref.finalize(self, shutil.rmtree, self.directory, True)
        self._dumps: IO[str] | None = None  # (this worker's stack file, kept open for faulthandler)
        self._rows: tuple[np.ndarray, np.ndarray] | None = None  # (numpy views of both: cheaper to write)

    def begin(self) -> None:
        """In the main process, as it asks for an iteration: a stall is counted from now at the earliest."""
        self.table[:, 1] = self.clock()

    def start(self, worker: int) -> None:
        """In a worker, as its iteration begins: its row, and its stack dumped to its file on `_DUMP`."""
        if self._dumps is None:
            self._dumps = open(os.path.join(self.directory, f"worker-{worker}.txt"), "w")  # noqa: SIM115
            faulthandler.register(_DUMP, file=self._dumps, all_threads=True, chain=False)
            self._rows = (self.table.numpy(), self.text.numpy())
        self.table[worker, 0] = os.getpid()
        self.at(worker, "starting")

    def at(self, worker: int, stage: str, url: str = "", key: str = "") -> None:
        """The worker moved on to `stage` (of the sample `key` of the shard at `url`)."""
        if self._rows is None:
            return
        table, text = self._rows
        table[worker, 1:] = self.clock(), STAGES.index(stage)
        data = f"{url} {key}".encode()[:_TEXT] if key else b""
        text[worker, : len(data)] = np.frombuffer(data, np.uint8)
        text[worker, len(data):] = 0

    def stalled(self, timeout: float) -> bool:
        """In the main process: whether no worker has moved for `timeout` seconds."""
        return self.clock() - int(self.table[:, 1].max()) > timeout * 1e9

    def error(self, timeout: float) -> StallError:
        """The stall, named: each worker's stage, sample and time in it, and its Python stack."""
        now, lines = self.clock(), []
        for worker, (pid, since, stage) in enumerate(self.table.tolist()):
            if not pid:
                continue
            url, _, key = bytes(self.text[worker].numpy()).rstrip(b"\0").decode(errors="replace").partition(" ")
            what = f"{STAGES[stage]} sample {key!r} of {url}" if key else STAGES[stage]
            lines.append(f"worker {worker} (pid {pid}): {what}, for {(now - since) / 1e9:.1f} s\n"
                         f"{_stack(pid, os.path.join(self.directory, f'worker-{worker}.txt'))}")
        return StallError(f"no DataLoader worker made progress for {timeout:g} s (stall_timeout); the "
                          "iteration ends:\n" + "\n".join(lines))

    def __getstate__(self) -> dict[str, object]:  # (a spawned worker opens its own stack file)
        return {**self.__dict__, "_dumps": None, "_rows": None}


def tick(stall_timeout: float | None) -> float:
    """How long the DataLoader waits for a batch before the loader looks at its workers' progress,
    then waits again: torch's `timeout` (0, none, without a watchdog)."""
    return 0 if stall_timeout is None else min(5.0, stall_timeout / 2)


def started(loader: Any, progress: Progress | None, stall_timeout: float | None) -> Iterator[Any]:
    """`iter(loader)` (a DataLoader). With persistent workers torch first resumes them, waiting for
    each to finish what the last iteration had asked of it, in `tick`s of the loader's timeout; a
    tick there would end it (that wait cannot go on after torch's timeout error), so there each tick
    only looks at the workers' progress, as `next_batch` does: a StallError once none has moved for
    `stall_timeout` seconds, however many ticks a moving worker takes."""
    iterator = getattr(loader, "_iterator", None)  # (the persistent workers' iterator: torch has no public way)
    if iterator is None or progress is None or stall_timeout is None:
        return iter(loader)
    fetch = iterator._try_get_data

    def patiently(timeout: float = 0.0) -> tuple[bool, Any]:
        while True:
            found = fetch(timeout)
            if found[0] or progress.stalled(stall_timeout):
                return found

    iterator._try_get_data = patiently
    try:
        return iter(loader)
    except RuntimeError as exc:
        if not str(exc).startswith("DataLoader timed out"):
            raise
        raise progress.error(stall_timeout) from None
    finally:
        del iterator._try_get_data


def next_batch(batches: Iterator[Any], progress: Progress | None, stall_timeout: float | None) -> Any:
    """The DataLoader's next batch, waited for in `tick`s (torch's timeout, after which its iterator
    is still whole and waits on): a StallError once no worker has moved for `stall_timeout` seconds."""
    while True:
        try:
            return next(batches)
        except RuntimeError as exc:
            if progress is None or stall_timeout is None or not str(exc).startswith("DataLoader timed out"):
                raise
            if progress.stalled(stall_timeout):
                raise progress.error(stall_timeout) from None


def _stack(pid: int, path: str) -> str:
    """The Python stack of every thread of worker `pid`, dumped by its `faulthandler` on `_DUMP`."""
    try:
        before = os.path.getsize(path)
        os.kill(pid, _DUMP)
    except OSError as exc:
        return f"  (no stack: {exc})"
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if os.path.getsize(path) > before:
            time.sleep(0.05)  # (the dump is a few writes)
            with open(path) as f:
                f.seek(before)
                return "  " + f.read().strip().replace("\n", "\n  ")
    return "  (no stack: the worker did not answer)"
