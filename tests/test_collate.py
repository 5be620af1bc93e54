"""Shared-memory batch buffers: workers recycle them, and never one the main process still holds; bit-packed
masks and padded images."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest
import torch
import torch.multiprocessing  # noqa: F401  (registers the reductions that share tensors)
from hypothesis import given, settings
from hypothesis import strategies as st
from multiprocessing.reduction import ForkingPickler

from pipeline import collate, make_stream_loader
from pipeline.collate import LEASE_SLOTS, Leases

SMALL = dict(image_size=64, mask_size=32, max_masks=5)


def _send(leases: Leases, batch: dict) -> tuple[dict, bool]:
    """A worker's batch as the main process receives it (the same pickling), and whether a buffer
    itself went with it (rather than only its place)."""
    leases.lend(0, batch)
    mapped = any(lent.place.buffer is not None for lent in batch.values())
    return pickle.loads(ForkingPickler.dumps(batch)), mapped


def _collated(leases: Leases, **sizes: int) -> dict:
    with leases.collating(0):
        return {name: collate._pool.take(n)[:n] for name, n in sizes.items()}


def test_buffers_are_mapped_once_and_reused_only_once_handed_back():
    leases = Leases(1)
    first = _collated(leases, a=1000, b=500)
    first["a"][:] = 7
    where = first["a"].data_ptr()
    got, mapped = _send(leases, first)
    pool = collate._Pool.of(leases, 0)
    assert mapped and torch.equal(got["a"], torch.full((1000,), 7, dtype=torch.uint8)) and got["b"].numel() == 500
    assert (pool.flags[:2] != 0).all(), "both buffers are out"
    again = _collated(leases, a=1000)
    assert again["a"].data_ptr() != where, "a buffer out is not reused"
    del got
    gc.collect()
    assert pool.flags[0] == 0 and pool.flags[1] == 0, "handed back once the main process dropped the batch"
    third = _collated(leases, a=900)
    assert third["a"].data_ptr() == where, "the smallest free buffer that fits"
    third["a"][:] = 9
    got, mapped = _send(leases, third)
    assert not mapped and torch.equal(got["a"], torch.full((900,), 9, dtype=torch.uint8)), \
        "a buffer already mapped travels as its place only"
    view = got["a"][:10]
    del got
    gc.collect()
    assert pool.flags[0] != 0, "any view of the batch keeps its buffer out"
    lease = int(pool.flags[0])
    collate._release(pool.flags, 0, lease + 1)  # a stale finalizer (a lease of an earlier worker)
    assert pool.flags[0] == lease
    del view
    gc.collect()
    assert pool.flags[0] == 0


def test_a_free_buffer_too_small_is_replaced_and_the_new_one_sent():
    leases = Leases(1)
    pool = collate._Pool.of(leases, 0)
    got, _ = _send(leases, _collated(leases, **{f"x{i}": 100 for i in range(LEASE_SLOTS)}))  # every slot a small buffer
    del got
    gc.collect()
    big = _collated(leases, x=10_000)
    big["x"][:] = 5
    got, mapped = _send(leases, big)
    assert mapped and torch.equal(got["x"], torch.full((10_000,), 5, dtype=torch.uint8))
    assert sum(b is not None and b.numel() >= 10_000 for b in pool.buffers) == 1


def test_a_batch_holding_buffers_elsewhere_than_at_its_top_level_takes_them_along():
    leases = Leases(1)
    pool = collate._Pool.of(leases, 0)
    nested = _collated(leases, a=100)
    batch = {"nested": [nested["a"]]}
    leases.lend(0, batch)
    assert pool.buffers[0] is None and pool.flags[0] == 0 and isinstance(batch["nested"][0], torch.Tensor)
    pool.flags[:] = 1  # every slot out: a buffer outside the pool, sent as a plain tensor
    full = _collated(leases, a=10)
    leases.lend(0, full)
    assert isinstance(full["a"], torch.Tensor) and pool.buffers[0] is None


@pytest.mark.parametrize("persistent", [True, False])  # False: each epoch's workers are new, the held batches not
def test_held_batches_stay_intact_and_dropped_ones_come_back(sa1b_dataset, persistent):
    def epochs(workers, count):
        loader = make_stream_loader(sa1b_dataset, "train", batch_size=1, num_workers=workers, seed=3,
                                    persistent_workers=persistent if workers else None, **SMALL)
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
    table = recycled.stream.stages.decoder.leases.table
    del held, got, x
    gc.collect()
    assert int((table != 0).sum()) == 0, "every buffer is handed back once its batch is dropped"
    busy = []
    for batch in recycled:
        busy.append(int((table != 0).sum()))
        del batch
    assert max(busy) <= 2 * 2 * 4, "buffers come back as batches are dropped (2 a batch, 4 batches a worker in flight)"


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3), st.integers(1, 20), st.integers(1, 40), st.booleans(), st.integers(0, 2**32 - 1))
def test_unpack_bits_inverts_numpys_packbits(k, h, w, strided, seed):
    masks = np.random.default_rng(seed).random((k, h, w)) < 0.5
    packed = torch.from_numpy(np.packbits(masks, axis=-1))
    if strided:  # (not contiguous: unpacked row by row)
        packed = torch.cat([packed, packed], dim=-1)[..., : packed.shape[-1]]
    assert torch.equal(collate.unpack_bits(packed, w), torch.from_numpy(masks))


def test_spares_reuse_a_buffer_only_once_every_tensor_on_it_is_gone():
    spares = collate.Spares(keep=1)
    first = spares.empty((4, 8), torch.int64)
    view, address = first[1:], first.data_ptr()  # (a view keeps the buffer in use)
    del first
    second = spares.empty((4, 8), torch.int64)
    pointers = [second.data_ptr()]  # (plain ints: pytest's rewritten asserts would keep tensors alive)
    del view
    third = spares.empty((4, 8), torch.int64)
    small = spares.empty((2, 8), torch.int64)
    pointers += [third.data_ptr(), small.data_ptr()]
    assert pointers[0] != address, "a buffer still in use is not handed out"
    assert pointers[1] == address, "a buffer no tensor uses any more is reused"
    assert pointers[2] not in pointers[:2], "only for its size"
    del second, third
    again = spares.empty((4, 8), torch.int64).data_ptr()
    assert again == pointers[0], "the first given back is kept (keep=1)"


def test_padded_images_fills_the_given_tensor_padding_included():
    images = [torch.full((3, 2, 3), 7, dtype=torch.uint8), torch.full((3, 4, 1), 9, dtype=torch.uint8)]
    out = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)  # (a recycled buffer: old bytes everywhere)
    assert collate.padded_images(images, 4, 4, out) is out
    expected = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    expected[0, :, :2, :3], expected[1, :, :4, :1] = 7, 9
    assert torch.equal(out, expected)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.sampled_from(["contiguous", "decoded", "cropped"]),
       st.integers(0, 2**32 - 1))
def test_padded_images_mirror_an_image_as_numpy_reverses_it(h, w, layout, seed):
    """Every width (8-byte words and the bytes left over) and every layout an image comes in: CHW
    contiguous (resized), (h, w, 3) as decoded seen as CHW, and a crop of a larger image."""
    rng = np.random.default_rng(seed)
    if layout == "decoded":
        image = torch.from_numpy(rng.integers(0, 256, (h, w, 3), np.uint8)).permute(2, 0, 1)
    elif layout == "cropped":
        image = torch.from_numpy(rng.integers(0, 256, (3, h + 3, w + 5), np.uint8))[:, 1 : h + 1, 3 : w + 3]
    else:
        image = torch.from_numpy(rng.integers(0, 256, (3, h, w), np.uint8))
    out = torch.full((2, 3, 8, 48), 255, dtype=torch.uint8)
    collate.padded_images([image, image], 8, 48, out, mirrored=[True, False])
    expected = torch.zeros(2, 3, 8, 48, dtype=torch.uint8)
    expected[0, :, :h, :w] = torch.from_numpy(np.asarray(image)[..., ::-1].copy())
    expected[1, :, :h, :w] = image
    assert torch.equal(out, expected)
