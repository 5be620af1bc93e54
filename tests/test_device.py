"""pipeline.device's pixel work, on CPU tensors: masks rasterised from their runs equal pycocotools' decode
sampled by the CPU path's rules and the CPU path's bit-packed raster (`rle.bits_at`), bit for bit, for
plain frames, jitter crops and flips; images placed in their canvas are within a mean absolute
difference of 1 level of the CPU path's decoder at full scale, resized, cropped and mirrored the same
way (exactly: the same resize), and CUDA's float32 resize within 1 level of it. With CUDA
(bench/gpu_check.sh), the same on the GPU against the CPU."""

from __future__ import annotations

import io

import numpy as np
import pytest
import skimage.data
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from pycocotools import mask as mask_utils

from pipeline.device import Placement, decode_jpegs, place, resized, run_raster
from pipeline.errors import SampleError
from pipeline.images import decode_image
from pipeline.rle import affine_index, bits_at, nearest_index, parse

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.sh runs it)")


def _masks(rng: np.random.Generator, height: int, width: int, k: int, style: str) -> np.ndarray:
    """(H, W, k) uint8 masks: noise of a random density, ellipses, or all empty / all full."""
    if style == "noise":
        return (rng.random((height, width, k)) < rng.random()).astype(np.uint8)
    if style in ("empty", "full"):
        return np.full((height, width, k), style == "full", np.uint8)
    yy, xx = np.mgrid[:height, :width]
    masks = np.zeros((height, width, k), np.uint8)
    for i in range(k):
        cy, cx, ry, rx = rng.integers(0, height), rng.integers(0, width), rng.integers(1, height + 1), \
            rng.integers(1, width + 1)
        masks[..., i] = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1
    return masks


def _indices(rng: np.random.Generator, src: int, out: int, jitter: bool) -> np.ndarray:
    """Source indices of `out` output pixels: the plain frame's rule, or a jitter crop's (a scale, an
    offset into the scaled image, a step of image pixels per mask pixel), as `sa1b_augment.view_of` uses."""
    if not jitter:
        return nearest_index(src, out)
    scaled = int(rng.integers(1, 4 * src + 1))
    offset = int(rng.integers(0, max(scaled - out, 0) + 1))
    return affine_index(src, scaled, offset, (int(rng.integers(1, 5)), int(rng.integers(1, 5))), out)


def _runs(strings: list[bytes], size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, object]:
    parsed = parse(strings, size)
    return torch.from_numpy(parsed.runs.astype(np.int32)), torch.from_numpy(parsed.runs_per), parsed


@settings(max_examples=300, deadline=None)
@given(height=st.integers(1, 60), width=st.integers(1, 60), k=st.integers(1, 5), out_h=st.integers(1, 80),
       out_w=st.integers(1, 80), style=st.sampled_from(["noise", "blobs", "empty", "full"]),
       jitter=st.booleans(), mirrored=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_masks_equal_pycocotools_and_the_cpu_raster(height, width, k, out_h, out_w, style, jitter, mirrored, seed):
    rng = np.random.default_rng(seed)
    masks = _masks(rng, height, width, k, style)
    rles = mask_utils.encode(np.asfortranarray(masks))
    ys, xs = _indices(rng, height, out_h, jitter), _indices(rng, width, out_w, jitter)
    runs, runs_per, parsed = _runs([r["counts"] for r in rles], (height, width))
    got = run_raster(runs, runs_per, (height, width), torch.from_numpy(ys), torch.from_numpy(xs), mirrored)
    full = mask_utils.decode(rles).transpose(2, 0, 1)[:, ys][:, :, xs]
    want = full[..., ::-1] if mirrored else full
    assert got.dtype == torch.bool and got.shape == (k, len(ys), len(xs))
    assert np.array_equal(got.numpy(), want.astype(bool))
    packed = bits_at(parsed, ys, xs, mirrored=mirrored)  # the CPU path's masks, as they travel
    assert np.array_equal(np.packbits(got.numpy(), axis=-1), packed)


def test_no_masks_and_empty_frames():
    none = torch.zeros(0, dtype=torch.int64)
    assert run_raster(none, none, (5, 7), torch.arange(3), torch.arange(4)).shape == (0, 3, 4)
    runs, runs_per, _ = _runs([mask_utils.encode(np.asfortranarray(np.ones((5, 7, 1), np.uint8)))[0]["counts"]], (5, 7))
    assert run_raster(runs, runs_per, (5, 7), torch.arange(0), torch.arange(4)).shape == (1, 0, 4)


def _jpeg(pixels: np.ndarray, **save) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90, **save)
    return out.getvalue()


PHOTOS = {"astronaut": skimage.data.astronaut(), "coffee": skimage.data.coffee(), "chelsea": skimage.data.chelsea(),
          "camera": skimage.data.camera()}  # (camera: grayscale)


def _reference(jpg: bytes, placement: Placement, size: int) -> torch.Tensor:
    """The CPU path's decoder at full scale, then its resize (torch's uint8 antialiased kernel), the crop
    and the flip, zero-padded to (3, size, size)."""
    pixels = decode_image(jpg, None, "u", "k")
    if tuple(pixels.shape[1:]) != placement.scaled:
        pixels = F.interpolate(pixels[None], size=placement.scaled, mode="bilinear", antialias=True)[0]
    (oy, ox), (h, w) = placement.offset, placement.content
    content = pixels[:, oy : oy + h, ox : ox + w]
    out = torch.zeros((3, size, size), dtype=torch.uint8)
    out[:, :h, :w] = content.flip(-1) if placement.mirrored else content
    return out


def _placements(rng: np.random.Generator, height: int, width: int, size: int) -> list[Placement]:
    """The longest side to `size` as stored, upscaled and downscaled (scale jitter: cropped from a drawn
    offset where larger), square, and a picture already at its frame; each plain and mirrored."""
    found = []
    for scale in (1.0, 0.3, 2.5, None, "stored"):
        if scale == "stored":
            scaled = (height, width)
        elif scale is None:
            scaled = (size, size)
        else:
            long = round(scale * size)
            scaled = (max(1, round(height * long / max(height, width))), max(1, round(width * long / max(height, width))))
        offset = tuple(int(rng.integers(0, max(s - size, 0) + 1)) for s in scaled)
        content = tuple(min(s - o, size) for s, o in zip(scaled, offset))
        found += [Placement(scaled, offset, content, mirrored) for mirrored in (False, True)]
    return found


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_images_are_the_cpu_decoders_at_full_scale_resized(name):
    jpg, size, rng = _jpeg(PHOTOS[name]), 160, np.random.default_rng(3)
    height, width = PHOTOS[name].shape[:2]
    (pixels,) = decode_jpegs([torch.frombuffer(bytearray(jpg), dtype=torch.uint8)], torch.device("cpu"), [("u", "k")])
    assert pixels.shape == (3, height, width) and pixels.dtype == torch.uint8
    for placement in _placements(rng, height, width, size):
        out = torch.full((3, size, size), 7, dtype=torch.uint8)  # (a recycled buffer: the padding is written)
        place(pixels, placement, out)
        want = _reference(jpg, placement, size)
        (h, w) = placement.content
        assert not out[:, h:].any() and not out[:, :h, w:].any()
        assert torch.equal(out, want), placement  # (on the CPU: the CPU path's resize, its uint8 kernel)


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_the_cuda_resize_in_float_is_within_a_level_of_the_cpu_paths(name):
    pixels, rng = decode_image(_jpeg(PHOTOS[name]), None, "u", "k"), np.random.default_rng(4)
    for placement in _placements(rng, *pixels.shape[1:], 160):
        want = resized(pixels, placement.scaled)
        got = resized(pixels, placement.scaled, in_float=True)
        assert got.dtype == torch.uint8 and got.shape == want.shape
        assert (got.float() - want.float()).abs().mean() <= 1.0 and (got.int() - want.int()).abs().max() <= 1


def test_a_corrupt_jpeg_names_its_sample():
    jpg = _jpeg(PHOTOS["coffee"])
    for bad in (jpg[: len(jpg) // 3], b"not a jpeg"):
        data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in (jpg, bad)]
        with pytest.raises(SampleError) as caught:
            decode_jpegs(data, torch.device("cpu"), [("a.tar", "one"), ("b.tar", "two")])
        assert (caught.value.url, caught.value.key, caught.value.field) == ("b.tar", "two", "jpg")


@CUDA
def test_on_cuda_the_same_masks_and_images_within_a_level():
    rng = np.random.default_rng(9)
    masks = _masks(rng, 300, 451, 16, "blobs")
    runs, runs_per, _ = _runs([r["counts"] for r in mask_utils.encode(np.asfortranarray(masks))], (300, 451))
    ys, xs = torch.from_numpy(nearest_index(300, 170)), torch.from_numpy(nearest_index(451, 256))
    cpu = run_raster(runs, runs_per, (300, 451), ys, xs)
    gpu = run_raster(runs.cuda(), runs_per.cuda(), (300, 451), ys.cuda(), xs.cuda())
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
    data = [torch.frombuffer(bytearray(_jpeg(p)), dtype=torch.uint8) for p in PHOTOS.values()]
    where = [("u", name) for name in PHOTOS]
    cmyk = io.BytesIO()  # (nvJPEG may refuse it: then the CPU decodes it)
    Image.fromarray(PHOTOS["coffee"]).convert("CMYK").save(cmyk, "JPEG", quality=90)
    data.append(torch.frombuffer(bytearray(cmyk.getvalue()), dtype=torch.uint8))
    where.append(("u", "cmyk"))
    for on_cpu, on_gpu in zip(decode_jpegs(data, torch.device("cpu"), where),
                              decode_jpegs(data, torch.device("cuda"), where), strict=True):
        assert on_gpu.is_cuda and on_gpu.shape == on_cpu.shape
        assert (on_gpu.cpu().float() - on_cpu.float()).abs().mean() <= 1.0
    broken = torch.frombuffer(bytearray(_jpeg(PHOTOS["chelsea"])[:3000]), dtype=torch.uint8)
    with pytest.raises(SampleError) as caught:  # (the batch's call fails; each alone; the CPU names it)
        decode_jpegs([data[0], broken], torch.device("cuda"), [("a.tar", "one"), ("b.tar", "two")])
    assert (caught.value.url, caught.value.key) == ("b.tar", "two")
