"""Batch building blocks shared by the kinds: allocation in shared memory, bit-packed masks.

A DataLoader worker hands each batch to the main process through shared memory. Allocating the
batch there from the start (and zeroing only its padding) spares a full copy; sending masks as
bits (8 to a byte) spares 7/8 of their bytes through shared memory, pinned memory and PCIe. The
last stage, after the device copy, unpacks them (on the GPU when the batch is there).

Fresh shared memory costs a page fault per 4 KiB page on first touch (~4 us each on a VM: a
quarter of the cost of a 1024-row embeddings batch), so a worker recycles its buffers: `Leases`
lends a worker's buffers out with each batch, and the main process hands each one back when its
last tensor there is freed (after the pinned copy, or when the user drops the batch).
"""

from __future__ import annotations

import contextlib
import random
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

__all__ = ["empty", "pack_bits", "unpack_bits", "Leases", "LEASE_SLOTS"]

_BITS = (128, 64, 32, 16, 8, 4, 2, 1)
LEASE_SLOTS = 16  # buffers a worker keeps for reuse: enough for the batches in flight and one held by the user
_TABLES: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # main process: token -> table
_pool: _Pool | None = None  # the pool `empty` takes from in this worker, while a batch is collated


class Leases:
    """Shared-memory buffers lent with batches: a table, made in the main process before the workers
    start, holds per worker and slot the id of the lease out (0: free). A worker reuses a buffer
    only once the main process has freed every tensor on it (its finalizer zeroes the entry)."""

    def __init__(self, workers: int) -> None:
        self.table = torch.zeros(workers, LEASE_SLOTS, dtype=torch.int64).share_memory_()
        self.token = random.SystemRandom().getrandbits(62)
        _TABLES[self.token] = self.table

    @contextlib.contextmanager
    def collating(self, worker: int) -> Iterator[list[tuple[int, int, torch.Tensor]]]:
        """Within: `empty` takes this worker's free buffers; yields the leases taken (slot, id, buffer)."""
        global _pool
        pool = _Pool.of(self, worker)
        taken: list[tuple[int, int, torch.Tensor]] = []
        _pool, pool.taken = pool, taken
        try:
            yield taken
        finally:
            _pool, pool.taken = None, None

    def lend(self, worker: int, taken: list[tuple[int, int, torch.Tensor]]) -> _Lent:
        """What goes with the batch: unpickled in the main process, it frees the slots with the buffers."""
        return _Lent(self.token, worker, taken)

    def forget(self, worker: int, taken: list[tuple[int, int, torch.Tensor]]) -> None:
        """The batch cannot carry its leases (not a dict): its buffers leave the pool for good."""
        _Pool.of(self, worker).forget(taken)


class _Pool:
    """One worker process's buffers, by slot."""

    _mine: dict[tuple[int, int], _Pool] = {}

    def __init__(self, leases: Leases, worker: int) -> None:
        self.flags = leases.table[worker].numpy()
        self.flags[:] = 0  # (an earlier worker's leases still out are told apart by their ids)
        self.buffers: list[torch.Tensor | None] = [None] * LEASE_SLOTS
        self.ids = random.Random(random.SystemRandom().getrandbits(64))
        self.taken: list[tuple[int, int, torch.Tensor]] | None = None

    @classmethod
    def of(cls, leases: Leases, worker: int) -> _Pool:
        pool = cls._mine.get((leases.token, worker))
        if pool is None:
            pool = cls._mine[(leases.token, worker)] = cls(leases, worker)
        return pool

    def take(self, nbytes: int) -> torch.Tensor:
        """A free buffer of at least `nbytes` (the smallest that fits), or a new one in a free slot;
        with no slot free, a buffer outside the pool."""
        free = [s for s in range(LEASE_SLOTS) if self.flags[s] == 0]
        fits = [s for s in free if self.buffers[s] is not None and self.buffers[s].numel() >= nbytes]
        if fits:
            slot = min(fits, key=lambda s: self.buffers[s].numel())
        elif free:
            slot = next((s for s in free if self.buffers[s] is None), free[0])
            self.buffers[slot] = torch.empty(nbytes + nbytes // 8, dtype=torch.uint8).share_memory_()
        else:
            return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
        lease = self.ids.getrandbits(62) + 1
        self.flags[slot] = lease
        buffer = self.buffers[slot]
        assert self.taken is not None and buffer is not None
        self.taken.append((slot, lease, buffer))
        return buffer

    def forget(self, taken: list[tuple[int, int, torch.Tensor]]) -> None:
        for slot, _, _ in taken:
            self.buffers[slot] = None
            self.flags[slot] = 0


class _Lent:
    """A batch's leases on their way to the main process, where they become a finalizer per buffer."""

    def __init__(self, token: int, worker: int, taken: list[tuple[int, int, torch.Tensor]]) -> None:
        self.token, self.worker, self.taken = token, worker, taken

    def __reduce__(self) -> tuple[Any, ...]:
        return _received, (self.token, self.worker, self.taken)


def _received(token: int, worker: int, taken: list[tuple[int, int, torch.Tensor]]) -> None:
    table = _TABLES.get(token)
    if table is None:  # not unpickled by the process that made the table: the slots stay taken
        return
    flags = table[worker].numpy()
    for slot, lease, buffer in taken:
        weakref.finalize(buffer.untyped_storage(), _release, flags, slot, lease)


def _release(flags: np.ndarray, slot: int, lease: int) -> None:
    if flags[slot] == lease:  # (a lease of a worker since replaced is not this slot's any more)
        flags[slot] = 0


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor; in a DataLoader worker, already in shared memory (recycled, when
    the loader lends buffers)."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    if _pool is None:
        return torch.empty(shape, dtype=dtype).share_memory_()
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return _pool.take(nbytes)[:nbytes].view(dtype).view(shape)


def pack_bits(masks: np.ndarray) -> np.ndarray:
    """(..., w) bool -> (..., ceil(w / 8)) uint8, most significant bit first."""
    return np.packbits(masks, axis=-1)


def unpack_bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of `pack_bits` for a tensor on any device: (..., ceil(width / 8)) uint8 -> (..., width) bool."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), axis=-1, count=width).view(np.bool_))
    bits = torch.tensor(_BITS, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) & bits) != 0).flatten(-2)[..., :width]
