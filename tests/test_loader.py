"""make_stream_loader: exact splitting, determinism, decoded content against references, errors, device."""

from __future__ import annotations

import gc
import hashlib
import io
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image
from procs import alive, children
from pycocotools import mask as mask_utils

import pipeline.loader as loader_module
from pipeline.schedule import FirstOut
from pipeline import SampleError, ShardError, make_stream_loader, validate_first_batch
from pipeline.format import Manifest
from pipeline.kinds.sa1b import Sa1b, Sa1bOptions
from conftest import indexed, sa1b_originals, split_keys

SMALL = dict(image_size=64, mask_size=32, max_masks=5)


def _manifest(root: str) -> Manifest:
    return Manifest.from_json((pathlib.Path(root) / "manifest.json").read_bytes(), root)


def _epoch(loader, epoch: int = 0) -> list[dict]:
    loader.set_epoch(epoch)
    return list(loader)


def _same(a: list[dict], b: list[dict]) -> None:
    assert [x["keys"] for x in a] == [x["keys"] for x in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for name, value in x.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, y[name]), name


def test_same_batches_for_any_workers_and_worker_lifetime(sa1b_dataset):
    runs = {
        (workers, persistent): [
            _epoch(make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=workers, seed=7,
                                      persistent_workers=persistent, **SMALL), epoch)
            for epoch in (0, 1)
        ]
        for workers, persistent in [(0, None), (1, True), (2, True), (2, False), (3, False)]
    }
    reference = runs[(0, None)]
    for got in runs.values():
        for epoch in (0, 1):
            _same(got[epoch], reference[epoch])
    assert [b["keys"] for b in reference[0]] != [b["keys"] for b in reference[1]], "epochs differ"


def test_persistent_workers_follow_set_epoch(sa1b_dataset):
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=2, persistent_workers=True, **SMALL)
    fresh = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=0, **SMALL)
    for epoch in (0, 1, 2, 1):
        _same(_epoch(loader, epoch), _epoch(fresh, epoch))


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_sample_once_across_ranks_and_workers(sa1b_dataset, drop_last):
    train = split_keys(sa1b_dataset)
    for world_size in (1, 2, 3):
        for workers in (0, 2, 3):
            seen, lengths = [], set()
            for rank in range(world_size):
                loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=workers, rank=rank,
                                            world_size=world_size, drop_last=drop_last, **SMALL)
                batches = _epoch(loader, 3)
                assert len(batches) == len(loader)
                lengths.add(len(batches))
                seen += [k for b in batches for k in b["keys"]]
            assert len(lengths) == 1, "every rank yields the same number of batches"
            assert len(seen) == len(set(seen))
            if drop_last:
                assert set(seen) <= set(train) and len(train) - len(seen) < 2 * world_size
            else:
                assert sorted(seen) == sorted(train)


def test_fewer_shards_than_workers(sa1b_src, tmp_path):
    from shard_tools.pack import PackOptions, pack
    from shard_tools.sa1b import Sa1bSource

    pack(Sa1bSource(), [str(sa1b_src)], str(tmp_path), PackOptions(shard_samples=100), progress=False)
    assert len(_manifest(str(tmp_path)).splits["train"]) == 1
    loader = make_stream_loader(str(tmp_path), "train", batch_size=3, num_workers=3, drop_last=False, **SMALL)
    keys = [k for b in _epoch(loader) for k in b["keys"]]
    assert sorted(keys) == sorted(f"sa_{i}" for i in range(1, 15))


def test_no_shuffle_gives_manifest_order(sa1b_dataset):
    loader = make_stream_loader(sa1b_dataset, "val", batch_size=2, num_workers=2, shuffle=False, drop_last=False, **SMALL)
    keys = [k for b in _epoch(loader, 5) for k in b["keys"]]
    assert keys == split_keys(sa1b_dataset, "val")


def _sources(sa1b_src: pathlib.Path) -> dict[str, tuple[bytes, dict]]:
    return {key: (jpg, meta) for key, (meta, jpg) in sa1b_originals(sa1b_src).items()}


def _fit(height: int, width: int, size: int) -> tuple[int, int]:
    """The frame an image of (height, width) is resized to: its long side `size`, the aspect kept,
    each side rounded half up (and at least 1)."""
    long = max(height, width)
    return tuple(max(1, math.floor(Fraction(side * size, long) + Fraction(1, 2))) for side in (height, width))


def _chosen_masks(count: int, limit: int, seed: int, epoch: int, key: str) -> np.ndarray:
    """The masks a sample uses, as `pipeline.seeds` documents the draw: all if few, else a sorted choice
    without replacement from numpy's default_rng([seed, epoch, 3 (the masks' purpose), the key's
    blake2b-128, little-endian])."""
    if count <= limit:
        return np.arange(count)
    entropy = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=16).digest(), "little")
    return np.sort(np.random.default_rng([seed, epoch, 3, entropy]).choice(count, limit, replace=False))


@pytest.mark.parametrize("mask_size", [32, None, 128])  # 128: masks finer than the 80-pixel images, allowed
def test_batches_match_reference_decoders(sa1b_src, sa1b_dataset, mask_size):
    options = Sa1bOptions(image_size=80, mask_size=mask_size, max_masks=6)
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=3, num_workers=2, seed=11, drop_last=False,
                                image_size=80, mask_size=mask_size, max_masks=6)
    sources = _sources(sa1b_src)
    for batch in _epoch(loader, 2):
        assert Sa1b(options).check(batch, 2) == []
        m = options.mask_frame
        for i, key in enumerate(batch["keys"]):
            jpg, meta = sources[key]
            height, width = meta["image"]["height"], meta["image"]["width"]
            anns = meta["annotations"]
            chosen = _chosen_masks(len(anns), 6, 11, 2, key)
            count = int(batch["mask_counts"][i])
            assert count == len(chosen) == min(6, len(anns))
            # masks: pycocotools' full decode, then torch's pixel-center nearest resize, exactly
            mh, mw = _fit(height, width, m)
            full = torch.from_numpy(mask_utils.decode([anns[j]["segmentation"] for j in chosen])).permute(2, 0, 1)
            ref = torch.nn.functional.interpolate(full[None].float(), size=(mh, mw), mode="nearest-exact")[0].bool()
            got = batch["masks"][i]
            assert torch.equal(got[:count, :mh, :mw], ref)
            assert not got[count:].any() and not got[:, mh:].any() and not got[:, :, mw:].any(), "zero padding"
            # geometry in the resized frame
            h, w = _fit(height, width, 80)
            assert batch["image_sizes"][i].tolist() == [h, w] and batch["original_sizes"][i].tolist() == [height, width]
            boxes = np.array([anns[j]["bbox"] for j in chosen]) * (w / width, h / height, w / width, h / height)
            boxes[:, 2:] += boxes[:, :2]
            np.testing.assert_allclose(batch["boxes"][i, :count].numpy(), boxes, rtol=1e-5, atol=1e-4)
            assert not batch["boxes"][i, count:].any() and not batch["areas"][i, count:].any()
            np.testing.assert_allclose(batch["predicted_ious"][i, :count].numpy(), [anns[j]["predicted_iou"] for j in chosen], rtol=1e-6)
            assert batch["image_ids"][i] == meta["image"]["image_id"]
            # image: close to a full decode resized to the same frame (the loader decodes at reduced scale)
            ref_image = np.asarray(Image.open(io.BytesIO(jpg)).convert("RGB").resize((w, h), Image.Resampling.BILINEAR))
            got_image = batch["images"][i, :, :h, :w].permute(1, 2, 0).numpy().astype(int)
            assert np.abs(got_image - ref_image).mean() < 8
            assert not batch["images"][i, :, h:].any() and not batch["images"][i, :, :, w:].any()


def test_masks_are_sampled_per_epoch_and_max_masks_may_follow_the_epoch(sa1b_dataset):
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=4, num_workers=0, shuffle=False,
                                image_size=64, mask_size=16, max_masks=lambda epoch: 2 + epoch)
    for epoch in (0, 3):
        batch = _epoch(loader, epoch)[0]
        assert batch["mask_counts"].max() == 2 + epoch
        assert batch["masks"].shape[1] == 2 + epoch
    a, b = _epoch(loader, 0)[0], _epoch(loader, 1)[0]
    assert not torch.equal(a["areas"][:, :2], b["areas"][:, :2]), "another epoch samples other masks"


def test_validate_first_batch_and_check_batch(sa1b_dataset):
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=0, **SMALL)
    batch = validate_first_batch(loader)
    options = Sa1bOptions(**SMALL)
    assert Sa1b(options).check(batch, 0) == []
    broken = dict(batch, boxes=batch["boxes"].clone())
    broken["boxes"][0, 0, 0] = float("nan")
    assert any("NaN" in p for p in Sa1b(options).check(broken, 0))
    broken = dict(batch, boxes=batch["boxes"] + 1000)
    assert any("boxes" in p for p in Sa1b(options).check(broken, 0))
    broken = dict(batch, mask_counts=batch["mask_counts"] + 10)
    assert any("mask_counts" in p for p in Sa1b(options).check(broken, 0))
    assert Sa1b(Sa1bOptions(**PADDED)).check(_with_a_padding_mask_set(sa1b_dataset), 0) == [
        "masks: non-zero padding beyond mask_counts"]
    broken = dict(batch, images=batch["images"].float())
    assert any("dtype" in p for p in Sa1b(options).check(broken, 0))
    broken = dict(batch, predicted_ious=batch["predicted_ious"] + 2)
    assert any("[0, 1]" in p for p in Sa1b(options).check(broken, 0))
    assert "keys" in Sa1b(options).check({"images": batch["images"]}, 0)[0]


PADDED = dict(image_size=64, mask_size=32, max_masks=30)  # (more than any sample's masks: each has all of its own)


def _with_a_padding_mask_set(root: str) -> dict:
    """The first batch (of 2, `PADDED`) with padding masks (a sample with fewer masks than the other),
    one pixel of its first padding mask set."""
    loader = make_stream_loader(root, "train", batch_size=2, num_workers=0, shuffle=False, **PADDED)
    for batch in _epoch(loader):
        counts = batch["mask_counts"].tolist()
        if min(counts) < batch["masks"].shape[1]:
            batch["masks"][counts.index(min(counts)), min(counts), 0, 0] = True
            return batch
    raise AssertionError("the dataset has no batch with padding masks")


@pytest.fixture()
def corrupted(sa1b_dataset, tmp_path) -> tuple[str, str, str]:
    """A copy of the dataset with one sample's annotation member damaged: (root, shard name, key)."""
    root = tmp_path / "corrupt"
    shutil.copytree(sa1b_dataset, root)
    shard, index = indexed(str(root))[0]
    data = bytearray((root / shard.name).read_bytes())
    key = index.key(1)
    start = index.span(1)[0]
    jpg_size = int(data[start + 124 : start + 136].rstrip(b"\0"), 8)
    ann = start + 512 + jpg_size + (-jpg_size % 512) + 512  # the msgpack member's data
    data[ann : ann + 8] = b"\xc1" * 8  # 0xc1 is never valid msgpack
    (root / shard.name).write_bytes(bytes(data))
    return str(root), shard.name, key


def test_on_error_raise_names_shard_and_key(corrupted):
    root, shard, key = corrupted
    loader = make_stream_loader(root, "train", batch_size=2, num_workers=2, shuffle=False, **SMALL)
    with pytest.raises(SampleError, match=rf"{shard}.*{key!r}.*msgpack"):
        _epoch(loader)


def test_on_error_skip_counts_and_goes_on(corrupted, sa1b_dataset, caplog):
    root, _, key = corrupted
    loader = make_stream_loader(root, "train", batch_size=2, num_workers=2, shuffle=False, on_error="skip", **SMALL)
    keys = [k for b in _epoch(loader) for k in b["keys"]]
    clean = [k for b in _epoch(make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=0, shuffle=False, **SMALL)) for k in b["keys"]]
    assert keys == [k for k in clean if k != key]
    assert loader.skipped == 1
    keys = [k for b in _epoch(loader, 1) for k in b["keys"]]
    assert keys == [k for k in clean if k != key] and loader.skipped == 2, "skipped again, and counted"


def test_missing_shard_is_named(sa1b_dataset, tmp_path):
    root = tmp_path / "missing"
    shutil.copytree(sa1b_dataset, root)
    name = _manifest(str(root)).splits["val"][0].name
    (root / name).unlink()
    with pytest.raises(ShardError, match=rf"{name}: sample .*: shard is missing"):
        _epoch(make_stream_loader(str(root), "val", batch_size=1, num_workers=0, **SMALL))


def test_spawned_workers(sa1b_dataset):
    a = _epoch(make_stream_loader(sa1b_dataset, "val", batch_size=2, num_workers=2, multiprocessing_context="spawn", **SMALL), 1)
    _same(a, _epoch(make_stream_loader(sa1b_dataset, "val", batch_size=2, num_workers=0, **SMALL), 1))


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("ahead", [False, True])
def test_no_worker_waits_out_the_first_batch_wait(sa1b_dataset, monkeypatch, workers, ahead):
    """Workers hold their read-ahead until the main process has the first batch (`FirstOut`);
    however the batches are taken, that wait ends by the release, never by its time bound (which
    would cost 10 s), in each iteration of persistent workers. `ahead`: the CUDA stage's order, the
    next batch taken before this one is given (here without a GPU)."""
    wait = FirstOut.wait

    def strict(self, ticket, timeout):  # (60 s: a bound on the wait for the release, not a measure of it)
        if not wait(self, ticket, 60.0):
            raise AssertionError("a worker waited out its bound: the first batch's gate was never released")
        return True

    def one_ahead(batches, device, finish):  # (prefetch_to_cuda's order)
        pending = None
        for batch in batches:
            if pending is not None:
                yield pending
            pending = finish(batch)
        if pending is not None:
            yield pending

    monkeypatch.setattr(FirstOut, "wait", strict)  # (forked workers inherit it)
    loader = make_stream_loader(sa1b_dataset, "val", batch_size=1, num_workers=workers, **SMALL)
    if ahead:
        monkeypatch.setattr(loader_module, "prefetch_to_cuda", one_ahead)
        loader.device = torch.device("cuda")
    reference = make_stream_loader(sa1b_dataset, "val", batch_size=1, num_workers=0, **SMALL)
    for epoch in (1, 2):  # (the workers persist: the second iteration waits on the flag again)
        _same(_epoch(loader, epoch), _epoch(reference, epoch))


def test_a_first_batch_taken_alone_does_not_hold_the_next_iteration(sa1b_dataset, monkeypatch, tmp_path):
    """`validate_first_batch` takes a first batch and leaves the iteration while its workers go on
    with it; a worker of that iteration that reaches its read-ahead gate after the next iteration
    began must not wait for the next iteration's first batch: the main process waits for that
    worker to begin the next iteration (`make demo`'s epoch 0 took 10.2 s instead of 0.1). The gate
    is checked late on purpose here; a wait that runs into its bound (the library's own) is an error."""
    waited, wait = tmp_path / "waited", FirstOut.wait

    def late(self, ticket, timeout):
        time.sleep(0.3)  # (the worker comes to the gate after the main process began the next iteration)
        if not wait(self, ticket, timeout):  # (it gave up: the first batch of its iteration never came out)
            waited.write_text(f"a worker waited out its bound for iteration {ticket}")
        return True

    monkeypatch.setattr(FirstOut, "wait", late)  # (forked workers inherit it)
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=2, **SMALL)
    validate_first_batch(loader)
    reference = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=0, **SMALL)
    for epoch in (0, 1):
        _same(_epoch(loader, epoch), _epoch(reference, epoch))
    assert not waited.exists(), waited.read_text()


def test_device_and_argument_errors(sa1b_dataset):
    loader = make_stream_loader(sa1b_dataset, "val", batch_size=2, num_workers=0, device="cpu", **SMALL)
    assert all(t.device.type == "cpu" for t in next(iter(loader)).values() if isinstance(t, torch.Tensor))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            make_stream_loader(sa1b_dataset, "val", batch_size=2, num_workers=0, device="cuda")
        with pytest.raises(ValueError, match="pin_memory"):
            make_stream_loader(sa1b_dataset, "val", batch_size=2, num_workers=0, pin_memory=True)
    with pytest.raises(ValueError, match="no split 'test'"):
        make_stream_loader(sa1b_dataset, "test", batch_size=2, num_workers=0)
    with pytest.raises(ValueError, match="too few for one batch"):
        make_stream_loader(sa1b_dataset, "val", batch_size=100, num_workers=0)
    with pytest.raises(ValueError, match="on_error"):
        make_stream_loader(sa1b_dataset, "val", batch_size=2, num_workers=0, on_error="ignore")
    with pytest.raises(ValueError, match="mask_size"):
        make_stream_loader(sa1b_dataset, "val", batch_size=2, num_workers=0, mask_size=0)
    with pytest.raises(ValueError, match="epoch"):
        make_stream_loader(sa1b_dataset, "val", batch_size=2, num_workers=0).set_epoch(-1)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # (none from a half-made DataLoader)
def test_misused_arguments_are_refused_by_name(sa1b_dataset):
    def make(**kwargs):
        return make_stream_loader(sa1b_dataset, "val", **{"batch_size": 2, "num_workers": 0, **SMALL, **kwargs})

    for given in (dict(world_size=2), dict(rank=1), dict(rank=None, world_size=1)):
        with pytest.raises(ValueError, match="rank and world_size go together"):
            make(**given)
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        make(rank=0, world_size=0)
    with pytest.raises(ValueError, match="rank 2 not in"):
        make(rank=2, world_size=2)
    for factor in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"prefetch_factor must be an int >= 1.*got {factor!r}"):
            make(num_workers=2, prefetch_factor=factor)
    loader = make()
    for epoch in (True, False, -1, 1.0):
        with pytest.raises(ValueError, match="epoch must be an int >= 0"):
            loader.set_epoch(epoch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_are_on_the_device(sa1b_dataset):
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=2, device="cuda", **SMALL)
    cpu = _epoch(make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=0, **SMALL))
    got = _epoch(loader)
    assert all(t.is_cuda for b in got for t in b.values() if isinstance(t, torch.Tensor))
    _same([{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in got], cpu)


def test_a_batch_with_no_good_sample_is_an_error_even_when_skipping(corrupted):
    root, _, key = corrupted
    loader = make_stream_loader(root, "train", batch_size=1, num_workers=2, shuffle=False, on_error="skip", **SMALL)
    with pytest.raises(ShardError, match="all 1 samples of batch 1 failed"):
        _epoch(loader)


@pytest.mark.skipif(not os.path.isdir("/proc/self") or not os.path.isdir("/dev/shm"), reason="Linux")
def test_a_worker_killed_is_a_clear_error_and_leaves_nothing_behind(sa1b_dataset):
    shm = set(os.listdir("/dev/shm"))
    others = children(os.getpid())
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=1, num_workers=2, **SMALL)
    batches = iter(loader)
    next(batches)
    workers = children(os.getpid()) - others
    assert len(workers) == 2
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pids?\(?s?\)? [\d, ]+\) (is killed by signal|exited "
                                           r"unexpectedly)") as excinfo:
        os.kill(min(workers), signal.SIGKILL)
        while alive(min(workers)):
            time.sleep(0.01)
        time.sleep(1)  # (torch tells of a worker's death at the SIGCHLD, wherever the training loop is then)
        for _ in batches:
            pass
    del excinfo, batches, loader  # (its traceback holds the DataLoader's iterator, whose workers torch still watches)
    gc.collect()
    left = [n for n in set(os.listdir("/dev/shm")) - shm if any(f"_{pid}_" in n for pid in workers | {os.getpid()})]
    assert left == [], "shared memory of the batches"
    _same(_epoch(make_stream_loader(sa1b_dataset, "train", batch_size=1, num_workers=2, **SMALL)),
          _epoch(make_stream_loader(sa1b_dataset, "train", batch_size=1, num_workers=0, **SMALL)))


def test_an_iterator_left_open_at_exit_says_nothing(sa1b_dataset):
    """A script that stops iterating (num_workers=0) and exits prints no shutdown traceback."""
    script = ("import sys; from pipeline import make_stream_loader\n"
              f"it = iter(make_stream_loader({sa1b_dataset!r}, 'train', batch_size=2, image_size=64, mask_size=32))\n"
              "next(it)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_close_ends_the_workers_and_the_loader_goes_on(sa1b_dataset):
    import multiprocessing

    before = set(multiprocessing.active_children())
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, num_workers=2, image_size=32, mask_size=8,
                                max_masks=2)
    first = [b["keys"] for b in loader]
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == 2, "persistent workers"
    batches = iter(loader)
    next(batches)
    loader.close()
    assert not workers & set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="no longer valid"):
        next(batches)
    assert [b["keys"] for b in loader] == first
    loader.close()
    loader.close()
