"""Where one process (a DataLoader worker, or the process iterating) stands in its iteration of the
stream, for torchdata's `Stateful` protocol: `StatefulDataLoader` asks the dataset for it in each
worker after each batch, and hands it back to the same worker of a fresh loader to resume from.

A position is the worker's plan (epoch, history, its place among the workers), the plan's batches
it has handed over whole and, for a stream of samples, the rows of the next one. It is kept up to
date as items are handed over (`hand_over`), so a state taken between two items counts the first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pipeline.errors import ConfigError
from pipeline.plan import Resume, World
from pipeline.state import EpochState, resume_point

__all__ = ["Position", "Place", "hand_over"]


@dataclasses.dataclass
class Position:
    """A worker's plan, the plan's batches it has handed over whole, and the rows of the next."""

    epoch: int
    history: tuple[Resume, ...]
    worker: int
    num_workers: int
    batches: int = 0
    rows: int = 0


def _pairs(history: Sequence[Resume]) -> list[list[int]]:
    return [[h.world_size, h.batches] for h in history]


class Place:
    """One process's position in its current iteration, and a loaded one for its next."""

    def __init__(self) -> None:
        self.current: Position | None = None
        self.pending: Position | None = None

    def state(self, identity: dict[str, Any], world: World, fresh: Position) -> dict[str, Any]:
        p = self.current or self.pending or fresh
        return {**identity, "epoch": p.epoch, "history": _pairs(p.history), "rank": world.rank,
                "world_size": world.world_size, "num_workers": p.num_workers, "worker": p.worker,
                "batches": p.batches, "rows": p.rows}

    def load(self, state: dict[str, Any], identity: dict[str, Any], here: World, in_step: bool,
             defaults: dict[str, Any] | None = None) -> None:
        """Refuse a state of another dataset, order, kind options, world or worker; else keep it for the
        next iteration. A state of another rank of the same world is this rank's too when `in_step`:
        the ranks' workers hand over the same batches and rows in step (a trainer saves rank 0's and
        loads it on every rank, as Lightning does); with skips they may not. Kind options the state
        lacks are taken at their `defaults`."""
        epoch, history = resume_point(state, identity, defaults)
        try:
            world, rank, workers, worker = (int(state[k]) for k in ("world_size", "rank", "num_workers", "worker"))
            batches, rows = int(state["batches"]), int(state["rows"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"cannot resume: malformed state ({exc!r}): a state_dict() of the dataset (of "
                              "make_stream_dataset or trainer_dataset) is wanted") from exc
        if world != here.world_size or (rank != here.rank and not in_step):
            raise ConfigError(f"cannot resume: the state is of rank {rank} of world_size {world}, this dataset is rank "
                              f"{here.rank} of world_size {here.world_size}; a DataLoader's state resumes in the same "
                              "world only (make_stream_loader's state_dict resumes in another)"
                              + ("" if world != here.world_size else ", and with on_error='skip' on its own rank only"))
        if (workers, worker) != (here.num_workers, here.worker):
            raise ConfigError(f"cannot resume: the state is of DataLoader worker {worker} of {workers}, this is worker "
                              f"{here.worker} of {here.num_workers}: resume with "
                              f"num_workers={workers if workers > 1 else 0}")
        self.hold(Position(epoch, history, worker, workers, batches, rows))

    def hold(self, position: Position) -> None:
        self.pending, self.current = position, None

    def start(self, fresh: Position, shared: EpochState, left: Callable[[tuple[Resume, ...]], int]) -> Position:
        """Where the next iteration starts: `fresh` (the shared epoch and history), or the loaded
        position, unless the main process chose another epoch since: refused while the loaded epoch
        has batches left for this worker (`left(history)`: the rank's), no conflict at its end
        (torchdata and accelerate save a state after an epoch's last batch)."""
        pending, self.pending = self.pending, None
        start = fresh if pending is None else pending
        if pending is not None and ((shared.chosen[0] and shared.epoch != pending.epoch)
                                    or (shared.history and shared.history != pending.history)):
            mine = -(-(left(pending.history) - pending.worker) // pending.num_workers)  # (this worker's share)
            if pending.batches < mine:
                raise ConfigError(f"cannot resume: the loaded state is of epoch {pending.epoch} after "
                                  f"{_pairs(pending.history)}, with {mine - pending.batches} batches of this worker "
                                  f"left, and this dataset was set to epoch {shared.epoch} after "
                                  f"{_pairs(shared.history)} since; call set_epoch({pending.epoch}), or none, "
                                  "before iterating")
            # (at its end: this iteration yields nothing, StatefulDataLoader drops it and begins a new
            # one, of the chosen epoch; playing that here would decode it twice)
        self.current = start
        return start


def hand_over(batches: Iterator[Any], position: Position, unbatch: Callable[[Any], list[Any]] | None,
              drop: int = 0) -> Iterator[Any]:
    """The batches, or with `unbatch` their rows (the first `drop` of the first batch left out),
    counted in `position` before each is handed over: a state taken then includes it."""
    for batch in batches:
        if unbatch is None:
            position.batches += 1
            yield batch
            continue
        rows = unbatch(batch)[drop:]
        drop = 0
        if not rows:
            position.batches, position.rows = position.batches + 1, 0
        for i, row in enumerate(rows):
            if i == len(rows) - 1:  # (the batch's last row: the batch is handed over whole)
                position.batches, position.rows = position.batches + 1, 0
            else:
                position.rows += 1
            yield row
