"""Preloaded into the worker processes of a `local:N` Dask cluster (`shard_tools.runners.dask_tasks`):
they ignore Ctrl-C, as the local pool's workers do. A terminal sends it to every process of its
group; the process that made the cluster handles it and stops the tasks."""

from __future__ import annotations

import signal
from typing import Any

__all__ = ["dask_setup"]


def dask_setup(worker: Any) -> None:
    """Called by Dask as the worker starts, in its main thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
