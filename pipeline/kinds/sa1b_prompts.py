"""SA-1B on the reading side, for SAM fine-tuning: which masks a sample may use (area, predicted IoU
and stability rules; repeats to fill `max_masks`) and the prompts drawn for them (points in each mask,
noisy boxes), all decided from the per-mask columns and the RLE runs, before or without any raster.

Every draw is the sample's own, from (seed, epoch, purpose, key) with a purpose of its own
(`pipeline.seeds`): the same for any worker count and after resume, and turning one option on or off
changes no other draw. Frames as in `pipeline.kinds.sa1b`: the original image (H, W) and the image
frame (h, w); a pixel (column c, row r) covers [c, c + 1) x [r, r + 1) in its frame, so its center is
(c + 0.5, r + 0.5), and a coordinate x of the original frame is x * w / W in the image frame (as boxes).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from pipeline.errors import ConfigError
from pipeline.rle import Runs, foreground_pixels
from pipeline.seeds import Purpose, key_entropy, sample_rng

__all__ = ["Draw", "streams", "choose_masks", "chosen_masks", "point_prompts", "box_prompts", "check_options",
           "prompts_of", "prompt_columns", "prompt_problems", "BOX_NOISE_BOUND", "BOX_NOISE_MODES"]

BOX_NOISE_BOUND = 20.0  # pixels of the original image: no corner moves further (SAM's and SAM 2's bound)
BOX_NOISE_MODES = ("normal", "uniform")


@dataclasses.dataclass(frozen=True)
class Draw:
    """Where a sample's draws come from: (seed, epoch, key); one stream per purpose."""

    seed: int
    epoch: int
    key: str
    _made: dict[Purpose, np.random.Generator] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def rng(self, purpose: Purpose) -> np.random.Generator:
        """The purpose's stream, from its start (made by `make` if it was, else now)."""
        made = self._made.pop(purpose, None)
        return made if made is not None else sample_rng(self.seed, self.epoch, purpose, self.entropy)

    def make(self, purposes: Iterable[Purpose]) -> None:
        """Make the streams of these purposes now, one after another, for `rng` to hand out later:
        made while numpy's seeding code is in the CPU's caches, each costs ~15 us; made one at a time
        between a sample's image and mask decodes, which evict that code, ~45 us (measured)."""
        for purpose in purposes:
            self._made.setdefault(purpose, sample_rng(self.seed, self.epoch, purpose, self.entropy))

    @functools.cached_property
    def entropy(self) -> int:
        """The key as entropy (`key_entropy`), hashed once for all of the sample's draws."""
        return key_entropy(self.key)


def streams(options: Any) -> list[Purpose]:
    """The seeded streams an SA-1B sample draws from with these options (the mask choice's aside)."""
    return [purpose for purpose, used in ((Purpose.SCALE_JITTER, options.scale_jitter is not None),
                                          (Purpose.CROP, options.scale_jitter is not None),
                                          (Purpose.POINTS, options.points_per_mask > 0),
                                          (Purpose.BOX_NOISE, options.box_noise is not None),
                                          (Purpose.HFLIP, options.hflip > 0)) if used]


def choose_masks(count: int, limit: int, seed: int, epoch: int, key: str) -> np.ndarray:
    """Indices of the masks a sample uses this epoch: all if few, else a sorted random subset."""
    return _chosen(count, limit, Draw(seed, epoch, key))


def _chosen(count: int, limit: int, draw: Draw) -> np.ndarray:
    if count <= limit:
        return np.arange(count)
    return np.sort(draw.rng(Purpose.MASKS).choice(count, limit, replace=False))


def _fraction(value: Any, name: str, low_open: bool) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (0 < value <= 1 if low_open
                                                                               else 0 <= value <= 1)
    if not ok:
        raise ConfigError(f"{name} must be None or a number in {'(0, 1]' if low_open else '[0, 1]'}, got {value!r}")


def check_options(options: Any) -> None:
    """Refuse mask-policy and prompt options out of range, naming the value and what is allowed."""
    _fraction(options.max_mask_area, "max_mask_area", True)
    _fraction(options.min_predicted_iou, "min_predicted_iou", False)
    _fraction(options.min_stability_score, "min_stability_score", False)
    if not isinstance(options.fill_masks, bool):
        raise ConfigError(f"fill_masks must be True or False, got {options.fill_masks!r}")
    k = options.points_per_mask
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ConfigError(f"points_per_mask must be an int >= 0 (0: no point prompts), got {k!r}")
    s = options.box_noise
    if s is not None and (not isinstance(s, (int, float)) or isinstance(s, bool) or not 0 <= s < float("inf")):
        raise ConfigError(f"box_noise must be None (no box prompts) or a finite number >= 0, got {s!r}")
    if options.box_noise_mode not in BOX_NOISE_MODES:
        raise ConfigError(f"box_noise_mode must be one of {BOX_NOISE_MODES}, got {options.box_noise_mode!r}")


def chosen_masks(columns: dict[str, np.ndarray], size: tuple[int, int], options: Any, limit: int,
                 draw: Draw) -> np.ndarray:
    """The masks a sample uses, as indices into its columns: those the rules allow (area at most
    `max_mask_area` of the image, predicted IoU and stability at least their minimums), up to `limit`
    of them chosen as `choose_masks` chooses among all (the same draw: with no rule, the same masks).
    With `fill_masks`, k < `limit` chosen are repeated up to `limit` as EfficientViT-SAM does: all k
    limit // k times over, in order, then limit % k of them drawn without replacement (a stream of
    their own; kept in order): each appears limit // k or limit // k + 1 times."""
    keep = np.ones(len(columns["area"]), bool)
    if options.max_mask_area is not None:
        keep &= columns["area"] <= options.max_mask_area * size[0] * size[1]
    if options.min_predicted_iou is not None:
        keep &= columns["predicted_iou"] >= options.min_predicted_iou
    if options.min_stability_score is not None:
        keep &= columns["stability_score"] >= options.min_stability_score
    eligible = np.flatnonzero(keep)
    chosen = eligible[_chosen(eligible.size, limit, draw)]
    if options.fill_masks and 0 < chosen.size < limit:
        cycles, rest = divmod(limit, chosen.size)
        extra = np.sort(draw.rng(Purpose.MASK_REPEATS).choice(chosen.size, rest, replace=False))
        chosen = np.concatenate([np.tile(chosen, cycles), chosen[extra]])
    return chosen


def point_prompts(masks: Runs, rows: np.ndarray, size: tuple[int, int], frame: tuple[int, int], points: int,
                  draw: Draw) -> np.ndarray:
    """(n, points, 2) float32 XY in the image frame: for each of the n rows (a mask of `masks`, parsed
    RLE of the original image of `size`, or the window of it a crop shows: `rle.crop`), `points`
    pixels drawn uniformly, independently, over its foreground at full resolution (from its runs: no
    raster), each at its pixel's center."""
    fractions = draw.rng(Purpose.POINTS).random((len(rows), points))
    pixels = foreground_pixels(masks, fractions, rows)
    scale = np.array([frame[1] / size[1], frame[0] / size[0]])
    return ((pixels + 0.5) * scale).astype(np.float32)


def box_prompts(bbox: np.ndarray, size: tuple[int, int], frame: tuple[int, int], options: Any,
                draw: Draw) -> np.ndarray:
    """(n, 4) float32 XYXY in the image frame: each mask's box (`bbox`, XYWH in the original frame)
    with each corner coordinate moved by noise scaled by the box's side along it (x by width, y by
    height): normal of std `box_noise` x side, clipped to +-20 original pixels, or (`box_noise_mode=
    "uniform"`, SAM 2's rule) uniform within +-min(`box_noise` x side, 20 pixels); then clipped to the
    image and put in order (x0 <= x1, y0 <= y1: corners cross only when the noise is large)."""
    (height, width), n = size, len(bbox)
    x, y, w, h = bbox.T
    corners, sides = np.stack([x, y, x + w, y + h], 1), np.stack([w, h, w, h], 1)
    rng, s = draw.rng(Purpose.BOX_NOISE), float(options.box_noise)
    if options.box_noise_mode == "uniform":
        noise = rng.uniform(-1.0, 1.0, (n, 4)) * np.minimum(s * sides, BOX_NOISE_BOUND)
    else:
        noise = np.clip(rng.standard_normal((n, 4)) * (s * sides), -BOX_NOISE_BOUND, BOX_NOISE_BOUND)
    moved = np.clip(corners + noise, 0, (width, height, width, height))
    ordered = np.concatenate([np.minimum(moved[:, :2], moved[:, 2:]), np.maximum(moved[:, :2], moved[:, 2:])], 1)
    return (ordered * np.array([frame[1] / width, frame[0] / height] * 2)).astype(np.float32)


def prompts_of(masks: Runs, rows: np.ndarray, bbox: np.ndarray, size: tuple[int, int], frame: tuple[int, int],
               options: Any, draw: Draw) -> dict[str, np.ndarray]:
    """The prompts the options ask for (`point_coords`, `prompt_boxes`) of the chosen masks' rows: each
    row's mask among `masks` (parsed, or the window a crop shows), and its `bbox` (XYWH, frame of the
    original of `size`); a repeated mask's rows each draw their own."""
    prompts = {}
    if options.points_per_mask:
        prompts["point_coords"] = point_prompts(masks, rows, size, frame, options.points_per_mask, draw)
    if options.box_noise is not None:
        prompts["prompt_boxes"] = box_prompts(bbox, size, frame, options, draw)
    return prompts


def prompt_columns(options: Any) -> tuple[tuple[str, int], ...]:
    """The per-mask columns the prompt options add to a batch, with their widths in transit."""
    return ((("point_coords", 2 * options.points_per_mask),) if options.points_per_mask else ()) + \
        ((("prompt_boxes", 4),) if options.box_noise is not None else ())


def prompt_problems(batch: dict[str, Any], frame: torch.Tensor, valid: torch.Tensor) -> list[str]:
    """What is wrong with a finished batch's prompts, if it has any: NaN/Inf, a point or box outside
    its image's frame (`frame`: (B, 1, 4) of (w, h, w, h)), a box out of order, non-zero padding."""
    found = []
    for name in ("point_coords", "prompt_boxes"):
        value = batch.get(name)
        if value is None:
            continue
        bound = frame if name == "prompt_boxes" else frame[..., None, :2]
        if not torch.isfinite(value).all():
            found.append(f"{name}: NaN or infinite values")
        elif ((value < 0) | (value > bound)).any():
            found.append(f"{name}: outside the image frame")
        if name == "prompt_boxes" and (value[..., 2:] < value[..., :2]).any():
            found.append("prompt_boxes: x1 < x0 or y1 < y0")
        if (value * ~valid.reshape(valid.shape + (1,) * (value.dim() - 2))).any():
            found.append(f"{name}: non-zero padding beyond mask_counts")
    return found
