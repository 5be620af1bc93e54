"""Running shard tasks, kind-agnostic: in a pool of local worker processes, or on a Dask cluster.

Both take calls `(function, *args)` and append a `tick(n)` to each call's arguments, through which a
task counts what it has done and learns that its run was stopped (Ctrl-C, or another task failed).
The packers (`shard_tools.pack`) and `shard-pack index` (`shard_tools.index`) run on them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pipeline.errors import PackError, ShardstreamError

__all__ = ["exit_with_parent", "pool_tick", "worker_pool", "dask_tasks"]


def exit_with_parent(parent: int) -> None:
    """In a pool worker: end when the packing process does, even killed (else the worker would finish
    its shard and the ones queued for it, then wait for work forever)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="shard-pack-parent", daemon=True).start()


class _Stopped(Exception):
    """In a pool worker: the parent stopped the pool (Ctrl-C, or another task failed)."""


_pool: dict[str, Any] = {}  # in a pool worker: the parent's count of items done and its stop flag


def _init_worker(parent: int, done: Any, stop: Any) -> None:
    """A pool worker ignores Ctrl-C (a terminal sends it to every process; the parent handles it and
    stops the workers through `stop`) and ends with the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent)
    _pool.update(done=done, stop=stop)


def pool_tick(n: int) -> None:
    """In a `worker_pool` worker: `n` more items done (0: only the check); raises once the parent
    stops the pool, so that the task ends early (a shard being written is removed)."""
    if _pool["stop"].is_set():
        raise _Stopped("stopped by the parent process")
    if n:
        with _pool["done"].get_lock():
            _pool["done"].value += n


@contextlib.contextmanager
def worker_pool(workers: int,
                calls: Sequence[tuple[Any, ...]]) -> Iterator[tuple[list[concurrent.futures.Future[Any]], Any]]:
    """Each call `(function, *args)` submitted to a pool of `workers` spawned processes: (the futures,
    the shared count that `pool_tick` adds to). On leaving, running calls stop at their next tick,
    queued ones are cancelled, and the workers are waited for. The workers ignore Ctrl-C from their
    start (`_ctrl_c_ignored`), so that only this process handles it."""
    context = multiprocessing.get_context("spawn")  # safe with threads (progress bar) and any library
    done, stop, pool = context.Value("q", 0), context.Event(), None
    try:
        with _ctrl_c_ignored():
            pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                                          initargs=(os.getpid(), done, stop))
            futures = [pool.submit(*call) for call in calls]  # (the workers start as the first calls are submitted)
        yield futures, done
    finally:
        stop.set()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


@dataclasses.dataclass(frozen=True)
class _Refused:
    """What a task on Dask returns instead of raising a data error (raised again by the client)."""

    error: ShardstreamError


def _dask_call(function: Callable[..., Any], *args: Any) -> Any:
    """A task on Dask: `function(*args)`. A data error (ShardstreamError: a missing or bad input) is the
    same on every try, so it is returned, not raised: Dask tries again only what may go another way."""
    try:
        return function(*args)
    except ShardstreamError as exc:
        return _Refused(exc)


_dask_stops: dict[str, tuple[Any, float]] = {}  # in a Dask worker: each run's stop event, when last looked at


@dataclasses.dataclass(frozen=True)
class _DaskStop:
    """The `tick` of a task on Dask, as `pool_tick` is in a pool: raises once the client has set the
    run's stop event, looked at once a second at most (each look asks the scheduler)."""

    event: str

    def __call__(self, n: int) -> None:
        event, looked = _dask_stops.get(self.event, (None, -1.0))
        now = time.monotonic()
        if looked >= 0 and now - looked < 1.0:
            return
        if event is None:
            from distributed import Event

            event = Event(self.event)
        _dask_stops[self.event] = event, now
        if event.is_set():
            raise _Stopped("stopped by the client (Ctrl-C, or another task failed)")


def _running(dask_worker: Any) -> int:
    """On a Dask worker: how many tasks it runs now (cancelled ones included, until they stop)."""
    return int(dask_worker.state.executing_count)


@contextlib.contextmanager
def _ctrl_c_ignored() -> Iterator[None]:
    """Ctrl-C ignored while inside (when called in the main thread), so that the processes spawned
    meanwhile ignore it from their first instruction: an ignored signal stays ignored across exec,
    while a blocked one is unblocked and a handled one is reset by spawn (a worker that started to
    import torch would die of it). A terminal sends Ctrl-C to every process of its group; the worker
    processes leave it to this one. One pressed while inside is lost (blocking it here would not keep
    it: a thread that does not block it, such as a native one, takes it): keep the inside short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _ctrl_c_noted() -> Iterator[threading.Event]:
    """While inside: Ctrl-C sets the event instead of raising KeyboardInterrupt (in the main thread;
    elsewhere signals do not arrive). On leaving, the old handler is back, and a Ctrl-C noted but not
    acted on is raised (unless an exception is already on its way)."""
    pressed = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.set())
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed.is_set():
        raise KeyboardInterrupt


def dask_tasks(address: str, calls: Sequence[tuple[Any, ...]], names: Sequence[str], *,
               retries: int = 2) -> Iterator[tuple[int, Any]]:
    """Each call `(function, *args)` run as one task on the Dask cluster at `address` (`tcp://host:8786`,
    or `local:N`: a cluster of N local worker processes, made here and closed on leaving), with a
    `tick(n)` appended to its arguments as `worker_pool`'s calls end with `pool_tick`: (the call's
    position, its result) as each finishes. The packers and `shard-pack index` both run on it.

    A task that fails is tried again (`retries` more times), one whose worker died is rescheduled by
    Dask; one that keeps failing raises PackError naming it (`names[position]`, e.g. "shard
    train-000003.tar"). A data error a task raises (ShardstreamError) is not tried again and is raised
    here as it is, as the local pool raises it. On leaving early (Ctrl-C, an error, the caller closing
    the generator), the queued tasks are cancelled and the running ones stop at their next tick
    (within a second). The local cluster's workers ignore Ctrl-C (`shard_tools.dask_worker`): this
    process handles it, as with `worker_pool`, and only between distributed's calls: a KeyboardInterrupt
    raised inside one of them makes distributed log a traceback of its own (`utils.sync`'s cancel)."""
    try:
        from distributed import Client, Event, LocalCluster, as_completed
    except ImportError as exc:
        raise PackError("--dask needs dask.distributed: install the package's dask extra, "
                        "or pip install 'dask[distributed]>=2023.1'") from exc
    run = f"shard-pack-{uuid.uuid4().hex[:12]}"
    tick = _DaskStop(f"{run}-stop")
    futures: dict[Any, int] = {}
    with contextlib.ExitStack() as stack:
        pressed = stack.enter_context(_ctrl_c_noted())
        if address.startswith("local:"):
            with _ctrl_c_ignored():  # (until its workers have started: they import torch before the preload)
                cluster = stack.enter_context(LocalCluster(
                    n_workers=int(address.removeprefix("local:")), threads_per_worker=1, processes=True,
                    dashboard_address=None, preload=["shard_tools.dask_worker"]))
                client = stack.enter_context(Client(cluster))
        else:
            client = stack.enter_context(Client(address))
        try:
            for position, (function, *args) in enumerate(calls):
                futures[client.submit(_dask_call, function, *args, tick, key=f"{run}-{position}", retries=retries,
                                      pure=False)] = position
            finished = as_completed(futures)
            while not finished.is_empty():
                if pressed.is_set():
                    raise KeyboardInterrupt
                ready = finished.next_batch(block=False)
                if not ready:
                    time.sleep(0.05)
                for future in ready:
                    position = futures[future]
                    try:
                        result = future.result()
                    except Exception as exc:
                        raise PackError(f"{names[position]} failed on the Dask cluster after retries: {exc!r}") from exc
                    if isinstance(result, _Refused):
                        raise result.error
                    yield position, result
        finally:
            if any(not future.done() for future in futures):
                client.cancel(list(futures))
                Event(tick.event, client=client).set()  # (after the cancel: a task it stops is not tried again)
                if address.startswith("local:"):  # (closed while a task runs, a worker logs a warning per task)
                    deadline = time.monotonic() + 10
                    while any(client.run(_running).values()) and time.monotonic() < deadline:
                        time.sleep(0.05)
