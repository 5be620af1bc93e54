"""SA-1B joint augmentation (pipeline.kinds.sa1b_augment): `hflip` mirrors the image and every
geometric field together, exactly, without changing any other draw; `resize="square"` warps image and
masks to square frames (masks against pycocotools' full decode, nearest sampling per axis);
`scale_jitter` scales, crops or pads (masks against pycocotools' decode warped by the same transform,
computed here with exact fractions); all the same for any worker count, in the resume identity, and
validated."""

from __future__ import annotations

import math
import pathlib
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
from pycocotools import mask as mask_utils

from pipeline import make_stream_loader
from pipeline.errors import ConfigError
from pipeline.images import decode_image
from pipeline.kinds.sa1b import Sa1bOptions
from pipeline.kinds.sa1b_prompts import choose_masks
from pipeline.rle import fit, nearest_index
from pipeline.seeds import Purpose, key_entropy, sample_rng
from conftest import sa1b_originals

BASE = dict(batch_size=3, num_workers=0, seed=11, drop_last=False, image_size=80, mask_size=32, max_masks=6)
SAM = dict(points_per_mask=3, box_noise=0.1)
GEOMETRIC = {"images", "masks", "boxes", "points", "point_coords", "prompt_boxes"}


def _epoch(root: str, epoch: int = 1, **options) -> list[dict]:
    loader = make_stream_loader(root, "train", **{**BASE, **options})
    loader.set_epoch(epoch)
    return list(loader)


@pytest.fixture(scope="module")
def sources(sa1b_src: pathlib.Path) -> dict[str, tuple[dict, bytes]]:
    """Each sample's annotations JSON and JPEG, by key (the originals, not the packed records)."""
    return sa1b_originals(sa1b_src)


def _mirrored(batch: dict, mask_size: int, mask_widths: list[int] | None = None) -> dict:
    """A batch mirrored left to right by hand: each image and its masks within their content's width
    (the masks': `mask_widths`, default their frame's), boxes and points as x -> w - x (w: the image
    content's width), padding rows left zero."""
    out = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in batch.items()}
    for i in range(len(batch["keys"])):
        (h, w), n = batch["image_sizes"][i].tolist(), int(batch["mask_counts"][i])
        mh, mw = fit(*batch["original_sizes"][i].tolist(), mask_size)
        mw = mask_widths[i] if mask_widths else mw
        mh = batch["masks"].shape[2]  # (rows below the content are zero: mirrored, still zero)
        out["images"][i, :, :h, :w] = batch["images"][i, :, :h, :w].flip(-1)
        out["masks"][i, :n, :mh, :mw] = batch["masks"][i, :n, :mh, :mw].flip(-1)
        for name in ("boxes", "prompt_boxes"):
            x0, y0, x1, y1 = batch[name][i, :n].unbind(-1)
            out[name][i, :n] = torch.stack([w - x1, y0, w - x0, y1], -1)
        for name in ("points", "point_coords"):
            out[name][i, :n, ..., 0] = w - batch[name][i, :n, ..., 0]
    return out


def _same(a: dict, b: dict, names=None) -> None:
    assert set(a) == set(b)
    for name in names or a:
        value = a[name]
        assert torch.equal(value, b[name]) if isinstance(value, torch.Tensor) else value == b[name], name


def test_hflip_mirrors_every_geometric_field_and_changes_no_draw(sa1b_dataset):
    plain, flipped = _epoch(sa1b_dataset, **SAM), _epoch(sa1b_dataset, hflip=1.0, **SAM)
    assert plain and GEOMETRIC <= set(plain[0])
    for a, b in zip(plain, flipped):
        assert not torch.equal(a["images"], b["images"])
        _same(_mirrored(a, 32), b)  # every key: the geometric ones mirrored, the others unchanged


def test_hflip_draws_per_sample(sa1b_dataset):
    plain, flipped = _epoch(sa1b_dataset, **SAM), _epoch(sa1b_dataset, hflip=1.0, **SAM)
    half = _epoch(sa1b_dataset, hflip=0.5, **SAM)
    mirrored = 0
    for a, b, c in zip(plain, flipped, half):
        for i in range(len(a["keys"])):
            row = {name: value[i] for name, value in c.items() if isinstance(value, torch.Tensor)}
            same = all(torch.equal(v, a[name][i]) for name, v in row.items())
            assert same or all(torch.equal(v, b[name][i]) for name, v in row.items())
            mirrored += not same
    count = sum(len(b["keys"]) for b in plain)
    assert 0.2 * count < mirrored < 0.8 * count, (mirrored, count)


def test_square_resize_warps_image_masks_and_columns(sa1b_dataset, sources):
    batches = _epoch(sa1b_dataset, resize="square", **SAM)
    plain = _epoch(sa1b_dataset, **SAM)
    kind = make_stream_loader(sa1b_dataset, "train", **BASE, resize="square", **SAM).kind
    checked = 0
    for batch, other in zip(batches, plain):
        assert kind.check(batch, 1) == []
        assert batch["images"].shape[2:] == (80, 80) and batch["masks"].shape[2:] == (32, 32)
        assert (batch["image_sizes"] == 80).all()
        _same(batch, other, ["keys", "mask_counts", "predicted_ious", "original_sizes"])  # the same masks
        for i, key in enumerate(batch["keys"]):
            (meta, jpg), n = sources[key], int(batch["mask_counts"][i])
            height, width = meta["image"]["height"], meta["image"]["width"]
            assert torch.equal(batch["images"][i], decode_image(jpg, (80, 80), "src", key))
            chosen = choose_masks(len(meta["annotations"]), 6, 11, 1, key)
            assert len(chosen) == n
            full = mask_utils.decode([meta["annotations"][j]["segmentation"] for j in chosen])
            want = full[nearest_index(height, 32)][:, nearest_index(width, 32)].transpose(2, 0, 1)
            assert torch.equal(batch["masks"][i, :n], torch.from_numpy(want.astype(bool)))
            x, y, w, h = np.array([meta["annotations"][j]["bbox"] for j in chosen]).reshape(-1, 4).T
            sx, sy = 80 / width, 80 / height
            want_boxes = np.clip(np.stack([x * sx, y * sy, (x + w) * sx, (y + h) * sy], 1), 0, 80)
            np.testing.assert_allclose(batch["boxes"][i, :n], want_boxes, rtol=1e-6, atol=1e-4)
            areas = [meta["annotations"][j]["area"] * sx * sy for j in chosen]
            np.testing.assert_allclose(batch["areas"][i, :n], areas, rtol=1e-6)
            checked += n
    assert checked > 30


def _warp(src: int, scaled: int, offset: int, count: int) -> np.ndarray:
    """The original pixels a jittered mask's pixels sample (mask pixel j: 80 / 32 image pixels wide),
    those inside the original, by exact fractions."""
    found = [math.floor(((j + Fraction(1, 2)) * Fraction(80, 32) + offset) * src / scaled) for j in range(count)]
    return np.array([v for v in found if v < src], dtype=np.int64)


def _jitter(meta: dict, key: str, epoch: int, lo: float, hi: float) -> tuple:
    """The scaled frame, offset and content a sample's draws give (the two streams, drawn here)."""
    height, width = meta["image"]["height"], meta["image"]["width"]
    factor = sample_rng(11, epoch, Purpose.SCALE_JITTER, key_entropy(key)).uniform(lo, hi)
    scaled = fit(height, width, max(1, round(factor * 80)))
    room = np.maximum(np.array(scaled) - 80, 0)
    oy, ox = sample_rng(11, epoch, Purpose.CROP, key_entropy(key)).integers(0, room + 1).tolist()
    return scaled, (oy, ox), (min(scaled[0] - oy, 80), min(scaled[1] - ox, 80))


def test_scale_jitter_masks_equal_pycocotools_warped(sa1b_dataset, sources):
    jitter = dict(SAM, scale_jitter=(0.5, 4.0))
    kind = make_stream_loader(sa1b_dataset, "train", **BASE, **jitter).kind
    seen = {"cropped": 0, "padded": 0, "dropped": 0, "masks": 0}
    for epoch, batch in [(e, b) for e in (1, 2) for b in _epoch(sa1b_dataset, e, **jitter)]:
        assert kind.check(batch, epoch) == []
        for i, key in enumerate(batch["keys"]):
            (meta, jpg), n = sources[key], int(batch["mask_counts"][i])
            height, width = meta["image"]["height"], meta["image"]["width"]
            (sh, sw), (oy, ox), (ch, cw) = _jitter(meta, key, epoch, 0.5, 4.0)
            assert batch["image_sizes"][i].tolist() == [ch, cw]
            image = decode_image(jpg, (sh, sw), "src", key)[:, oy : oy + ch, ox : ox + cw]
            assert torch.equal(batch["images"][i, :, :ch, :cw], image) and not batch["images"][i, :, ch:].any()
            chosen = choose_masks(len(meta["annotations"]), 6, 11, epoch, key)
            x, y, w, h = np.array([meta["annotations"][j]["bbox"] for j in chosen]).reshape(-1, 4).T
            x0, y0 = x * sw / width - ox, y * sh / height - oy
            x1, y1 = (x + w) * sw / width - ox, (y + h) * sh / height - oy
            inside = (x1 > 0) & (y1 > 0) & (x0 < cw) & (y0 < ch)
            kept = chosen[inside]
            assert n == len(kept)
            ys, xs = _warp(height, sh, oy, 32), _warp(width, sw, ox, 32)
            full = mask_utils.decode([meta["annotations"][j]["segmentation"] for j in kept]).transpose(2, 0, 1)
            want = torch.zeros((n, 32, 32), dtype=torch.bool)
            want[:, : len(ys), : len(xs)] = torch.from_numpy(full[:, ys][:, :, xs].astype(bool))
            assert torch.equal(batch["masks"][i, :n], want)
            boxes = np.clip(np.stack([x0, y0, x1, y1], 1)[inside], 0, (cw, ch, cw, ch))
            np.testing.assert_allclose(batch["boxes"][i, :n], boxes, rtol=1e-6, atol=1e-4)
            seen["cropped"] += (sh, sw) != (ch, cw)
            seen["padded"] += max(sh, sw) < 80
            seen["dropped"] += len(chosen) - n
            seen["masks"] += n
    assert all(count > 2 for count in seen.values()), seen


def test_hflip_after_scale_jitter_mirrors_the_content(sa1b_dataset, sources):
    jitter = dict(SAM, scale_jitter=(0.5, 2.5))
    plain, flipped = _epoch(sa1b_dataset, **jitter), _epoch(sa1b_dataset, hflip=1.0, **jitter)
    for a, b in zip(plain, flipped):
        widths = []
        for key in a["keys"]:
            meta = sources[key][0]
            (_, sw), (_, ox), _ = _jitter(meta, key, 1, 0.5, 2.5)
            widths.append(len(_warp(meta["image"]["width"], sw, ox, 32)))
        _same(_mirrored(a, 32, widths), b)


def test_same_batches_for_any_workers_and_in_the_resume_identity(sa1b_dataset):
    options = dict(SAM, hflip=0.5, resize="square", scale_jitter=(0.5, 2.0))
    reference = _epoch(sa1b_dataset, 2, **options)
    got = _epoch(sa1b_dataset, 2, num_workers=2, **options)
    assert len(got) == len(reference)
    for a, b in zip(got, reference):
        _same(a, b)
    saved = make_stream_loader(sa1b_dataset, "train", **BASE, **options).state_dict()
    with pytest.raises(ValueError, match=r"hflip: 0.5 there, 0.0 here"):
        make_stream_loader(sa1b_dataset, "train", **BASE, **{**options, "hflip": 0.0}).load_state_dict(saved)
    with pytest.raises(ValueError, match="resize: 'square' there, 'longest' here"):
        make_stream_loader(sa1b_dataset, "train", **BASE, **{**options, "resize": "longest"}).load_state_dict(saved)
    with pytest.raises(ValueError, match=re.escape("scale_jitter: [0.5, 2.0] there, None here")):
        make_stream_loader(sa1b_dataset, "train", **BASE, **{**options, "scale_jitter": None}).load_state_dict(saved)


@pytest.mark.parametrize(("bad", "message"), [
    ({"hflip": -0.1}, "hflip must be a probability in [0, 1]"), ({"hflip": 1.5}, "hflip must be"),
    ({"hflip": True}, "hflip must be"), ({"hflip": float("nan")}, "hflip must be"),
    ({"resize": "stretch"}, "resize must be one of ('longest', 'square')"),
    ({"scale_jitter": (0, 2)}, "scale_jitter must be None or (lo, hi) with 0 < lo <= hi <= 10"),
    ({"scale_jitter": (2, 1)}, "scale_jitter must be"), ({"scale_jitter": 1.5}, "scale_jitter must be"),
    ({"scale_jitter": (0.5, float("nan"))}, "scale_jitter must be"), ({"scale_jitter": (1, 11)}, "scale_jitter"),
])
def test_options_are_validated(bad, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Sa1bOptions(**bad)
