"""The last stage: move batches to the device, the next batch's copy overlapping the current step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["to_device", "prefetch_to_cuda"]


def to_device(batch: dict[str, Any], device: torch.device, non_blocking: bool = False) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def prefetch_to_cuda(batches: Iterator[dict[str, Any]], device: torch.device) -> Iterator[dict[str, Any]]:
    """Copy each (pinned) batch on a side stream one batch ahead; the consumer's stream waits only for it."""
    stream = torch.cuda.Stream(device)

    def issue(batch: dict[str, Any]) -> tuple[dict[str, Any], torch.cuda.Event]:
        with torch.cuda.stream(stream):
            moved = to_device(batch, device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return moved, done

    def ready(pending: tuple[dict[str, Any], torch.cuda.Event]) -> dict[str, Any]:
        moved, done = pending
        current = torch.cuda.current_stream(device)
        current.wait_event(done)
        for value in moved.values():
            if isinstance(value, torch.Tensor):
                value.record_stream(current)  # memory made on `stream`, used on `current`
        return moved

    pending = None
    for batch in batches:
        issued = issue(batch)
        if pending is not None:
            yield ready(pending)
        pending = issued
    if pending is not None:
        yield ready(pending)
