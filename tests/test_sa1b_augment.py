"""SA-1B joint augmentation (pipeline.kinds.sa1b_augment): `hflip` mirrors the image and every
geometric field together, exactly, without changing any other draw; `resize="square"` warps image and
masks to square frames (masks against pycocotools' full decode, nearest sampling per axis);
`scale_jitter` scales, crops or pads (masks against pycocotools' decode warped by the same transform,
computed here with exact fractions); all the same for any worker count, in the resume identity, and
validated."""

from __future__ import annotations

import io
import math
import pathlib
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as mask_utils

from pipeline import make_stream_loader
from pipeline.errors import ConfigError
from pipeline.kinds.sa1b import Sa1bOptions
from pipeline.rle import fit
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


def _chosen(count: int, epoch: int, key: str) -> np.ndarray:
    """The masks a sample's own draw picks (its `Purpose.MASKS` stream, drawn here): all of them if at
    most max_masks=6, else 6 of them, sorted."""
    if count <= 6:
        return np.arange(count)
    return np.sort(sample_rng(11, epoch, Purpose.MASKS, key_entropy(key)).choice(count, 6, replace=False))


def _resized(jpg: bytes, size: tuple) -> torch.Tensor:
    """Pillow's decode at the smallest DCT scale covering `size` (its `draft`), resized by torch's
    antialiased bilinear filter: (3, h, w) uint8."""
    image = Image.open(io.BytesIO(jpg))
    image.draft("RGB", (size[1], size[0]))
    pixels = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)[None]
    return torch.nn.functional.interpolate(pixels, size=size, mode="bilinear", antialias=True)[0]


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
            assert torch.equal(batch["images"][i], _resized(jpg, (80, 80)))
            chosen = _chosen(len(meta["annotations"]), 1, key)
            assert len(chosen) == n
            full = mask_utils.decode([meta["annotations"][j]["segmentation"] for j in chosen])
            want = full[_warp(height, 32, 0, 32, Fraction(1))][:, _warp(width, 32, 0, 32, Fraction(1))].transpose(2, 0, 1)
            assert torch.equal(batch["masks"][i, :n], torch.from_numpy(want.astype(bool)))
            x, y, w, h = np.array([meta["annotations"][j]["bbox"] for j in chosen]).reshape(-1, 4).T
            sx, sy = 80 / width, 80 / height
            want_boxes = np.clip(np.stack([x * sx, y * sy, (x + w) * sx, (y + h) * sy], 1), 0, 80)
            np.testing.assert_allclose(batch["boxes"][i, :n], want_boxes, rtol=1e-6, atol=1e-4)
            areas = [meta["annotations"][j]["area"] * sx * sy for j in chosen]
            np.testing.assert_allclose(batch["areas"][i, :n], areas, rtol=1e-6)
            checked += n
    assert checked > 30


def _warp(src: int, scaled: int, offset: int, count: int, width: Fraction = Fraction(80, 32)) -> np.ndarray:
    """The original pixels a jittered mask's pixels sample (mask pixel j: `width` image pixels wide),
    those inside the original, by exact fractions."""
    found = [math.floor(((j + Fraction(1, 2)) * width + offset) * src / scaled) for j in range(count)]
    return np.array([v for v in found if v < src], dtype=np.int64)


def _jitter(meta: dict, key: str, epoch: int, lo: float, hi: float) -> tuple:
    """The scaled frame, offset and content a sample's draws give (the two streams, drawn here)."""
    height, width = meta["image"]["height"], meta["image"]["width"]
    factor = sample_rng(11, epoch, Purpose.SCALE_JITTER, key_entropy(key)).uniform(lo, hi)
    scaled = fit(height, width, max(1, round(factor * 80)))
    room = np.maximum(np.array(scaled) - 80, 0)
    oy, ox = sample_rng(11, epoch, Purpose.CROP, key_entropy(key)).integers(0, room + 1).tolist()
    return scaled, (oy, ox), (min(scaled[0] - oy, 80), min(scaled[1] - ox, 80))


def _shown(full: np.ndarray, size: tuple, scaled: tuple, offset: tuple, content: tuple) -> np.ndarray:
    """Which full-size mask pixels a crop shows: those whose centers land in the content, decided in
    exact integers (row r's center, (r + 1/2) x h_scaled / H, in [oy, oy + ch); columns likewise)."""
    def centers(src: int, sc: int, off: int, length: int) -> np.ndarray:
        twice = (2 * np.arange(src) + 1) * sc
        return (twice >= 2 * off * src) & (twice < 2 * (off + length) * src)

    rows, cols = (centers(size[k], scaled[k], offset[k], content[k]) for k in (0, 1))
    return full & rows[None, :, None] & cols[None, None, :]


def _on_shown_pixels(xy: np.ndarray, shown: np.ndarray, scale: tuple, offset: tuple) -> bool:
    """Whether every point (XY, canvas) lies in a shown foreground pixel of its mask (shown: (n, H, W))."""
    (sx, sy), (oy, ox) = scale, offset
    cols = np.floor((xy[..., 0] + ox) / sx).astype(np.int64)
    rows = np.floor((xy[..., 1] + oy) / sy).astype(np.int64)
    h, w = shown.shape[1:]
    if (cols < 0).any() or (cols >= w).any() or (rows < 0).any() or (rows >= h).any():
        return False
    masks = np.arange(len(shown)).reshape((-1,) + (1,) * (xy.ndim - 2))
    return bool(shown[masks, rows, cols].all())


def test_scale_jitter_masks_equal_pycocotools_warped(sa1b_dataset, sources):
    """Masks, boxes, areas and every prompt of a jittered sample against pycocotools' full-size masks
    warped and cropped here: boxes the tight box of what the crop shows, areas its pixels, points on
    it; a mask with nothing shown is dropped."""
    jitter = dict(SAM, scale_jitter=(0.5, 4.0))
    kind = make_stream_loader(sa1b_dataset, "train", **BASE, **jitter).kind
    seen = {"cropped": 0, "padded": 0, "dropped": 0, "masks": 0, "cut": 0, "moved_points": 0}
    for epoch, batch in [(e, b) for e in (1, 2) for b in _epoch(sa1b_dataset, e, **jitter)]:
        assert kind.check(batch, epoch) == []
        for i, key in enumerate(batch["keys"]):
            (meta, jpg), n = sources[key], int(batch["mask_counts"][i])
            height, width = meta["image"]["height"], meta["image"]["width"]
            (sh, sw), (oy, ox), (ch, cw) = _jitter(meta, key, epoch, 0.5, 4.0)
            assert batch["image_sizes"][i].tolist() == [ch, cw]
            image = _resized(jpg, (sh, sw))[:, oy : oy + ch, ox : ox + cw]
            assert torch.equal(batch["images"][i, :, :ch, :cw], image) and not batch["images"][i, :, ch:].any()
            chosen = _chosen(len(meta["annotations"]), epoch, key)
            full = mask_utils.decode([meta["annotations"][j]["segmentation"] for j in chosen]).transpose(2, 0, 1)
            shown = _shown(full.reshape(-1, height, width).astype(bool), (height, width), (sh, sw), (oy, ox), (ch, cw))
            kept = shown.reshape(len(chosen), -1).any(1)
            assert n == kept.sum()
            full, shown = full[kept], shown[kept]
            ys, xs = _warp(height, sh, oy, 32), _warp(width, sw, ox, 32)
            want = torch.zeros((n, 32, 32), dtype=torch.bool)
            want[:, : len(ys), : len(xs)] = torch.from_numpy(full[:, ys][:, :, xs].astype(bool))
            assert torch.equal(batch["masks"][i, :n], want)
            sx, sy = sw / width, sh / height
            boxes = []
            for m in shown:
                r, c = np.nonzero(m)
                boxes.append([c.min() * sx - ox, r.min() * sy - oy, (c.max() + 1) * sx - ox, (r.max() + 1) * sy - oy])
            boxes = np.clip(np.array(boxes).reshape(-1, 4), 0, (cw, ch, cw, ch))
            np.testing.assert_allclose(batch["boxes"][i, :n], boxes, rtol=1e-6, atol=1e-4)
            np.testing.assert_allclose(batch["areas"][i, :n], shown.sum((1, 2)) * sx * sy, rtol=1e-6)
            assert _on_shown_pixels(batch["point_coords"][i, :n].numpy(), shown, (sx, sy), (oy, ox))
            bound = 20 * max(sx, sy) + 1e-3  # (noise of at most 20 original pixels a corner, then clipped)
            assert (batch["prompt_boxes"][i, :n] - batch["boxes"][i, :n]).abs().max() <= bound if n else True
            stored = np.array([meta["annotations"][j]["point_coords"][0] for j in np.asarray(chosen)[kept]])
            stored = stored.reshape(-1, 2) * (sx, sy) - (ox, oy)
            inside = (stored >= 0).all(1) & (stored < (cw, ch)).all(1)
            points = batch["points"][i, :n].numpy()
            np.testing.assert_allclose(points[inside], stored[inside], rtol=1e-6, atol=1e-4)
            assert _on_shown_pixels(points[~inside][:, None], shown[~inside], (sx, sy), (oy, ox))
            seen["cropped"] += (sh, sw) != (ch, cw)
            seen["padded"] += max(sh, sw) < 80
            seen["dropped"] += len(chosen) - n
            seen["masks"] += n
            seen["cut"] += int((shown.sum((1, 2)) < full.sum((1, 2))).sum())
            seen["moved_points"] += int((~inside).sum())
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
