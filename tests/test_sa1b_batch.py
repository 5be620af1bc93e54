"""pipeline.kinds.sa1b_batch: with `decode_device`, batches whose pixels the loader's device stage makes
from JPEG bytes and mask runs are the CPU path's batches: the same keys, dtypes and shapes, masks bit for
bit, boxes, points, prompts and every other field identical, images those of the CPU path decoded at
full scale then resized the same way (exactly on the CPU; on CUDA within a mean absolute difference of
1 level); for plain frames, square frames, jitter crops and flips, repeated masks and prompts. A
corrupt JPEG names its sample."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pipeline.images
from pipeline import make_stream_loader, make_stream_dataset
from pipeline.errors import ConfigError, SampleError
from pipeline.format import SA1B_ANN, SA1B_JPG
from pipeline.kinds.sa1b import Sa1b, Sa1bOptions
from conftest import batches_of

BASE = dict(batch_size=3, seed=11, drop_last=False, image_size=80, mask_size=32, max_masks=6)
CASES = {
    "plain": {},
    "prompts": dict(points_per_mask=3, box_noise=0.1, fill_masks=True, max_masks=9),
    "square": dict(resize="square", points_per_mask=2),
    "jitter-flip": dict(scale_jitter=(0.3, 2.5), hflip=0.5, points_per_mask=2, box_noise=0.1),
    "masks-finer": dict(mask_size=112, hflip=1.0),
    "masks-at-image-frame": dict(mask_size=None, scale_jitter=(0.5, 1.5)),
}


def _batches(root: str, workers: int = 0, epoch: int = 1, **options) -> list[dict]:
    return batches_of(make_stream_loader(root, "train", **{**BASE, "num_workers": workers, **options}), epoch)


def _same_but_images(cpu: list[dict], device: list[dict]) -> None:
    assert len(cpu) == len(device)
    for a, b in zip(cpu, device):
        assert set(a) == set(b)
        for name, value in a.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == b[name].dtype and value.shape == b[name].shape, name
                assert name == "images" or torch.equal(value, b[name]), name
            else:
                assert value == b[name], name


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_cpu_paths_batch_its_images_as_decoded_at_full_scale(sa1b_dataset, monkeypatch, case):
    options = CASES[case]
    device = _batches(sa1b_dataset, decode_device="cpu", **options)
    monkeypatch.setattr(pipeline.images, "draft_scale", lambda *_: 1)  # the CPU path at full scale, then resized
    cpu = _batches(sa1b_dataset, **options)
    _same_but_images(cpu, device)
    kind = make_stream_loader(sa1b_dataset, "train", **{**BASE, **options}, decode_device="cpu").kind
    for a, b in zip(cpu, device):
        assert kind.check(b, 1) == []
        assert torch.equal(a["images"], b["images"])  # (on the CPU the same decoder and resize: exactly)
        for i, (h, w) in enumerate(b["image_sizes"].tolist()):  # (the padding is zeros)
            assert not b["images"][i, :, h:].any() and not b["images"][i, :, :h, w:].any()


def test_the_same_batches_through_workers_and_from_make_stream_dataset(sa1b_dataset):
    options = dict(decode_device="cpu", **CASES["jitter-flip"])
    alone = _batches(sa1b_dataset, **options)
    _same_but_images(alone, _batches(sa1b_dataset, workers=2, **options))
    dataset = make_stream_dataset(sa1b_dataset, "train", **BASE, **options)
    dataset.set_epoch(1)
    finished = list(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1))
    _same_but_images(alone, finished)


def test_resume_equals_uninterrupted_and_the_state_names_the_decode_device(sa1b_dataset):
    options = {**BASE, "decode_device": "cpu", **CASES["jitter-flip"]}
    full = _batches(sa1b_dataset, **options)
    first = make_stream_loader(sa1b_dataset, "train", **options, num_workers=2)
    assert [b["keys"] for b in batches_of(first, 1, stop=1)] == [full[0]["keys"]]
    state = first.state_dict()
    resumed = make_stream_loader(sa1b_dataset, "train", **options, num_workers=2)
    resumed.load_state_dict(state)
    rest = batches_of(resumed, 1)
    _same_but_images(full[1:], rest)
    assert all(torch.equal(a["images"], b["images"]) for a, b in zip(full[1:], rest))
    with pytest.raises(ConfigError, match="decode_device: 'cpu' there, None here"):  # (decoders' pixels differ)
        make_stream_loader(sa1b_dataset, "train", **{**options, "decode_device": None}).load_state_dict(state)


def _decoded(sample: tuple, members: dict, **options) -> dict:
    key = sample[0]
    kind = Sa1b(Sa1bOptions(image_size=80, mask_size=32, decode_device="cpu", **options))
    decoded = kind.decode(members, seed=1, epoch=0, url="shard-0.tar", key=key)
    return kind.finish(kind.collate([decoded], 0))


def test_a_corrupt_jpeg_names_its_sample_in_the_worker_or_the_device_stage(sa1b_sample):
    key, _, jpg, ann = sa1b_sample
    assert _decoded(sa1b_sample, {SA1B_JPG: jpg, SA1B_ANN: ann})["keys"] == [key]
    with pytest.raises(SampleError) as caught:  # (its header: refused in the worker, as the CPU path refuses it)
        _decoded(sa1b_sample, {SA1B_JPG: b"\xff\xd8\xff" + b"\0" * 40, SA1B_ANN: ann})
    assert (caught.value.url, caught.value.key, caught.value.field) == ("shard-0.tar", key, "jpg")
    with pytest.raises(SampleError) as caught:  # (cut short: its header passes, the decoder refuses the rest)
        _decoded(sa1b_sample, {SA1B_JPG: jpg[: len(jpg) // 2], SA1B_ANN: ann})
    assert (caught.value.url, caught.value.key, caught.value.field) == ("shard-0.tar", key, "jpg")


@pytest.mark.parametrize("bad", ["tpu", "", 0, torch.device("cpu"), "cuda:x"])
def test_decode_device_is_validated(bad):
    with pytest.raises(ConfigError, match="decode_device must be None"):
        Sa1bOptions(decode_device=bad)
    with pytest.raises(ConfigError, match="max_image_pixels must be under 2"):
        Sa1bOptions(decode_device="cpu", max_image_pixels=1 << 31)
    assert Sa1bOptions(max_image_pixels=1 << 31).decode_device is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
def test_decode_device_cuda_without_a_gpu_says_so():
    with pytest.raises(ConfigError, match="decode_device='cuda' but CUDA is not available"):
        Sa1bOptions(decode_device="cuda")


def test_decode_device_changes_no_option_outputs_depend_on(sa1b_dataset):
    kind = make_stream_loader(sa1b_dataset, "train", **BASE).kind
    other = dataclasses.replace(kind, options=dataclasses.replace(kind.options, decode_device="cpu"))
    for inputs in (None, frozenset({"images"}), frozenset({"masks"})):
        assert "decode_device" not in kind.depends(inputs)[1]
        assert kind.depends(inputs) == other.depends(inputs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.sh runs it)")
@pytest.mark.parametrize("case", sorted(CASES))
def test_on_cuda_the_cpu_paths_batch_on_the_gpu(sa1b_dataset, case):
    cpu = _batches(sa1b_dataset, decode_device="cpu", **CASES[case])
    gpu = _batches(sa1b_dataset, workers=2, device="cuda", decode_device="cuda", **CASES[case])
    assert all(v.is_cuda for b in gpu for v in b.values() if isinstance(v, torch.Tensor))
    gpu = [{n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in b.items()} for b in gpu]
    _same_but_images(cpu, gpu)
    for a, b in zip(cpu, gpu):
        assert (a["images"].float() - b["images"].float()).abs().mean(dim=(1, 2, 3)).max() <= 1.0
