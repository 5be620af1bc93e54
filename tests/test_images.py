"""pipeline.images as a module: decoding at the batch's size, modes, and the pixel cap."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.errors import SampleError
from pipeline.images import MAX_IMAGE_PIXELS, decode_image, open_image, to_rgb


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
