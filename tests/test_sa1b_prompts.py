"""SA-1B for SAM fine-tuning (pipeline.kinds.sa1b_prompts): mask rules and repeats, point prompts drawn
in each mask at full resolution, noisy box prompts; against pycocotools and the annotations' JSON, with
statistical checks of the draws (fixed seeds: deterministic), and the same batches for any worker count
and after resume."""

from __future__ import annotations

import json
import pathlib
import re
import tarfile

import numpy as np
import pytest
import torch
from pycocotools import mask as mask_utils

from pipeline import make_stream_loader
from pipeline.errors import ConfigError
from pipeline.kinds.sa1b import Sa1b, Sa1bOptions
from pipeline.kinds.sa1b_prompts import Draw, box_prompts, choose_masks, point_prompts
from pipeline.rle import fit, nearest_index, parse
from pipeline.seeds import Purpose, key_entropy, sample_rng
from conftest import batches_of

BASE = dict(batch_size=3, num_workers=0, seed=11, drop_last=False, image_size=80, mask_size=32)
SAM = dict(max_mask_area=0.09, points_per_mask=3, box_noise=0.1)
PROMPT_KEYS = {"point_coords", "prompt_boxes"}


def _loader(root: str, split: str = "train", **options):
    return make_stream_loader(root, split, **{**BASE, "max_masks": 6, **options})


def _epoch(loader, epoch: int) -> list[dict]:
    loader.set_epoch(epoch)
    return list(loader)


@pytest.fixture(scope="module")
def sources(sa1b_src: pathlib.Path) -> dict[str, dict]:
    """Each sample's annotations JSON, by key (the originals, not the packed records)."""
    found = {}
    for path in sorted(sa1b_src.glob("*.tar")):
        with tarfile.open(path) as archive:
            for member in archive:
                if member.name.endswith(".json"):
                    found[member.name.split(".")[0]] = json.loads(archive.extractfile(member).read())
    return found


def _eligible(meta: dict, max_area: float | None = None, min_iou: float | None = None,
              min_stability: float | None = None) -> np.ndarray:
    """The masks the rules allow, from the JSON, one annotation at a time."""
    height, width = meta["image"]["height"], meta["image"]["width"]
    return np.array([i for i, a in enumerate(meta["annotations"])
                     if (max_area is None or a["area"] <= max_area * height * width)
                     and (min_iou is None or a["predicted_iou"] >= min_iou)
                     and (min_stability is None or a["stability_score"] >= min_stability)], dtype=np.int64)


def _sampled(meta: dict, indices: np.ndarray, m: int) -> np.ndarray:
    """pycocotools' full decode of the masks `indices`, sampled at the mask frame: (k, mh, mw) bool."""
    height, width = meta["image"]["height"], meta["image"]["width"]
    mh, mw = fit(height, width, m)
    full = mask_utils.decode([meta["annotations"][j]["segmentation"] for j in indices])
    return full[nearest_index(height, mh)][:, nearest_index(width, mw)].transpose(2, 0, 1).astype(bool)


def test_points_lie_on_their_masks_at_full_size_and_masks_follow_the_rules(sa1b_dataset, sources):
    rules = dict(max_mask_area=0.09, min_predicted_iou=0.8, min_stability_score=0.85)
    loader = _loader(sa1b_dataset, points_per_mask=4, box_noise=0.1, **rules)
    kind, checked, excluded = Sa1b(loader.kind.options), 0, 0
    for epoch in (0, 1):
        for batch in _epoch(loader, epoch):
            assert kind.check(batch, epoch) == []
            assert batch["point_coords"].shape[2:] == (4, 2)
            for i, key in enumerate(batch["keys"]):
                meta, count = sources[key], int(batch["mask_counts"][i])
                height, width = meta["image"]["height"], meta["image"]["width"]
                eligible = _eligible(meta, 0.09, 0.8, 0.85)
                excluded += len(meta["annotations"]) - len(eligible)
                chosen = eligible[choose_masks(len(eligible), 6, 11, epoch, key)]
                assert count == len(chosen) == min(6, len(eligible))
                anns = [meta["annotations"][j] for j in chosen]
                # the rules, against the JSON's values
                assert all(a["area"] <= 0.09 * height * width and a["predicted_iou"] >= 0.8
                           and a["stability_score"] >= 0.85 for a in anns)
                np.testing.assert_allclose(batch["predicted_ious"][i, :count], [a["predicted_iou"] for a in anns],
                                           rtol=1e-6)
                mh, mw = fit(height, width, 32)
                assert torch.equal(batch["masks"][i, :count, :mh, :mw], torch.from_numpy(_sampled(meta, chosen, 32)))
                # every point on its mask, decoded by pycocotools at full size
                full = mask_utils.decode([a["segmentation"] for a in anns])  # (H, W, count)
                h, w = fit(height, width, 80)
                xy = batch["point_coords"][i, :count].double().numpy() * (width / w, height / h)  # pixel centers
                columns, rows = np.floor(xy[..., 0]).astype(int), np.floor(xy[..., 1]).astype(int)
                np.testing.assert_allclose(xy % 1, 0.5, atol=1e-3)
                assert full[rows, columns, np.arange(count)[:, None]].all()
                assert not batch["point_coords"][i, count:].any() and not batch["prompt_boxes"][i, count:].any()
                checked += count * 4
    assert checked > 300 and excluded > 20, "many points checked; the rules excluded masks"


def _point_counts(mask: np.ndarray, points: int, key: str) -> np.ndarray:
    """How often each foreground pixel of `mask` (H, W) is drawn in `points` draws, column-major."""
    rle = mask_utils.encode(np.asfortranarray(mask[..., None].astype(np.uint8)))[0]
    xy = point_prompts(parse([rle["counts"]], mask.shape), np.zeros(1, np.int64), mask.shape, mask.shape, points,
                       Draw(3, 1, key))[0]  # (frame = original)
    columns, rows = (xy[:, 0] - 0.5).astype(int), (xy[:, 1] - 0.5).astype(int)
    assert mask[rows, columns].all()
    hits = np.zeros(mask.shape, np.int64)
    np.add.at(hits, (rows, columns), 1)
    return hits.T[mask.T.astype(bool)]


def _chi_square(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


def test_points_are_uniform_over_the_mask():
    """Chi-square, fixed seeds (deterministic): per pixel of a small irregular mask, and per quadrant of a
    large one. Bounds are generous (p < 1e-6 under uniformity); a draw biased to the first pixels of a
    run, to the first runs, or to one column fails them by far."""
    yy, xx = np.mgrid[:9, :13]
    small = ((yy - 4) ** 2 / 16 + (xx - 6) ** 2 / 30 < 1) & ~((yy == 4) & (xx > 3) & (xx < 9))  # a ring
    counts = _point_counts(small, 40 * small.sum(), "small")
    stat, dof = _chi_square(counts, np.full(counts.shape, 40.0)), counts.size - 1
    assert stat < dof + 7 * np.sqrt(2 * dof), (stat, dof)
    yy, xx = np.mgrid[:300, :420]
    large = (yy - 150) ** 2 / 120 ** 2 + (xx - 200) ** 2 / 170 ** 2 < 1  # an ellipse
    rle = mask_utils.encode(np.asfortranarray(large[..., None].astype(np.uint8)))[0]
    xy = point_prompts(parse([rle["counts"]], large.shape), np.zeros(1, np.int64), large.shape, large.shape, 20000,
                       Draw(3, 1, "large"))[0]
    quadrant = (xy[:, 0] > 200).astype(int) * 2 + (xy[:, 1] > 150)
    pixels = np.array([large[:150, :200].sum(), large[150:, :200].sum(), large[:150, 200:].sum(),
                       large[150:, 200:].sum()])  # (a point at x > 200 is in column 200 or right of it)
    stat = _chi_square(np.bincount(quadrant, minlength=4), 20000 * pixels / pixels.sum())
    assert stat < 35, stat


def _offsets(mode: str, s: float, side: tuple[float, float], n: int = 20000) -> np.ndarray:
    """Noise of `n` box prompts of one box (`side`: w, h) in a 1000x1500 image at frame 512x768, in
    original pixels: (n, 4)."""
    options = Sa1bOptions(box_noise=s, box_noise_mode=mode)
    bbox = np.tile([600.0, 400.0, *side], (n, 1))
    boxes = box_prompts(bbox, (1000, 1500), (512, 768), options, Draw(7, 2, f"{mode}{side}"))
    assert boxes.dtype == np.float32 and (boxes[:, 2:] >= boxes[:, :2]).all()
    corners = np.array([600.0, 400.0, 600 + side[0], 400 + side[1]])
    return boxes / (768 / 1500, 512 / 1000, 768 / 1500, 512 / 1000) - corners


@pytest.mark.parametrize("mode", ["normal", "uniform"])
def test_box_noise_statistics(mode):
    s, n = 0.1, 20000
    small = _offsets(mode, s, (60.0, 50.0), n)  # std 6 and 5 pixels: the 20-pixel bound over 3 std away
    sides = np.array([60.0, 50.0, 60.0, 50.0])
    expected_std = s * sides / (np.sqrt(3) if mode == "uniform" else 1)
    assert (np.abs(small.mean(0)) < 5 * expected_std / np.sqrt(n)).all(), small.mean(0)
    np.testing.assert_allclose(small.std(0), expected_std, rtol=0.03)
    assert (np.abs(small) <= np.minimum(s * sides, 20) + 1e-3).all() if mode == "uniform" else \
        (np.abs(small) <= 20 + 1e-3).all()
    large = _offsets(mode, s, (400.0, 300.0), n)  # s x side 40 and 30 pixels: bound at 20
    assert np.abs(large).max() <= 20 + 1e-3
    assert np.abs(large).max() > 19.9, "the bound is reached"
    if mode == "normal":
        assert 0.4 < (np.abs(large) > 19.99).mean() < 0.7, "a normal of std 30-40 clipped at 20: about half"
    else:
        np.testing.assert_allclose(large.std(0), 20 / np.sqrt(3), rtol=0.03)


def test_fill_masks_repeats_eligible_masks_up_to_max_masks(sa1b_dataset, sources):
    loader = _loader(sa1b_dataset, max_masks=30, fill_masks=True, min_predicted_iou=0.9, points_per_mask=2)
    filled = 0
    for batch in _epoch(loader, 3):
        assert Sa1b(loader.kind.options).check(batch, 3) == []
        for i, key in enumerate(batch["keys"]):
            meta, count = sources[key], int(batch["mask_counts"][i])
            eligible = _eligible(meta, min_iou=0.9)
            assert count == (30 if len(eligible) else 0), "mask_counts: the rows filled, repeats counted"
            if not len(eligible):
                continue
            reference = torch.from_numpy(_sampled(meta, eligible, 32))
            mh, mw = reference.shape[1:]
            got = batch["masks"][i, :count, :mh, :mw]
            assert torch.equal(got[: len(eligible)], reference), "every eligible mask once, in order, first"
            rows = [next(j for j, r in enumerate(reference) if torch.equal(row, r)) for row in got]  # (none: fails)
            times = np.bincount(rows, minlength=len(eligible))
            assert set(times) <= {30 // len(eligible), 30 // len(eligible) + 1}, "repeats balanced (EfficientViT-SAM)"
            ious = {meta["annotations"][j]["predicted_iou"] for j in eligible}
            assert {round(v, 5) for v in batch["predicted_ious"][i].tolist()} <= {round(v, 5) for v in ious}
            filled += len(eligible) < 30
    assert filled > 3


def test_options_change_no_other_draw(sa1b_dataset):
    plain = _epoch(_loader(sa1b_dataset), 1)
    points = _epoch(_loader(sa1b_dataset, points_per_mask=2), 1)
    both = _epoch(_loader(sa1b_dataset, points_per_mask=2, box_noise=0.2, box_noise_mode="uniform"), 1)
    boxes = _epoch(_loader(sa1b_dataset, box_noise=0.2, box_noise_mode="uniform"), 1)
    every = _epoch(_loader(sa1b_dataset, max_mask_area=1.0, min_predicted_iou=0.0, min_stability_score=0.0),
                   1)  # rules that exclude nothing: the same masks, drawn alike
    for a, b, c, d, e in zip(plain, points, both, boxes, every):
        assert set(a) == set(e) == set(b) - {"point_coords"} == set(d) - {"prompt_boxes"} == set(c) - PROMPT_KEYS
        for name, value in a.items():
            for other in (b, c, d, e):
                assert torch.equal(value, other[name]) if isinstance(value, torch.Tensor) else value == other[name]
        assert torch.equal(b["point_coords"], c["point_coords"]), "box noise does not move points"
        assert torch.equal(c["prompt_boxes"], d["prompt_boxes"]), "points do not move box noise"


def test_all_options_off_keeps_the_batch():
    names = {f.name for f in Sa1b(Sa1bOptions()).fields(0)}
    assert names == {"images", "masks", "mask_counts", "boxes", "points", "areas", "predicted_ious",
                     "stability_scores", "image_ids", "original_sizes", "image_sizes", "keys"}
    on = {f.name: f for f in Sa1b(Sa1bOptions(points_per_mask=5, box_noise=0.0)).fields(0)}
    assert set(on) - names == PROMPT_KEYS and on["point_coords"].shape == ("B", "N", 5, 2)


def test_same_prompts_for_any_workers_and_after_resume(sa1b_dataset):
    options = dict(SAM, fill_masks=True, max_masks=8, min_stability_score=0.82)
    reference = batches_of(_loader(sa1b_dataset, **options), 2)
    first = _loader(sa1b_dataset, num_workers=2, **options)
    head = batches_of(first, 2, stop=2)
    resumed = _loader(sa1b_dataset, num_workers=2, **options)
    resumed.load_state_dict(first.state_dict())
    got = head + batches_of(resumed, 2)
    assert [b["keys"] for b in got] == [b["keys"] for b in reference]
    for a, b in zip(got, reference):
        assert set(a) == set(b) and PROMPT_KEYS <= set(a)
        for name, value in a.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b[name]), name
    with pytest.raises(ValueError, match=r"other options of the kind \(points_per_mask: 3 there, 2 here\)"):
        _loader(sa1b_dataset, **{**options, "points_per_mask": 2}).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="box_noise_mode: 'normal' there, 'uniform' here"):
        _loader(sa1b_dataset, **options, box_noise_mode="uniform").load_state_dict(first.state_dict())


def test_check_names_broken_prompts(sa1b_dataset):
    loader = _loader(sa1b_dataset, **{**SAM, "max_masks": 30})  # (more than some images have: padding rows)
    batch, kind = next(iter(loader)), loader.kind
    assert kind.check(batch, 0) == []
    for name, change, word in [
        ("point_coords", lambda v: v.double(), "dtype"), ("prompt_boxes", lambda v: v[..., :3], "shape"),
        ("point_coords", lambda v: v + 1000, "outside the image frame"),
        ("prompt_boxes", lambda v: v.flip(-1), "x1 < x0"),
        ("point_coords", lambda v: v * float("nan"), "NaN"),
    ]:
        found = kind.check({**batch, name: change(batch[name].clone())}, 0)
        assert any(p.startswith(f"{name}: ") and word in p for p in found), (name, word, found)
    short = int(batch["mask_counts"].argmin())  # (a row with padding: fewer masks than the batch's largest)
    assert int(batch["mask_counts"][short]) < batch["point_coords"].shape[1], batch["mask_counts"]
    broken = batch["point_coords"].clone()
    broken[short, int(batch["mask_counts"][short]):] = 1.0
    assert kind.check({**batch, "point_coords": broken}, 0) == ["point_coords: non-zero padding beyond mask_counts"]


@pytest.mark.parametrize(("bad", "message"), [
    ({"max_mask_area": 0}, "max_mask_area must be None or a number in (0, 1]"),
    ({"max_mask_area": 1.5}, "max_mask_area"), ({"min_predicted_iou": -0.1}, "min_predicted_iou"),
    ({"min_stability_score": float("nan")}, "min_stability_score"), ({"fill_masks": 1}, "fill_masks"),
    ({"points_per_mask": -1}, "points_per_mask must be an int >= 0"), ({"points_per_mask": 1.0}, "points_per_mask"),
    ({"box_noise": -0.1}, "box_noise must be None"), ({"box_noise": float("inf")}, "box_noise"),
    ({"box_noise_mode": "gauss"}, "box_noise_mode must be one of"),
])
def test_options_are_validated(bad, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Sa1bOptions(**bad)


def test_streams_made_ahead_are_the_streams_made_on_demand():
    """`Draw.make` only moves when a stream is made: each purpose's draws are those of its own stream
    from its start (a purpose asked for twice starts again), made ahead or not."""
    ahead, later = Draw(5, 3, "sa_1"), Draw(5, 3, "sa_1")
    ahead.make([Purpose.POINTS, Purpose.HFLIP])
    for purpose in (Purpose.HFLIP, Purpose.POINTS, Purpose.POINTS, Purpose.BOX_NOISE):
        expected = sample_rng(5, 3, purpose, key_entropy("sa_1")).random(4)
        np.testing.assert_array_equal(ahead.rng(purpose).random(4), expected)
        np.testing.assert_array_equal(later.rng(purpose).random(4), expected)
