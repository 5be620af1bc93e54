"""Where a loader's time goes: per-stage clocks in the workers and the main process, a shared table
the workers add to once per batch, and `LoaderStats`, the figures and a verdict (`StreamLoader.stats`).

Workers time: waiting for reads, open, decode (and the kind's own parts of it, `Kind.stages`),
collate, and the rest of their active time (planning, the batch's hand-over to the DataLoader).
The main process times: the hand-off (blocked on the DataLoader's next batch), the device copy,
`kind.finish`, and the training loop (between the loader's yields); together with a small rest,
they are the wall time."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from pipeline.errors import ConfigError

__all__ = ["Clock", "Figures", "Stage", "WorkerTable", "LoaderStats", "INPUT_BOUND", "verdict"]

# "decode": the whole block, the reads' waits, opens and the kind's parts in it included; "active": a batch's work
WORKER_STAGES = ("read", "open", "decode", "collate", "active")
MAIN_STAGES = ("hand-off", "fetch", "finish", "loop", "other")  # "fetch": hand-off + device copy
INPUT_BOUND = 0.10  # the step waited at least this share of the wall time: input-bound, else compute-bound


class Clock:
    """Nanoseconds per named stage. `with clock.stage(name):` adds the block's time to `name` (none if
    an exception leaves it). On a clock made with `rest`, blocks follow one another as `split`s would
    (none nest) and `rest` gets the time between them since `mark`: the stages add up to all of it.
    `split(stage)` gives `stage` the time since the last `mark`, `split` or block. A kind's `decode` is
    handed one and times its own `Kind.stages` with `mark()` before a part and `split(stage)` after it
    (an undeclared name: KeyError); the time it does not split stays the decode's rest."""

    __slots__ = ("ns", "last", "rest", "stages")

    def __init__(self, stages: Sequence[str], rest: str | None = None) -> None:
        self.ns = dict.fromkeys(stages, 0)
        self.last = time.perf_counter_ns()
        self.rest = rest
        self.stages = {name: Stage(self, name) for name in stages}

    def stage(self, name: str) -> Stage:
        """The block that times `name`: made once, so entering it allocates nothing (a stage's blocks
        do not nest in one another)."""
        return self.stages[name]

    def mark(self) -> int:
        self.last = now = time.perf_counter_ns()
        return now

    def split(self, stage: str) -> int:
        now = time.perf_counter_ns()
        self.ns[stage] += now - self.last
        self.last = now
        return now

    def add(self, stage: str, ns: int) -> None:
        self.ns[stage] += ns


class Stage:
    """A with-block of `Clock.stage`, timing one stage."""

    __slots__ = ("clock", "name", "start")

    def __init__(self, clock: Clock, name: str) -> None:
        self.clock, self.name, self.start = clock, name, 0

    def __enter__(self) -> None:
        self.start = now = time.perf_counter_ns()
        clock = self.clock
        if clock.rest is not None:
            clock.ns[clock.rest] += now - clock.last
            clock.last = now

    def __exit__(self, error: type[BaseException] | None, value: object, trace: object) -> None:
        if error is None:
            clock = self.clock
            now = time.perf_counter_ns()
            clock.ns[self.name] += now - (self.start if clock.rest is None else clock.last)
            clock.last = now


class WorkerTable:
    """Per worker of a stream: nanoseconds per stage, samples and batches, in shared memory. A worker
    adds its clock to its row once per batch (`flush`); rows only grow, so the main process reads
    them without locks (a row read mid-update is off by at most that batch)."""

    def __init__(self, kind_stages: Sequence[str], workers: int) -> None:
        clash = set(kind_stages) & set(WORKER_STAGES)
        if clash or len(set(kind_stages)) != len(kind_stages):
            raise ConfigError(f"a kind's stages must be distinct and other than {WORKER_STAGES}, got {kind_stages}")
        self.stages = (*WORKER_STAGES, *kind_stages)
        self.kind_stages = tuple(kind_stages)
        self.table = torch.zeros(max(1, workers), len(self.stages) + 2, dtype=torch.int64).share_memory_()
        self.view: tuple[int, np.ndarray] | None = None  # (pid, the table as numpy in that process): cheaper writes

    def __getstate__(self) -> dict[str, Any]:  # (a spawned worker makes its own view)
        return {**self.__dict__, "view": None}

    def clock(self) -> Clock:
        return Clock(self.stages)

    def flush(self, worker: int, clock: Clock, samples: int) -> None:
        """Add the clock's times, `samples` and one batch to the worker's row; the clock starts afresh."""
        if self.view is None or self.view[0] != os.getpid():
            self.view = (os.getpid(), self.table.numpy())
        self.view[1][worker] += (*clock.ns.values(), samples, 1)
        clock.ns = dict.fromkeys(self.stages, 0)

    def timed(self, worker: int, clock: Clock, made: Iterator[tuple[Any, int]]) -> Iterator[Any]:
        """The batches `made` gives with their sample counts, each one's making timed as "active" (its
        wait at `yield` is not) and the clock flushed to the worker's row before it is handed over."""
        active = clock.stage("active")
        try:
            while True:
                with active:
                    pair = next(made, None)
                if pair is None:
                    return
                self.flush(worker, clock, pair[1])
                yield pair[0]
        finally:
            made.close()

    def totals(self) -> np.ndarray:
        """Over all workers: nanoseconds per stage, then samples and batches."""
        return self.table.numpy().sum(0)


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """A loader's figures over a span (`StreamLoader.stats`): seconds per stage, counts, the verdict.

    `main`: the main process's stages, which add up to `wall_s` ("training loop": the loop held the
    batch; "hand-off": blocked on the DataLoader's next batch, which with num_workers=0 holds the
    workers' stages themselves). `workers`: summed over this rank's workers ("other": the rest of
    their active time)."""

    wall_s: float
    batches: int  # yielded
    samples: int  # decoded by the workers (a batch made before a reset and yielded after counts before it)
    skipped: int
    main: dict[str, float]
    workers: dict[str, float]
    waited: float  # the share of the wall time the step waited for the loader
    verdict: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        lines = [self.verdict, f"{self.batches} batches, {self.samples} samples, {self.skipped} skipped, "
                 f"{self.wall_s:.2f} s wall", f"{'stage':<24}{'seconds':>9}{'share':>8}{'ms/sample':>11}"]
        per = 1000 / max(1, self.samples)
        for title, figures in (("main process", self.main), ("workers", self.workers)):
            total = sum(figures.values()) or 1.0
            lines.append(f"{title}:")
            lines += [f"  {name:<22}{s:>9.3f}{s / total:>8.1%}{s * per:>11.2f}" for name, s in figures.items()]
        return "\n".join(lines)

    @classmethod
    def of(cls, main: np.ndarray, workers: np.ndarray, table: WorkerTable, skipped: int) -> LoaderStats:
        """From the main clock's nanoseconds (`MAIN_STAGES`, then batches) and the workers' totals."""
        m = dict(zip(MAIN_STAGES, (main[:-1] / 1e9).tolist()))
        w = dict(zip(table.stages, (workers[:-2] / 1e9).tolist()))
        parts = {f"decode ({name})": w[name] for name in table.kind_stages}
        stages = {"read wait": w["read"], "open": w["open"], **parts,
                  "decode (rest)" if parts else "decode": w["decode"] - w["read"] - w["open"] - sum(parts.values()),
                  "collate": w["collate"]}
        stages["other"] = w["active"] - sum(stages.values())
        main_stages = {"hand-off": m["hand-off"], "device copy": m["fetch"] - m["hand-off"], "finish": m["finish"],
                       "other": m["other"], "training loop": m["loop"]}
        wall = sum(main_stages.values())
        waited = 1 - m["loop"] / wall if wall > 0 else 0.0
        return cls(wall, int(main[-1]), int(workers[-2]), skipped, main_stages, stages, waited,
                   verdict(waited, int(main[-1]), main_stages, stages))


def verdict(waited: float, batches: int, main: dict[str, float], workers: dict[str, float]) -> str:
    """Input-bound when the step waited `INPUT_BOUND` of the time or more (and what dominates the wait:
    the workers' largest stage, or a main-process stage), else compute-bound."""
    if not batches:
        return "no batches yet"
    head = f"the step waited {waited:.0%} of the time"
    if waited < INPUT_BOUND:
        return f"compute-bound: {head}; the loader keeps up"
    wait = {name: s for name, s in main.items() if name != "training loop"}
    largest = max(wait, key=wait.__getitem__)
    if largest != "hand-off" or not any(s > 0 for s in workers.values()):
        return f"input-bound: {head}; {largest} in the main process dominates"
    return f"input-bound: {head}; {max(workers, key=workers.__getitem__)} dominates the workers' time"


class Figures:
    """A StreamLoader's figures: the main process's clock and batches yielded, beside its workers'
    table and skips (a tensor: row 0, all epochs); `stats` since the start or the last reset."""

    def __init__(self, table: WorkerTable, skipped: Any) -> None:
        self.clock, self.yielded, self.table, self.skipped = Clock(MAIN_STAGES, rest="other"), 0, table, skipped
        self._baseline = self._now()

    def _now(self) -> tuple[np.ndarray, np.ndarray, int]:
        main = np.array([*self.clock.ns.values(), self.yielded], dtype=np.int64)
        return main, self.table.totals(), int(self.skipped[0].sum())

    def stats(self, reset: bool = False) -> LoaderStats:
        now = self._now()
        main, workers, skipped = (a - b for a, b in zip(now, self._baseline))
        if reset:
            self._baseline = now
        return LoaderStats.of(main, workers, self.table, skipped)
