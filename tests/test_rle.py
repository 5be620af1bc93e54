"""pipeline.rle: the raster (bool, and bit-packed) equals pycocotools' full decode followed by the same
nearest sampling; the pixels picked from the runs are pycocotools' foreground pixels."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pycocotools import mask as mask_utils

from pipeline.rle import (RLEError, affine_index, areas, bits_at, check, crop, fit, foreground_pixels, nearest_index,
                          parse, raster, raster_bits, tight_boxes)


def _nearest(src: int, dst: int) -> np.ndarray:
    """The source pixel under each of `dst` output pixels' centers, floor((i + 1/2) x src / dst), in exact fractions."""
    return np.array([math.floor((i + Fraction(1, 2)) * src / dst) for i in range(dst)], dtype=np.int64)


def _reference(masks: np.ndarray, out: tuple[int, int]) -> tuple[list[bytes], np.ndarray]:
    """(H, W, k) uint8 masks -> their COCO strings and pycocotools' decode sampled at `out`."""
    rles = mask_utils.encode(np.asfortranarray(masks))
    full = mask_utils.decode(rles)
    ys, xs = _nearest(masks.shape[0], out[0]), _nearest(masks.shape[1], out[1])
    return [r["counts"] for r in rles], full[ys][:, xs].transpose(2, 0, 1).astype(bool)


def _blobs(rng: np.random.Generator, height: int, width: int, k: int) -> np.ndarray:
    yy, xx = np.mgrid[:height, :width]
    masks = np.zeros((height, width, k), np.uint8)
    for i in range(k):
        cy, cx = rng.integers(0, height), rng.integers(0, width)
        ry, rx = rng.integers(1, height + 1), rng.integers(1, width + 1)
        masks[..., i] = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1
    return masks


@settings(max_examples=300, deadline=None)
@given(
    height=st.integers(1, 70), width=st.integers(1, 70), k=st.integers(1, 4),
    out_h=st.integers(1, 90), out_w=st.integers(1, 90),
    density=st.floats(0, 1), style=st.sampled_from(["noise", "blobs", "empty", "full", "pixel"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_raster_equals_pycocotools(height, width, k, out_h, out_w, density, style, seed):
    rng = np.random.default_rng(seed)
    if style == "noise":
        masks = (rng.random((height, width, k)) < density).astype(np.uint8)
    elif style == "blobs":
        masks = _blobs(rng, height, width, k)
    else:
        masks = np.full((height, width, k), style == "full", np.uint8)
        if style == "pixel":  # single-pixel runs at random places, including the corners
            masks[rng.integers(0, height), rng.integers(0, width)] = 1
            masks[0, 0, 0] = masks[-1, -1, -1] = 1
    strings, expected = _reference(masks, (out_h, out_w))
    got = raster(strings, (height, width), (out_h, out_w))
    assert got.dtype == bool and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    bits = raster_bits(strings, (height, width), (out_h, out_w))  # (widths not a multiple of 8, upsampling)
    assert bits.dtype == np.uint8 and bits.flags.c_contiguous
    np.testing.assert_array_equal(bits, np.packbits(expected, axis=-1))


def _affine(src: int, scaled: int, offset: int, step: tuple[int, int], count: int) -> list[int]:
    """`affine_index` by exact fractions, one position at a time."""
    found = [math.floor(((i + Fraction(1, 2)) * Fraction(*step) + offset) * src / scaled) for i in range(count)]
    return [j for j in found if j < src]


@settings(max_examples=300, deadline=None)
@given(height=st.integers(1, 60), width=st.integers(1, 60), scaled=st.tuples(st.integers(1, 120), st.integers(1, 120)),
       offset=st.tuples(st.integers(0, 60), st.integers(0, 60)), step=st.tuples(st.integers(1, 5), st.integers(1, 5)),
       count=st.integers(1, 70), k=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_bits_at_affine_index_equals_pycocotools_warped(height, width, scaled, offset, step, count, k, seed):
    ys = affine_index(height, scaled[0], offset[0], step, count)
    xs = affine_index(width, scaled[1], offset[1], step, count)
    assert ys.tolist() == _affine(height, scaled[0], offset[0], step, count)
    assert xs.tolist() == _affine(width, scaled[1], offset[1], step, count)
    masks = _blobs(np.random.default_rng(seed), height, width, k)
    rles = mask_utils.encode(np.asfortranarray(masks))
    full = mask_utils.decode(rles).transpose(2, 0, 1).astype(bool)
    parsed = parse([r["counts"] for r in rles], (height, width))
    np.testing.assert_array_equal(bits_at(parsed, ys, xs), np.packbits(full[:, ys][:, :, xs], axis=-1))
    mirrored = bits_at(parsed, ys, xs, mirrored=True)  # (hflip: the columns in reverse order)
    np.testing.assert_array_equal(mirrored, np.packbits(full[:, ys][:, :, xs[::-1]], axis=-1))


def test_affine_index_without_offset_or_step_is_nearest_index():
    for src, dst in [(1500, 1024), (7, 3), (3, 7), (1, 1), (2250, 256)]:
        assert np.array_equal(affine_index(src, dst, 0, (1, 1), dst), nearest_index(src, dst))


@pytest.mark.parametrize("size", [(1500, 2250), (2250, 1500), (1501, 2247), (7, 3)])
@pytest.mark.parametrize("target", [256, 1024, 64, 1])
def test_raster_real_sizes(size, target):
    rng = np.random.default_rng(sum(size) + target)
    masks = _blobs(rng, *size, 3)
    out = fit(*size, target)
    strings, expected = _reference(masks, out)
    np.testing.assert_array_equal(raster(strings, size, out), expected)
    np.testing.assert_array_equal(raster_bits(strings, size, out), np.packbits(expected, axis=-1))


def test_raster_real_photo_segmentation(sa1b_src):
    """Masks from the sample data (real segmentations of real photographs)."""
    import json
    import tarfile

    with tarfile.open(next(sa1b_src.glob("*.tar"))) as archive:
        meta = json.load(archive.extractfile(next(m for m in archive if m.name.endswith(".json"))))
    rles = [a["segmentation"] for a in meta["annotations"]]
    height, width = rles[0]["size"]
    full = mask_utils.decode(rles)
    for out in [(height, width), fit(height, width, 64), fit(height, width, 300)]:
        ys, xs = _nearest(height, out[0]), _nearest(width, out[1])
        got = raster([r["counts"].encode() for r in rles], (height, width), out)
        np.testing.assert_array_equal(got, full[ys][:, xs].transpose(2, 0, 1).astype(bool))


def test_fit_and_nearest():
    assert fit(1500, 2250, 1024) == (683, 1024)
    assert fit(2250, 1500, 256) == (256, 171)
    assert fit(10, 10, 3) == (3, 3)
    assert fit(1, 1000, 10) == (1, 10)
    np.testing.assert_array_equal(nearest_index(4, 2), [1, 3])
    np.testing.assert_array_equal(nearest_index(2, 4), [0, 0, 1, 1])
    for src, dst in [(1500, 683), (7, 13), (1, 5), (2250, 1024), (683, 1500), (1, 1)]:
        np.testing.assert_array_equal(nearest_index(src, dst), _nearest(src, dst))


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        (b"", "empty"),
        (b"\x7f", "invalid character"),
        (b"0 ", "invalid character"),
        (b"4h", "truncated"),  # 'h' has the continuation bit set: the string ends mid-value
        (b"00", "cover"),  # two zero runs: covers 0 pixels
        (b"6", "cover"),  # one run of 6 zeros in a 2x2 mask
        (b"0" + b"o" * 12 + b"0", "too long"),
        (b"2O", "negative"),  # "O" is -1: a negative run
    ],
)
def test_invalid_counts_are_errors(counts, message):
    with pytest.raises(RLEError, match=message):
        check([counts], (2, 2))
    for decode in (raster, raster_bits):
        with pytest.raises(RLEError, match="mask 1"):
            decode([b"4", counts], (2, 2), (2, 2))
    with pytest.raises(RLEError, match="mask 1"):
        parse([b"13", counts], (2, 2))


@settings(max_examples=200, deadline=None)
@given(height=st.integers(1, 40), width=st.integers(1, 40), k=st.integers(1, 4), density=st.floats(0.01, 1),
       style=st.sampled_from(["noise", "blobs", "pixel"]), seed=st.integers(0, 2**32 - 1))
def test_foreground_pixels_are_pycocotools_foreground_in_column_major_order(height, width, k, density, style, seed):
    """Fractions (n + 0.5) / area pick every foreground pixel once, in COCO's column-major order: the
    n-th pick is the n-th of pycocotools' decode; random fractions pick foreground pixels only."""
    rng = np.random.default_rng(seed)
    if style == "noise":
        masks = (rng.random((height, width, k)) < density).astype(np.uint8)
    elif style == "blobs":
        masks = _blobs(rng, height, width, k)
    else:
        masks = np.zeros((height, width, k), np.uint8)
    masks[rng.integers(0, height), rng.integers(0, width)] = 1  # (no mask is empty)
    strings = [r["counts"] for r in mask_utils.encode(np.asfortranarray(masks))]
    full = mask_utils.decode(mask_utils.encode(np.asfortranarray(masks)))
    areas = full.reshape(-1, k).sum(0)
    most = int(areas.max())
    fractions = (np.arange(most)[None, :] + 0.5) / areas[:, None]
    got = foreground_pixels(parse(strings, (height, width)), np.minimum(fractions, 0.999999))
    assert got.shape == (k, most, 2) and got.dtype == np.int64
    for i in range(k):
        columns, rows = np.nonzero(full[..., i].T)  # column-major: by column, then row
        np.testing.assert_array_equal(got[i, : areas[i]], np.stack([columns, rows], 1))
    rows = rng.integers(0, k, 7)  # (rows: masks picked by index, repeats allowed)
    random = foreground_pixels(parse(strings, (height, width)), rng.random((7, 50)), rows)
    assert full[random[..., 1], random[..., 0], rows[:, None]].all()


@settings(max_examples=300, deadline=None)
@given(height=st.integers(1, 40), width=st.integers(1, 40), k=st.integers(1, 4), style=st.sampled_from(["noise", "blobs"]),
       window=st.tuples(*[st.integers(-5, 45)] * 4), seed=st.integers(0, 2**32 - 1))
def test_a_crop_is_the_window_of_pycocotools_masks(height, width, k, style, window, seed):
    """`crop` to rows [top, bottom) x columns [left, right): its areas, tight boxes, foreground pixels
    (in the full frame) and a subset of its masks are those of pycocotools' decode cut to the window."""
    rng = np.random.default_rng(seed)
    masks = (rng.random((height, width, k)) < 0.3).astype(np.uint8) if style == "noise" else _blobs(rng, height, width, k)
    full = mask_utils.decode(mask_utils.encode(np.asfortranarray(masks))).transpose(2, 0, 1).astype(bool)
    top, bottom = sorted(np.clip(window[:2], 0, height))
    left, right = sorted(np.clip(window[2:], 0, width))
    cut = np.zeros_like(full)
    cut[:, top:bottom, left:right] = full[:, top:bottom, left:right]
    inside = crop(parse([r["counts"] for r in mask_utils.encode(np.asfortranarray(masks))], (height, width)),
                  (int(top), int(bottom)), (int(left), int(right)))
    np.testing.assert_array_equal(areas(inside), cut.sum((1, 2)))
    for i, box in enumerate(tight_boxes(inside)):
        rows, columns = np.nonzero(cut[i])
        want = [columns.min(), rows.min(), columns.max() + 1, rows.max() + 1] if rows.size else [0, 0, 0, 0]
        assert box.tolist() == want, (i, box, want)
    keep = cut.any((1, 2))
    kept = inside.subset(keep)
    if keep.any():
        picked = foreground_pixels(kept, rng.random((int(keep.sum()), 20)))
        assert cut[keep][np.arange(int(keep.sum()))[:, None], picked[..., 1], picked[..., 0]].all()
        counts = (np.arange(int(areas(kept).max()))[None, :] + 0.5) / areas(kept)[:, None]
        every = foreground_pixels(kept, np.minimum(counts, 0.999999))
        for j, i in enumerate(np.flatnonzero(keep)):  # the n-th pick is the n-th pixel of the window, column-major
            columns, rows = np.nonzero(cut[i].T)
            np.testing.assert_array_equal(every[j, : columns.size], np.stack([columns, rows], 1))


def test_a_run_over_a_column_end_spans_every_row_of_the_box():
    mask = np.zeros((3, 3, 1), np.uint8)
    mask[2, 0] = mask[0, 1] = 1  # (one run of 1s, column-major: the last row of column 0, the first of column 1)
    parsed = parse([mask_utils.encode(np.asfortranarray(mask))[0]["counts"]], (3, 3))
    assert tight_boxes(parsed).tolist() == [[0, 0, 2, 3]]
    assert tight_boxes(crop(parsed, (1, 3), (0, 3))).tolist() == [[0, 2, 1, 3]]


def test_a_mask_with_no_pixel_has_no_point():
    with pytest.raises(RLEError, match="mask 1.*no foreground pixel"):
        foreground_pixels(parse([b"13", b"4"], (2, 2)), np.zeros((2, 3)))
    assert foreground_pixels(parse([], (2, 2)), np.zeros((0, 3))).shape == (0, 3, 2)


def test_no_masks():
    assert raster([], (5, 5), (3, 3)).shape == (0, 3, 3)
    assert raster_bits([], (5, 5), (3, 11)).shape == (0, 3, 2)
    check([], (5, 5))
