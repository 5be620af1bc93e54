"""SA-1B on the reading side: sample decoding (image + sampled masks), collation, batch checks.

Geometry: for an original image H0 x W0, the image frame is `fit(H0, W0, image_size)` and the
mask frame `fit(H0, W0, mask_size)` (or the image frame when `mask_size` is None). Both are
computed from the original size, so a JPEG stored smaller at pack time (`--image-max-side`) lands
in the same frame as its masks, which always keep their original RLE. With `resize="square"` both
frames are square instead (`pipeline.kinds.sa1b_augment`, with `scale_jitter` and `hflip`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import msgpack.exceptions
import numpy as np
import numpy.random  # noqa: F401  (imported on first use otherwise: ~20 ms of each worker's first batch)
import torch

from pipeline.errors import ConfigError, SampleError, excerpt
from pipeline.format import (SA1B_ANN, SA1B_JPG, SA1B_JSON, SA1B_RECORD_FIELDS, decode_array, encode_array,
                             parse_json, unpack_record)
from pipeline.images import MAX_IMAGE_PIXELS, decode_image
from pipeline.kinds.sa1b_augment import augmented, check_augment, depends, flips, view_of
from pipeline.kinds.sa1b_batch import MASK_COLUMNS, check_decode_device, collate, finish, image_of, masks_of
from pipeline.kinds.sa1b_prompts import (Draw, check_options, choose_masks, chosen_masks, prompt_columns,
                                         prompt_problems, prompts_of, streams)
from pipeline.kinds.schema import BatchField, problems
from pipeline.rle import RLEError, check, parse
from pipeline.stats import Clock

__all__ = ["Sa1bOptions", "decode_image", "choose_masks", "MAX_IMAGE_PIXELS", "annotation_record",
           "annotation_arrays", "original_record", "Sa1b"]

STAGES = ("image", "masks")  # the parts of `Sa1b.decode` it times (`Kind.stages`; "masks": and their prompts)


@dataclasses.dataclass(frozen=True)
class Sa1bOptions:
    """How SA-1B samples are decoded: image and mask frames (long side, pixels), masks per image.
    `mask_size` may exceed `image_size` (masks finer than the image): both frames come from the
    original size, so they stay aligned. For SAM fine-tuning (`pipeline.kinds.sa1b_prompts`): rules
    on which masks may be chosen, repeats up to `max_masks`, point and noisy box prompts; all off by
    default (the batch as without them)."""

    image_size: int = 1024
    mask_size: int | None = 256
    max_masks: int | Callable[[int], int] = 64  # or a function of the epoch (curriculum)
    max_image_pixels: int = MAX_IMAGE_PIXELS  # larger images are refused, never decoded
    max_mask_area: float | None = None  # masks over this fraction of the image's area are never chosen
    min_predicted_iou: float | None = None  # masks below are never chosen
    min_stability_score: float | None = None  # masks below are never chosen
    fill_masks: bool = False  # fewer than max_masks chosen: repeats of them fill up to max_masks
    points_per_mask: int = 0  # > 0: `point_coords`, points drawn in each mask
    box_noise: float | None = None  # a number: `prompt_boxes`, boxes with noise of std box_noise x side
    box_noise_mode: str = "normal"  # or "uniform" (SAM 2's rule)
    hflip: float = 0.0  # the probability that a sample is mirrored (`pipeline.kinds.sa1b_augment`)
    resize: str = "longest"  # or "square" (SAM 2's: both sides to image_size / mask_size)
    scale_jitter: tuple[float, float] | None = None  # (lo, hi): long side scaled by a factor in it, cropped
    decode_device: str | None = None  # "cpu" or "cuda": pixels made by the loader's device stage (`sa1b_batch`)

    def __post_init__(self) -> None:
        if not isinstance(self.image_size, int) or self.image_size < 1:
            raise ConfigError(f"image_size must be a positive int, got {self.image_size!r}")
        if self.mask_size is not None and (not isinstance(self.mask_size, int) or self.mask_size < 1):
            raise ConfigError(f"mask_size must be a positive int or None, got {self.mask_size!r}")
        if not callable(self.max_masks):
            self.masks_for(0)
        check_options(self)
        check_augment(self)
        check_decode_device(self)
        if isinstance(self.scale_jitter, list):  # (from JSON, say: kept as the pair it means, hashable)
            object.__setattr__(self, "scale_jitter", tuple(self.scale_jitter))

    def masks_for(self, epoch: int) -> int:
        value = self.max_masks(epoch) if callable(self.max_masks) else self.max_masks
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"max_masks must be an int >= 0 (or a function of the epoch giving one), got {value!r}")
        return value

    @property
    def mask_frame(self) -> int:
        return self.mask_size if self.mask_size is not None else self.image_size


def _array(record: dict[str, Any], name: str, shape: tuple[int, ...], url: str, key: str) -> np.ndarray:
    try:
        value = record[name]
        array = value if isinstance(value, np.ndarray) else decode_array(value)  # (originals come as arrays)
    except ValueError as exc:
        raise SampleError(str(exc), url=url, key=key, field=name) from exc
    if array.shape != shape:
        raise SampleError(f"shape {array.shape}, expected {shape}", url=url, key=key, field=name)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise SampleError("NaN or infinite value", url=url, key=key, field=name)
    return array


def _packed_record(members: dict[str, Any], url: str, key: str) -> dict[str, Any]:
    if set(members) != {SA1B_JPG, SA1B_ANN}:
        raise SampleError(f"members {sorted(members)}, expected {[SA1B_JPG, SA1B_ANN]}", url=url, key=key)
    try:
        return unpack_record(members[SA1B_ANN])
    except (ValueError, msgpack.exceptions.UnpackException) as exc:
        raise SampleError(f"cannot unpack: {exc}", url=url, key=key, field=SA1B_ANN) from exc


def _record(members: dict[str, bytes], max_pixels: int, url: str, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A sample's record, checked: (image id, height and width; mask counts) and its per-mask columns
    as arrays. An original sample (`jpg` + `json`, indexed in place) is checked as packing checks it."""
    if SA1B_JSON in members:  # an original sample: its record straight from its JSON, columns as arrays
        record = original_record(members, url, key)
    else:
        record = _packed_record(members, url, key)
    if set(record) != set(SA1B_RECORD_FIELDS):
        raise SampleError(f"fields {sorted(record)}, expected {sorted(SA1B_RECORD_FIELDS)}",
                          url=url, key=key, field=SA1B_ANN)
    info, counts = record["image"], record["counts"]
    try:
        image_id, height, width = int(info["image_id"]), int(info["height"]), int(info["width"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SampleError(f"invalid image info {excerpt(repr(info))}", url=url, key=key, field="image") from exc
    if height < 1 or width < 1 or height * width > max_pixels:
        raise SampleError(f"invalid size {height}x{width}", url=url, key=key, field="image")
    if not isinstance(counts, list) or not all(isinstance(c, bytes) for c in counts):
        raise SampleError("expected a list of byte strings", url=url, key=key, field="counts")
    n = len(counts)
    point_counts = _array(record, "point_counts", (n,), url, key)
    columns = {
        name: _array(record, name, shape, url, key)
        for name, shape in [
            ("bbox", (n, 4)), ("area", (n,)), ("predicted_iou", (n,)), ("stability_score", (n,)),
            ("point_coords", (int(point_counts.sum()), 2)),
        ]
    }
    if n and point_counts.min() < 1:
        raise SampleError("every mask needs at least one point", url=url, key=key, field="point_counts")
    columns["point_counts"] = point_counts
    return {"image_id": image_id, "height": height, "width": width, "counts": counts}, columns


def _mask_error(exc: RLEError, masks: np.ndarray, url: str, key: str) -> SampleError:
    """An RLE error of the `exc.index`-th of `masks` (indices into the sample's masks), as the sample's."""
    return SampleError(f"mask {int(masks[exc.index])}: {exc}", url=url, key=key, field="counts")


def _value_problems(batch: dict[str, Any], options: Sa1bOptions, epoch: int) -> list[str]:
    """What is wrong with the values of a batch of the right keys, dtypes and shapes: NaN/Inf, ranges,
    mask counts, and padding beyond each image's masks."""
    found = []
    for name in ("boxes", "points", "areas", "predicted_ious", "stability_scores"):
        if not torch.isfinite(batch[name]).all():
            found.append(f"{name}: NaN or infinite values")
    n, s = batch["masks"].shape[1], options.image_size
    counts, limit = batch["mask_counts"].cpu(), options.masks_for(epoch)
    if counts.numel() and (counts.min() < 0 or counts.max() > min(limit, n)):
        found.append(f"mask_counts: {counts.tolist()} outside [0, min(max_masks={limit}, {n})]")
        return found
    valid = (torch.arange(n)[None, :] < counts[:, None]).to(batch["masks"].device)
    sizes = batch["image_sizes"]
    if (sizes < 1).any() or (sizes > s).any():
        found.append(f"image_sizes: {sizes.tolist()} outside [1, {s}]")
    frame = sizes.flip(1).repeat(1, 2)[:, None, :].to(batch["boxes"])  # (w, h, w, h) per image
    boxes = batch["boxes"]
    if ((boxes < 0) | (boxes > frame)).any() or (boxes[..., 2:] < boxes[..., :2]).any():
        found.append("boxes: outside the image frame or with x1 < x0 / y1 < y0")
    if ((batch["points"] < 0) | (batch["points"] > frame[..., :2])).any():
        found.append("points: outside the image frame")
    found += [f"{name}: values outside [0, 1]" for name in ("predicted_ious", "stability_scores")
              if ((batch[name] < 0) | (batch[name] > 1)).any()]
    if (batch["areas"] < 0).any():
        found.append("areas: negative values")
    for name in ("boxes", "points", "areas", "predicted_ious", "stability_scores"):
        pad = ~valid.reshape(valid.shape + (1,) * (batch[name].dim() - 2))
        if (batch[name] * pad).any():
            found.append(f"{name}: non-zero padding beyond mask_counts")
    if batch["masks"][~valid].any():
        found.append("masks: non-zero padding beyond mask_counts")
    return found + prompt_problems(batch, frame, valid)


@dataclasses.dataclass(frozen=True)
class Sa1b:
    """The SA-1B kind (`pipeline.kinds.Kind`): its options, and how its samples become batches."""

    options: Sa1bOptions
    grouped = False
    units = False  # one unit per sample: the plan orders samples
    stages = STAGES
    takes = frozenset(f.name for f in dataclasses.fields(Sa1bOptions)) - {"max_image_pixels"}  # (ReadLimits')

    @classmethod
    def of(cls, manifests: Sequence[Any], limits: Any, **options: Any) -> Sa1b:
        return cls(Sa1bOptions(max_image_pixels=limits.max_image_pixels, **options))

    @classmethod
    def for_verify(cls, manifest: Any) -> Sa1b:
        """Every mask of every sample decoded (`shard-pack verify`)."""
        return cls(Sa1bOptions(image_size=256, mask_size=64, max_masks=1 << 30))

    def open(self, members: dict[str, bytes], *, url: str, key: str, units: int) -> dict[str, bytes]:
        return members

    def depends(self, inputs: frozenset[str] | None) -> tuple[bool, frozenset[str]]:
        return depends(self.options, inputs)

    def decode(self, members: dict[str, bytes], *, unit: int = 0, seed: int, epoch: int, url: str, key: str,
               clock: Clock | None = None) -> dict[str, Any]:
        """One SA-1B sample (one unit): image in its frame, up to `max_masks` masks chosen before any is
        decoded, rasterised bit-packed (`masks_packed`: (k, h, ceil(w / 8)) uint8, as they travel), and
        the prompts the options ask for."""
        clock, options = clock or Clock(STAGES), self.options
        info, columns = _record(members, options.max_image_pixels, url, key)
        height, width, counts = info["height"], info["width"], info["counts"]
        (draw := Draw(seed, epoch, key)).make(streams(options))  # (together: see `Draw.make`)
        view = view_of(height, width, options, draw)  # (frame: the scaled image's, before any crop)
        chosen = chosen_masks(columns, (height, width), options, options.masks_for(epoch), draw)
        chosen, frame = chosen[view.visible(columns["bbox"][chosen])], view.scaled
        clock.mark()
        image = image_of(members[SA1B_JPG], view, url, key, options)
        clock.split("image")
        distinct, rows = np.unique(chosen, return_inverse=True)  # (repeats, with fill_masks, decoded once)
        try:
            parsed = parse([counts[i] for i in distinct], (height, width))  # (once: masks and points)
        except RLEError as exc:
            raise _mask_error(exc, distinct, url, key) from exc
        first_point = np.cumsum(columns["point_counts"]) - columns["point_counts"]
        shown = view.show(parsed, rows, columns["bbox"][chosen], columns["area"][chosen],
                          columns["point_coords"][first_point[chosen]])
        chosen = chosen[shown.kept]
        try:  # (all RLE valid: only a mask with no pixel has no point; drawn while the runs are in cache)
            prompts = prompts_of(shown.inside, shown.rows, shown.bbox, (height, width), frame, options, draw)
        except RLEError as exc:
            raise _mask_error(exc, chosen, url, key) from exc
        masks = masks_of(shown, view, flip := flips(options, draw), options)
        clock.split("masks")
        (h, w), (sy, sx) = frame, (frame[0] / height, frame[1] / width)
        x, y, bw, bh = shown.bbox.T
        return augmented({
            "key": key,
            "image": image,
            "masks_packed": masks,
            "boxes": np.clip(np.stack([x * sx, y * sy, (x + bw) * sx, (y + bh) * sy], 1), 0, (w, h, w, h)),
            "points": np.clip(shown.point * (sx, sy), 0, (w, h)),
            "areas": shown.area * (sx * sy),
            "predicted_ious": columns["predicted_iou"][chosen],
            "stability_scores": columns["stability_score"][chosen],
            "image_id": info["image_id"],
            "original_size": (height, width),
            "image_size": view.content,
            **prompts,
        }, view, flip)

    def collate(self, samples: Sequence[dict[str, Any]], epoch: int) -> dict[str, Any]:
        """A batch in transit (see `finish`): with pixels, square images padded with zeros, masks
        bit-packed, per-mask columns stacked and padded with zeros to the largest mask count of the
        batch, all on one buffer; with `decode_device`, what the pixels are made of (`sa1b_batch`)."""
        return collate(samples, self.options, self._mask_columns())

    def finish(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch users get, on whatever device the transit batch was moved to (with `decode_device`,
        on that one, its pixels made there): masks unpacked to bool (B, N, m, m), columns split into
        their fields."""
        return finish(batch, self.options, self._mask_columns())

    def _mask_columns(self) -> tuple[tuple[str, int], ...]:  # (per-mask columns in transit, and widths)
        return MASK_COLUMNS + prompt_columns(self.options)

    def unbatch(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """A finished batch's samples (row i of each field, same keys), each with its own `mask_counts`
        masks only: the padding to the batch's largest count is cut."""
        per_mask = ("masks", *(name for name, _ in self._mask_columns()))
        return [{name: value[i, : int(batch["mask_counts"][i])] if name in per_mask else value[i]
                 for name, value in batch.items()} for i in range(len(batch["keys"]))]

    def fields(self, epoch: int) -> tuple[BatchField, ...]:
        """A finished batch's fields: B images, N masks (the batch's largest count, zero-padded), and the
        prompts the options ask for: K points per mask (XY), a noisy box per mask (XYXY)."""
        s, m, k = self.options.image_size, self.options.mask_frame, self.options.points_per_mask
        prompts = ((BatchField("point_coords", torch.float32, ("B", "N", k, 2)),) if k else ()) + \
            ((BatchField("prompt_boxes", torch.float32, ("B", "N", 4)),) if self.options.box_noise is not None else ())
        return (
            BatchField("images", torch.uint8, ("B", 3, s, s)),
            BatchField("masks", torch.bool, ("B", "N", m, m)), BatchField("mask_counts", torch.int64, ("B",)),
            BatchField("boxes", torch.float32, ("B", "N", 4)), BatchField("points", torch.float32, ("B", "N", 2)),
            *(BatchField(name, torch.float32, ("B", "N")) for name in ("areas", "predicted_ious", "stability_scores")),
            BatchField("image_ids", torch.int64, ("B",)), BatchField("original_sizes", torch.int64, ("B", 2)),
            BatchField("image_sizes", torch.int64, ("B", 2)), BatchField("keys", list, ("B",)), *prompts,
        )

    def check(self, batch: dict[str, Any], epoch: int) -> list[str]:
        """What is wrong with a finished batch (empty if nothing): keys, dtypes and shapes (`fields`),
        then values, ranges and padding."""
        return problems(batch, self.fields(epoch)) or _value_problems(batch, self.options, epoch)


def _field(obj: Any, name: str, kind: type | tuple[type, ...], where: str, key: str, field: str) -> Any:
    value = obj.get(name) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise SampleError(f"missing or not {getattr(kind, '__name__', kind)}: {excerpt(repr(value))}",
                          url=where, key=key, field=field)
    return value


def _int64(obj: Any, name: str, where: str, key: str, field: str) -> int:
    value = _field(obj, name, int, where, key, field)
    if not -(1 << 63) <= value < 1 << 63:
        raise SampleError(f"{value} is outside the int64 range"[:200], url=where, key=key, field=field)
    return value


def _finite(value: Any) -> bool:
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # (an int too large for a float)
        return False


def _numbers(value: Any, count: int | None, where: str, key: str, field: str) -> list[float]:
    ok = isinstance(value, list) and (count is None or len(value) == count)
    if ok and all(_finite(v) for v in value):
        return [float(v) for v in value]
    raise SampleError(f"want {count or 'some'} finite numbers, got {excerpt(repr(value))}",
                      url=where, key=key, field=field)


def annotation_record(meta: Any, where: str, key: str, *,
                      every_rle: bool = True) -> tuple[dict[str, Any], int, int]:
    """Check SA-1B's per-image JSON and turn it into the stored record (RLE counts kept compressed),
    without `stored_size`; with the image's height and width. Packing and the reader of original
    archives both call it: a sample is accepted or refused alike on both sides. `every_rle=False`
    leaves the masks' RLE unchecked (the reader checks the masks it rasterizes; ~70% of the cost)."""
    record, height, width = annotation_arrays(meta, where, key, every_rle=every_rle)
    return {name: value if name in ("image", "counts") else encode_array(value) for name, value in record.items()}, \
        height, width


def annotation_arrays(meta: Any, where: str, key: str, *,
                      every_rle: bool = True) -> tuple[dict[str, Any], int, int]:
    """`annotation_record` with its columns as numpy arrays, not yet encoded (what the reader of
    original archives decodes from, with no msgpack round trip)."""
    image = _field(meta, "image", dict, where, key, "image")
    image_id = _int64(image, "image_id", where, key, "image.image_id")
    width = _field(image, "width", int, where, key, "image.width")
    height = _field(image, "height", int, where, key, "image.height")
    file_name = _field(image, "file_name", str, where, key, "image.file_name")
    if not (0 < width and 0 < height and width * height <= MAX_IMAGE_PIXELS):
        raise SampleError(f"invalid size {width}x{height}", url=where, key=key, field="image")
    annotations = _field(meta, "annotations", list, where, key, "annotations")
    columns = _fast_columns(annotations, height, width)
    if columns is None:  # (something is wrong, or unusual: the loop below names it, or accepts it)
        columns = _checked_columns(annotations, height, width, where, key)
    if every_rle:
        try:
            check(columns["counts"], (height, width))
        except RLEError as exc:
            raise SampleError(f"invalid RLE: {exc}",
                              url=where, key=key, field=f"annotations[{exc.index}].segmentation.counts") from exc
    return {"image": {"image_id": image_id, "width": width, "height": height, "file_name": file_name}, **columns}, \
        height, width


_NUMBER_COLUMNS = (("bbox", 4), ("crop_box", 4), ("area", 0), ("predicted_iou", 0), ("stability_score", 0))


def _arrays(columns: dict[str, list[Any]], n: int) -> dict[str, Any]:
    """The record's columns as arrays, in their stored dtypes and shapes."""
    return {  # (in the order packing has always written them: the packed record's bytes stay the same)
        "counts": columns["counts"],
        "ids": np.array(columns["ids"], dtype=np.int64),
        "bbox": np.array(columns["bbox"], dtype=np.float64).reshape(n, 4),
        "crop_box": np.array(columns["crop_box"], dtype=np.float64).reshape(n, 4),
        "point_coords": np.array(columns["point_coords"], dtype=np.float64).reshape(-1, 2),
        "point_counts": np.array(columns["point_counts"], dtype=np.uint32),
        **{name: np.array(columns[name], dtype=np.float64) for name in ("area", "predicted_iou", "stability_score")},
    }


def _fast_columns(annotations: list[Any], height: int, width: int) -> dict[str, Any] | None:
    """`_checked_columns` by whole columns (~5x faster): the arrays when every annotation is well
    formed, else None (then the loop checks them one by one, naming the first problem). It accepts
    only what that loop accepts (JSON values: `type() is` is `isinstance` but for bool)."""
    n = len(annotations)
    try:
        if {type(a) for a in annotations} - {dict}:
            return None
        segs = [a.get("segmentation") for a in annotations]
        if {type(s) for s in segs} - {dict} or [s.get("size") for s in segs].count([height, width]) != n:
            return None
        counts = [s.get("counts") for s in segs]
        if {type(c) for c in counts} - {str} or not "".join(counts).isascii():
            return None
        columns = {"counts": [c.encode("ascii") for c in counts], "ids": [a.get("id") for a in annotations]}
        flat = []
        for name, size in _NUMBER_COLUMNS:
            columns[name] = values = [a.get(name) for a in annotations]
            if size:
                if {type(v) for v in values} - {list} or {len(v) for v in values} - {size}:
                    return None
                values = [x for v in values for x in v]
            flat += values
        points = [a.get("point_coords") for a in annotations]
        if {type(p) for p in points} - {list} or [] in points:
            return None
        columns["point_coords"] = pairs = [xy for p in points for xy in p]
        if {type(xy) for xy in pairs} - {list} or {len(xy) for xy in pairs} - {2}:
            return None
        flat += [v for xy in pairs for v in xy]
        if {type(i) for i in columns["ids"]} - {int} or {type(v) for v in flat} - {int, float} or \
                not np.isfinite(np.array(flat, dtype=np.float64)).all():
            return None
        columns["point_counts"] = [len(p) for p in points]
        return _arrays(columns, n)
    except (OverflowError, ValueError):  # (an int too large for a float or an int64: the loop's to name)
        return None


def _checked_columns(annotations: list[Any], height: int, width: int, where: str, key: str) -> dict[str, Any]:
    """The record's columns, each annotation checked in turn: the first problem named."""
    columns: dict[str, list[Any]] = {n: [] for n in ("counts", "ids", "bbox", "area", "predicted_iou",
                                                      "stability_score", "point_coords", "point_counts", "crop_box")}
    for i, ann in enumerate(annotations):
        at = f"annotations[{i}]"
        seg = _field(ann, "segmentation", dict, where, key, f"{at}.segmentation")
        size = seg.get("size")
        if size != [height, width]:
            raise SampleError(f"RLE size {excerpt(repr(size))} disagrees with the image's [{height}, {width}]",
                              url=where, key=key, field=f"{at}.segmentation.size")
        counts = _field(seg, "counts", str, where, key, f"{at}.segmentation.counts")
        if not counts.isascii():
            raise SampleError("not an ASCII COCO RLE string", url=where, key=key, field=f"{at}.segmentation.counts")
        columns["counts"].append(counts.encode("ascii"))
        columns["ids"].append(_int64(ann, "id", where, key, f"{at}.id"))
        columns["bbox"].append(_numbers(ann.get("bbox"), 4, where, key, f"{at}.bbox"))
        columns["crop_box"].append(_numbers(ann.get("crop_box"), 4, where, key, f"{at}.crop_box"))
        for name in ("area", "predicted_iou", "stability_score"):
            columns[name] += _numbers([ann.get(name)], 1, where, key, f"{at}.{name}")
        points = ann.get("point_coords")
        if not isinstance(points, list) or not points:
            raise SampleError(f"want a non-empty list of [x, y], got {excerpt(repr(points))}",
                              url=where, key=key, field=f"{at}.point_coords")
        columns["point_coords"] += [_numbers(p, 2, where, key, f"{at}.point_coords") for p in points]
        columns["point_counts"].append(len(points))
    return _arrays(columns, len(annotations))


def original_record(members: dict[str, Any], url: str, key: str) -> dict[str, Any]:
    """An original SA-1B sample's (`jpg` + `json`, as Meta ships it) record, its columns as arrays:
    its JSON parsed within size and nesting limits and checked by `annotation_arrays`, as packing
    checks it (but for the RLE of masks `Sa1b.decode` does not rasterize: it checks those it does)."""
    if set(members) != {SA1B_JPG, SA1B_JSON}:
        raise SampleError(f"members {sorted(members)}, expected {[SA1B_JPG, SA1B_JSON]}", url=url, key=key)
    try:
        meta = parse_json(members[SA1B_JSON])
    except ValueError as exc:
        raise SampleError(f"invalid JSON: {exc}"[:300], url=url, key=key, field=SA1B_JSON) from exc
    record, height, width = annotation_arrays(meta, url, key, every_rle=False)  # (`shard-pack index` checked them all)
    record["stored_size"] = [height, width]  # (the JPEG's size: `shard-pack index` checked it against the JSON's)
    return record
