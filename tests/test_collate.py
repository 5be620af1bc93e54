"""Shared-memory batch buffers: workers recycle them, and never one the main process still holds."""

from __future__ import annotations

import gc

import torch

from pipeline import collate, make_stream_loader
from pipeline.collate import LEASE_SLOTS, Leases

SMALL = dict(image_size=64, mask_size=32, max_masks=5)


def test_a_pool_reuses_what_comes_back_and_never_what_is_out():
    leases = Leases(1)
    pool = collate._Pool.of(leases, 0)
    with leases.collating(0) as taken:
        a = collate._pool.take(1000)
        b = collate._pool.take(500)
    assert [slot for slot, _, _ in taken] == [0, 1] and a.numel() >= 1000 and b.numel() >= 500
    assert all(pool.flags[slot] == lease for slot, lease, _ in taken)
    collate._received(leases.token, 0, taken)  # as the main process does on receiving them
    (slot_a, lease_a, _), (slot_b, lease_b, _) = taken
    del a, taken, b
    gc.collect()
    assert pool.flags[slot_a] == lease_a, "the pool still holds its buffer: not handed back"
    pool.buffers[slot_a] = None  # (in a worker, the main process's copy of the buffer is another object)
    gc.collect()
    assert pool.flags[slot_a] == 0 and pool.flags[slot_b] == lease_b
    with leases.collating(0) as taken:
        c = collate._pool.take(400)  # the smallest free buffer that fits: a new one in slot 0
        d = collate._pool.take(600)
    assert [slot for slot, _, _ in taken] == [0, 2] and c.data_ptr() != d.data_ptr()
    collate._release(pool.flags, 0, lease_a)  # a stale finalizer: not this slot's lease any more
    assert pool.flags[0] == taken[0][1]
    pool.flags[:] = 1  # every slot out: a buffer outside the pool, no lease
    with leases.collating(0) as taken:
        collate._pool.take(10)
    assert taken == []


def test_held_batches_stay_intact_and_dropped_ones_come_back(sa1b_dataset):
    def epochs(workers, count):
        loader = make_stream_loader(sa1b_dataset, "train", batch_size=1, num_workers=workers, seed=3, **SMALL)
        out = []
        for epoch in range(count):
            loader.set_epoch(epoch)
            out.append(list(loader))  # every batch held
        return loader, out

    recycled, held = epochs(2, 4)
    _, reference = epochs(0, 4)
    assert sum(map(len, held)) * 2 > 2 * LEASE_SLOTS, "more buffers held than the pools have slots"
    for got, want in zip(held, reference):
        assert [b["keys"] for b in got] == [b["keys"] for b in want]
        for x, y in zip(got, want):
            assert torch.equal(x["images"], y["images"]) and torch.equal(x["masks"], y["masks"])
    table = recycled._stream.leases.table
    del held, got, x
    gc.collect()
    assert int((table != 0).sum()) == 0, "every buffer is handed back once its batch is dropped"
    busy = []
    for batch in recycled:
        busy.append(int((table != 0).sum()))
        del batch
    assert max(busy) <= 2 * 2 * 4, "buffers come back as batches are dropped (2 a batch, 4 batches a worker in flight)"
