"""pipeline.images as a module: decoding at the batch's size, the draft scale, modes, the pixel cap,
and Qwen2-VL's pixel budget (`smart_resize`, against transformers' own)."""

from __future__ import annotations

import io
import itertools
import math

import hypothesis
import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from PIL import Image

from pipeline.errors import SampleError
from pipeline.images import MAX_IMAGE_PIXELS, decode_image, draft_scale, open_image, smart_resize, to_rgb


def _encoded(array: np.ndarray, fmt: str = "JPEG") -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt)
    return out.getvalue()


GRADIENT = np.stack([*np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(192, dtype=np.uint8)),
                     np.full((192, 256), 90, np.uint8)], axis=-1)  # (192, 256, 3)


def test_decode_as_stored_and_at_a_reduced_frame():
    data = _encoded(GRADIENT)
    full = decode_image(data, None, "u", "k")
    assert full.dtype == torch.uint8 and full.shape == (3, 192, 256)
    small = decode_image(data, (48, 64), "u", "k")  # JPEG decoded at 1/4 scale: no resize left
    assert small.shape == (3, 48, 64)
    odd = decode_image(data, (30, 40), "u", "k")
    assert odd.shape == (3, 30, 40)
    reference = full.float()[None]
    expected = torch.nn.functional.interpolate(reference, size=(30, 40), mode="area")[0]
    assert (odd.float() - expected).abs().mean() < 4  # the same picture, smaller


def test_grayscale_palette_and_16_bit_become_rgb():
    gray = np.arange(64 * 48, dtype=np.uint32).reshape(48, 64) % 256
    for data in (_encoded(gray.astype(np.uint8), "PNG"), _encoded((gray * 257).astype(np.uint16), "PNG")):
        image = decode_image(data, None, "u", "k", formats=("PNG",), field="png")
        assert image.shape == (3, 48, 64) and torch.equal(image[0], image[2])
        assert torch.equal(image[0], torch.from_numpy(gray.astype(np.uint8)))
    with Image.open(io.BytesIO(_encoded(GRADIENT, "PNG"))) as image:
        assert np.array_equal(to_rgb(image.convert("P").convert("RGB")), to_rgb(image.convert("P")))


def test_the_pixel_cap_refuses_before_decoding():
    data = _encoded(GRADIENT)
    with pytest.raises(SampleError, match=r"u: sample 'k', field 'jpg': 256x192 pixels exceed the cap 1000"):
        decode_image(data, (10, 10), "u", "k", max_pixels=1000)
    assert decode_image(data, (10, 10), "u", "k", max_pixels=256 * 192).shape == (3, 10, 10)
    assert MAX_IMAGE_PIXELS >= 1 << 24


def test_refusals_name_the_sample_and_field():
    with pytest.raises(SampleError, match="field 'jpg': cannot decode JPEG"):
        decode_image(b"not an image", None, "u", "k")
    with pytest.raises(SampleError, match="cannot decode JPEG"):
        decode_image(_encoded(GRADIENT, "PNG"), None, "u", "k")  # a PNG where a JPEG must be
    with pytest.raises(SampleError, match="image is 192x256, the record says 10x10"):
        decode_image(_encoded(GRADIENT), None, "u", "k", size=(10, 10))
    with pytest.raises(SampleError):
        decode_image(_encoded(GRADIENT)[:300], None, "u", "k")  # truncated
    with pytest.raises(SampleError, match="field 'img'"):
        open_image(b"", ("PNG",), "u", "k", "img")


@pytest.mark.parametrize("subsampling", [0, 1, 2])
@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_jpegs_decode_to_pillows_pixels_at_every_draft_scale(subsampling, progressive, mode):
    photo = Image.fromarray(np.asarray(Image.fromarray(GRADIENT).resize((457, 301))) ^ np.uint8(0x5A)).convert(mode)
    out = io.BytesIO()
    photo.save(out, format="JPEG", quality=90, subsampling=subsampling, progressive=progressive)
    data = out.getvalue()
    for frame in [None, (301, 457), (151, 229), (100, 152), (60, 91), (37, 57), (20, 30), (400, 607)]:
        with Image.open(io.BytesIO(data)) as image:  # Pillow's own reduced decode, then the same resize
            if frame is not None:
                image.draft("RGB", (frame[1], frame[0]))
            expected = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
        if frame is not None and expected.shape[1:] != frame:
            expected = torch.nn.functional.interpolate(expected[None], size=frame, mode="bilinear", antialias=True,
                                                       align_corners=False)[0]
        for given in (data, memoryview(bytearray(data))):
            assert torch.equal(decode_image(given, frame, "u", "k"), expected), frame


def test_a_cmyk_jpeg_is_converted_as_pillow_converts_it():
    out = io.BytesIO()
    Image.fromarray(GRADIENT).convert("CMYK").save(out, format="JPEG")
    with Image.open(io.BytesIO(out.getvalue())) as image:
        expected = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
    assert torch.equal(decode_image(out.getvalue(), None, "u", "k"), expected)


def test_a_jpeg_libjpeg_turbo_refuses_is_decoded_or_refused_as_pillow_does():
    """Packing checks JPEGs with Pillow, so the loader takes what Pillow takes: a scan with damage
    libjpeg only warns about decodes to Pillow's pixels; a truncated one is refused by name."""
    data = bytearray(_encoded(GRADIENT))
    data[len(data) // 2 : len(data) // 2 + 64] = b"\xff\xd9" * 32  # end-of-image markers inside the scan
    with Image.open(io.BytesIO(bytes(data))) as image:
        image.draft("RGB", (64, 48))
        expected = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
    assert torch.equal(decode_image(bytes(data), (48, 64), "u", "k"), expected)
    with pytest.raises(SampleError, match=r"u: sample 'k', field 'jpg': cannot decode JPEG: image file is truncated"):
        decode_image(_encoded(GRADIENT)[:-100], (48, 64), "u", "k")


# -- the draft scale and the pixel budget ----------------------------------------------------------


def test_the_draft_scale_is_the_smallest_decode_that_covers_the_frame():
    """The scale decodes to at least the frame in both dims (libjpeg rounds up: ceil(n / s)), from
    whole multiples of it as Pillow's `draft` asks; the next smaller decode (2s) would not."""
    sizes = [1, 2, 7, 8, 15, 16, 17, 31, 56, 57, 100, 224, 301, 457, 1000, 1024, 4095]
    for (h, w), (fh, fw) in itertools.product(itertools.product(sizes, repeat=2), itertools.product(sizes, repeat=2)):
        s = draft_scale(h, w, (fh, fw))
        assert s in (1, 2, 4, 8)
        if fh <= h and fw <= w:
            assert math.ceil(h / s) >= fh and math.ceil(w / s) >= fw, (h, w, fh, fw, s)
        assert s == 1 or (s * fh <= h and s * fw <= w), "a larger frame than the image: decoded in full"
        assert s == 8 or 2 * s * fh > h or 2 * s * fw > w, (h, w, fh, fw, s)


def test_the_draft_scale_is_the_one_pillow_draft_decodes_at():
    data = _encoded(np.asarray(Image.fromarray(GRADIENT).resize((457, 301))))
    for frame in [(301, 457), (151, 229), (150, 228), (76, 115), (75, 114), (38, 58), (37, 57), (20, 30), (1, 1)]:
        s = draft_scale(301, 457, frame)
        with Image.open(io.BytesIO(data)) as image:
            image.draft("RGB", (frame[1], frame[0]))
            assert (image.height, image.width) == (math.ceil(301 / s), math.ceil(457 / s)), frame


def _reference():
    pytest.importorskip("transformers")
    # (the module beside it, image_processing_qwen2_vl, needs torchvision; the function is the same)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    return reference


BUDGETS = [(28, 56 * 56, 28 * 28 * 1280), (28, 256 * 28 * 28, 1280 * 28 * 28), (14, 4 * 14 * 14, 64 * 14 * 14),
           (32, 32 * 32, 32 * 32 * 16), (1, 1, 10_000), (7, 3000, 3000), (28, 1, 28 * 28)]


def test_smart_resize_equals_transformers_on_a_grid_of_shapes_and_budgets():
    reference = _reference()
    sides = [1, 2, 3, 13, 14, 27, 28, 29, 41, 42, 55, 56, 57, 99, 100, 111, 224, 335, 448, 480, 640, 999, 1000,
             1080, 1920, 2047, 4000, 12345, 30000]
    shapes = [(h, w) for h, w in itertools.product(sides, repeat=2) if max(h, w) / min(h, w) <= 200]
    shapes += [(n, n * 200) for n in (1, 2, 3, 7, 50)] + [(n * 200, n) for n in (1, 5)]  # the aspect limit itself
    shapes += [(n, n * 200 - 1) for n in (2, 3, 150)] + [(150, 29_999), (15_000, 75)]
    for (h, w), budget in itertools.product(shapes, BUDGETS):
        assert smart_resize(h, w, *budget) == reference(h, w, *budget), (h, w, budget)
    assert smart_resize(480, 640) == reference(480, 640), "the defaults are Qwen2-VL's"
    for h, w in [(1, 201), (201, 1), (2, 403), (100, 20_001), (1, 30_000)]:
        with pytest.raises(ValueError, match="aspect ratio"):
            reference(h, w)
        with pytest.raises(ValueError, match=r"aspect ratio \S+ is over 200"):
            smart_resize(h, w)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.integers(1, 40_000), st.integers(1, 40_000), st.sampled_from(BUDGETS))
def test_smart_resize_equals_transformers_for_any_shape(h, w, budget):
    reference = _reference()
    try:
        want = reference(h, w, *budget)
    except ValueError:
        with pytest.raises(ValueError):
            smart_resize(h, w, *budget)
        return
    assert smart_resize(h, w, *budget) == want
    factor = budget[0]
    assert want[0] % factor == 0 and want[1] % factor == 0 and min(want) >= factor
