"""Batch building blocks shared by the kinds: allocation in shared memory, bit-packed masks.

A DataLoader worker hands each batch to the main process through shared memory. Allocating the
batch there from the start (and zeroing only its padding) spares a full copy; sending masks as
bits (8 to a byte) spares 7/8 of their bytes through shared memory, pinned memory and PCIe. The
last stage, after the device copy, unpacks them (on the GPU when the batch is there).

Fresh shared memory costs a page fault per 4 KiB page on first touch (~4 us each on a VM: a
quarter of the cost of a 1024-row embeddings batch), and sending a shared tensor costs a file
descriptor's round trip between the processes and a new mapping. So a worker recycles its
buffers (`Leases`): the main process maps each buffer once, each batch travels as (buffer,
offset, shape), and the main process hands a buffer back when the last tensor of the batch on
it is freed (after the pinned copy, or when the user drops the batch). For the same reason,
masks unpacked on the CPU go into recycled buffers (`Spares`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

__all__ = ["empty", "padded_images", "copy_mirrored", "unpack_bits", "rows", "Spares", "Leases", "LEASE_SLOTS"]

_BITS = (128, 64, 32, 16, 8, 4, 2, 1)
LEASE_SLOTS = 16  # buffers a worker keeps for reuse: enough for the batches in flight and one held by the user
_MAIN: weakref.WeakValueDictionary[int, Leases] = weakref.WeakValueDictionary()  # in the main process, by token
_pool: _Pool | None = None  # the pool `empty` takes from in this worker, while a batch is collated


class Leases:
    """Shared-memory buffers lent with batches. A table, made in the main process before the workers
    start, holds per worker and slot the id of the lease out (0: free). A worker reuses a buffer
    only once the main process has freed every tensor on it (a finalizer zeroes the entry)."""

    def __init__(self, workers: int) -> None:
        self.table = torch.zeros(workers, LEASE_SLOTS, dtype=torch.int64).share_memory_()
        self.token = random.SystemRandom().getrandbits(62)
        self._mapped: dict[tuple[int, int], tuple[int, np.ndarray]] = {}  # main: (worker, slot) -> (serial, buffer)
        self._storages: weakref.WeakValueDictionary[int, torch.UntypedStorage] = weakref.WeakValueDictionary()
        _MAIN[self.token] = self

    def __getstate__(self) -> dict[str, Any]:
        return {"table": self.table, "token": self.token, "_mapped": {}, "_storages": None}

    @contextlib.contextmanager
    def collating(self, worker: int) -> Iterator[None]:
        """Within: `empty` takes this worker's free buffers."""
        global _pool
        _pool = _Pool.of(self, worker)
        try:
            yield
        finally:
            _pool = None

    def lend(self, worker: int, batch: Any) -> None:
        """Replace the batch's tensors on buffers taken since the last call by what travels in their
        place (`_Lent`); a taken buffer the batch does not hold at its top level leaves the pool."""
        pool = _Pool.of(self, worker)
        taken, pool.taken = pool.taken, []
        slots = {pool.buffers[slot].untyped_storage().data_ptr(): (slot, lease) for slot, lease in taken}
        kept = set()
        for name, value in batch.items() if isinstance(batch, dict) else ():
            if isinstance(value, torch.Tensor) and value.is_contiguous():
                hit = slots.get(value.untyped_storage().data_ptr())
                if hit is not None:
                    slot, lease = hit
                    first = slot not in pool.sent
                    pool.sent.add(slot)
                    place = _Place(worker, slot, lease, pool.serials[slot], pool.buffers[slot] if first else None,
                                   value.storage_offset() * value.element_size(), tuple(value.shape), value.dtype)
                    batch[name] = _Lent(self.token, place)
                    kept.add(slot)
        pool.forget([slot for slot, _ in taken if slot not in kept])

    def _tensor(self, place: _Place) -> torch.Tensor:
        """In the main process: a lent tensor over the mapped buffer, on a storage of the lease's own."""
        worker, slot = place.worker, place.slot
        if place.buffer is not None:
            self._mapped[(worker, slot)] = (place.serial, place.buffer.numpy())
        mapped = self._mapped.get((worker, slot))
        if mapped is None or mapped[0] != place.serial:
            raise RuntimeError(f"shardstream: DataLoader worker {worker}'s buffer {slot} arrived before its mapping")
        storage = self._storages.get(place.lease)
        if storage is None:
            storage = self._storages[place.lease] = torch.frombuffer(mapped[1], dtype=torch.uint8).untyped_storage()
            weakref.finalize(storage, _release, self.table[worker].numpy(), slot, place.lease)
        nbytes = int(np.prod(place.shape)) * place.dtype.itemsize
        flat = torch.empty(0, dtype=torch.uint8).set_(storage, place.offset, (nbytes,), (1,))
        return flat.view(place.dtype).view(place.shape)


class _Pool:
    """One worker process's buffers, by slot."""

    _mine: dict[tuple[int, int], _Pool] = {}

    def __init__(self, leases: Leases, worker: int) -> None:
        self.flags = leases.table[worker].numpy()
        self.flags[:] = 0  # (an earlier worker's leases still out are told apart by their ids)
        self.buffers: list[torch.Tensor | None] = [None] * LEASE_SLOTS
        self.ids = random.Random(random.SystemRandom().getrandbits(64))
        self.serials = [0] * LEASE_SLOTS  # which buffer a slot holds (the main process maps each once)
        self.sent: set[int] = set()  # slots whose buffer the main process has been sent
        self.taken: list[tuple[int, int]] = []  # (slot, lease) since the last `lend`

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
            self.serials[slot] = self.ids.getrandbits(62)
            self.sent.discard(slot)
        else:
            return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
        lease = self.ids.getrandbits(62) + 1
        self.flags[slot] = lease
        self.taken.append((slot, lease))
        buffer = self.buffers[slot]
        assert buffer is not None
        return buffer

    def forget(self, slots: list[int]) -> None:
        """These buffers went with a batch as plain tensors: they are the batch's now."""
        for slot in slots:
            self.buffers[slot] = None
            self.flags[slot] = 0


@dataclasses.dataclass(frozen=True)
class _Place:
    """Where a lent tensor lies: a worker's buffer (by slot, lease and serial), and the buffer itself
    the first time it is sent; the tensor's byte offset in it, shape and dtype."""

    worker: int
    slot: int
    lease: int
    serial: int
    buffer: torch.Tensor | None
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Lent:
    """A tensor on a lent buffer, on its way to the main process: its place, rebuilt as a tensor there."""

    def __init__(self, token: int, place: _Place) -> None:
        self.token, self.place = token, place

    def __reduce__(self) -> tuple[Any, ...]:
        return _received, (self.token, self.place)


def _received(token: int, place: _Place) -> torch.Tensor:
    leases = _MAIN.get(token)
    if leases is None:
        raise RuntimeError("shardstream: a lent batch buffer unpickled outside the process that made the loader")
    return leases._tensor(place)


def _release(flags: np.ndarray, slot: int, lease: int) -> None:
    if flags[slot] == lease:  # (a lease of a worker since replaced is not this slot's any more)
        flags[slot] = 0


class Spares:
    """A process's batch-sized buffers, each reused once every tensor on it is gone: a fresh 33 MB
    tensor costs ~20 ms of page faults and zeroing on first touch here, 4x unpacking masks into it.
    A request takes the smallest free buffer that fits it (without wasting half); at most `keep`
    free buffers are kept, and more in use are simply new ones."""

    def __init__(self, keep: int = 4) -> None:
        self.keep, self._free, self._lock = keep, [], threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        with self._lock:
            fits = [i for i, buffer in enumerate(self._free) if nbytes <= buffer.nbytes <= 2 * nbytes]
            if fits:
                buffer = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
            else:
                buffer = np.empty(nbytes + nbytes // 8, np.uint8)  # (room for a batch a little larger)
        tensor = torch.from_numpy(buffer[:nbytes]).view(dtype).view(shape)
        weakref.finalize(tensor.untyped_storage(), self._give_back, buffer)  # (the storage outlives every view)
        return tensor

    def _give_back(self, buffer: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buffer)


_SPARES = Spares()


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor, on a recycled buffer (`Spares`); in a DataLoader worker, already in
    shared memory (recycled, when the loader lends buffers)."""
    if get_worker_info() is None:
        return _SPARES.empty(shape, dtype)
    if _pool is None:
        return torch.empty(shape, dtype=dtype).share_memory_()
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return _pool.take(nbytes)[:nbytes].view(dtype).view(shape)


def padded_images(images: Sequence[torch.Tensor], height: int, width: int,
                  out: torch.Tensor | None = None, mirrored: Sequence[bool] = ()) -> torch.Tensor:
    """(B, 3, height, width) uint8 from (3, h, w) RGB images, each at the top left and zero-padded (only the
    padding is written besides the image: `empty` may hand back a recycled buffer), in `out` if given;
    image i mirrored left to right where `mirrored[i]` (`copy_mirrored`: the flip costs no pass of its own).
    (Copied by numpy: ~15% faster than torch's strided copy into the padded frame.)"""
    out = empty((len(images), 3, height, width), torch.uint8) if out is None else out
    for i, image in enumerate(images):
        _, h, w = image.shape
        copy = copy_mirrored if i < len(mirrored) and mirrored[i] else np.copyto
        copy(out[i, :, :h, :w].numpy(), np.asarray(image))
        out[i, :, h:] = 0
        out[i, :, :h, w:] = 0
    return out


def copy_mirrored(dest: np.ndarray, src: np.ndarray) -> None:
    """`dest[...] = src[..., ::-1]` for uint8 arrays, as fast as a plain copy. numpy copies a reversed
    row byte by byte (~4x a plain copy); here a row's bytes are read 8 at a time in reverse order and
    stored byte-swapped (a little-endian word written as big-endian), the w % 8 bytes left done alone.
    (A source not contiguous along rows, an image as decoded (h, w, 3) seen as (3, h, w), is copied
    element by element either way, reversed as fast.)"""
    w = src.shape[-1]
    if src.strides[-1] != 1 or dest.strides[-1] != 1:
        np.copyto(dest, src[..., ::-1])
        return
    r = w % 8
    np.copyto(dest[..., : w - r].view(">u8"), src[..., r:].view("<u8")[..., ::-1])
    if r:
        np.copyto(dest[..., w - r :], src[..., r - 1 :: -1])


_CHUNK = 1 << 17  # packed bytes unpacked at a time: their bools stay in cache until copied out


def unpack_bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """(..., ceil(width / 8)) uint8, most significant bit first (`np.packbits`) -> (..., width) bool,
    on the tensor's device."""
    if packed.device.type == "cpu":
        bits = packed.numpy()
        if width != 8 * bits.shape[-1] or not bits.flags.c_contiguous:
            return torch.from_numpy(np.unpackbits(bits, axis=-1, count=width).view(np.bool_))
        out = _SPARES.empty((*bits.shape[:-1], width), torch.bool)
        flat, dest = bits.reshape(-1), out.numpy().reshape(-1).view(np.uint8)
        for start in range(0, flat.size, _CHUNK):  # (~2x np.unpackbits into fresh memory)
            dest[8 * start : 8 * (start + _CHUNK)] = np.unpackbits(flat[start : start + _CHUNK])
        return out
    bits = torch.tensor(_BITS, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) & bits) != 0).flatten(-2)[..., :width]


def rows(batch: dict[str, Any] | list[dict[str, Any]], options: Any = None) -> list[dict[str, Any]]:
    """A finished batch's samples: row i of every field, under the batch's keys (a list is its samples)."""
    if isinstance(batch, list):
        return batch
    b = len(next(iter(batch.values())))
    return [{name: value[i] for name, value in batch.items()} for i in range(b)]
