"""SA-1B batches in transit and finished (`Sa1b.collate`, `Sa1b.finish`), with pixels or without.

In transit a batch is a few tensors on one buffer, not one per field (each tensor costs a
shared-memory file and a socket message between processes): per-mask columns and per-image integers
travel stacked. As the CPU path makes it, it holds the pixels: images zero-padded, masks bit-packed.
With `decode_device` ("cpu" or "cuda", issue 41) the workers do everything but pixels, and the batch
holds what the pixels are made of instead, a few KB a sample where the pixels are MBs: each JPEG's
bytes (its header checked in the worker), where its image lands (`device.Placement`: the view's frame,
crop and flip), and the chosen masks' COCO runs with the original rows and columns each is sampled at.
`finish` then makes the pixels on that device (`pipeline.device`): the same batch as the CPU path's
(keys, dtypes, layout, masks bit for bit), its images within the decoders' IDCT of it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from pipeline.collate import empty, padded_images, unpack_bits
from pipeline.device import Placement, decode_jpegs, place, run_raster
from pipeline.errors import ConfigError
from pipeline.format import column_offsets, storage_dtype
from pipeline.images import decode_image, open_image
from pipeline.rle import Runs, bits_at

__all__ = ["MASK_COLUMNS", "DECODE_DEVICES", "check_decode_device", "Jpeg", "MaskRuns", "image_of", "masks_of",
           "collate", "finish"]

MASK_COLUMNS = (("boxes", 4), ("points", 2), ("areas", 1), ("predicted_ious", 1), ("stability_scores", 1))
_IMAGE_COLUMNS = (("mask_counts", 1), ("image_ids", 1), ("original_sizes", 2), ("image_sizes", 2))
DECODE_DEVICES = ("cpu", "cuda")
# Per image, with `decode_device`: the JPEG's bytes, its masks (distinct) and their runs, the original
# size, then its `Placement`, and the mask rows and columns sampled.
_VIEW = ("jpeg_bytes", "masks", "runs", "height", "width", "scaled_h", "scaled_w", "offset_y", "offset_x",
         "content_h", "content_w", "mirrored", "mask_h", "mask_w")


def check_decode_device(options: Any) -> None:
    """Refuse a `decode_device` other than None, "cpu" or "cuda" (or "cuda:N"), naming it; "cuda" where
    torch sees no GPU; or with `max_image_pixels` too large for a run length of int32."""
    value = options.decode_device
    try:
        ok = value is None or isinstance(value, str) and torch.device(value).type in DECODE_DEVICES
    except RuntimeError:
        ok = False
    if not ok:
        raise ConfigError(f"decode_device must be None (pixels made in the workers), 'cpu' or 'cuda' (made by "
                          f"the loader's device stage), got {value!r}")
    if value is not None and torch.device(value).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"decode_device={value!r} but CUDA is not available (torch {torch.__version__}, CUDA "
                          f"build: {torch.version.cuda or 'no'}); use decode_device='cpu' or None")
    if value is not None and options.max_image_pixels >= 1 << 31:
        raise ConfigError(f"decode_device sends masks' run lengths as int32: max_image_pixels must be under 2**31, "
                          f"got {options.max_image_pixels}")


@dataclasses.dataclass(frozen=True)
class Jpeg:
    """An image the device stage decodes: its JPEG's bytes, where it lands, and the shard it is of."""

    data: np.ndarray  # uint8: a copy (the member may be a view of a mapped shard, released after decoding)
    placement: Placement
    url: str


@dataclasses.dataclass(frozen=True)
class MaskRuns:
    """The chosen masks the device stage rasterises: the distinct masks parsed (whole), each chosen
    mask's index among them, and the original rows and columns sampled (the batch says whether mirrored)."""

    masks: Runs
    rows: np.ndarray
    ys: np.ndarray
    xs: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


def image_of(data: bytes | memoryview, view: Any, url: str, key: str, options: Any) -> torch.Tensor | Jpeg:
    """A sample's image: decoded in its view (`sa1b_augment.View`), or with `decode_device` its JPEG
    as it is, its header checked (a JPEG, within `max_image_pixels`)."""
    if options.decode_device is None:
        return view.image(decode_image(data, view.scaled, url, key, options.max_image_pixels))
    open_image(data, ("JPEG",), url, key, "jpg", options.max_image_pixels).close()
    return Jpeg(np.frombuffer(data, np.uint8).copy(), Placement(view.scaled, view.offset, view.content), url)


def masks_of(shown: Any, view: Any, flip: bool, options: Any) -> np.ndarray | MaskRuns:
    """The chosen masks shown (`sa1b_augment.Shown`), one per row: rasterised bit-packed at the view's
    rows and columns (mirrored with `flip`), or with `decode_device` their runs, to rasterise so."""
    if options.decode_device is None:
        masks = bits_at(shown.masks, view.rows, view.cols, mirrored=flip)
        return masks if len(shown.masks) == len(shown.rows) else masks[shown.rows]
    return MaskRuns(shown.masks, shown.rows, view.rows, view.cols)


def _on_one_buffer(layout: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Tensors of (name, dtype, shape) on one buffer (`empty`'s: in a worker, one lease, no file per batch)."""
    offsets, total = column_offsets(layout)
    flat = empty((total,), torch.uint8)
    batch = {}
    for (name, dtype, shape), offset in zip(layout, offsets):
        nbytes = math.prod(shape) * storage_dtype(dtype).itemsize
        batch[name] = flat[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)
    return batch


def _columns(samples: Sequence[dict[str, Any]], mask_columns: tuple[tuple[str, int], ...]) -> list[tuple]:
    """The layout of the per-mask columns and per-image integers, to the batch's largest mask count."""
    n = max(len(x["masks_packed"]) for x in samples)
    return [("columns", "float32", (len(samples), n, sum(width for _, width in mask_columns))),
            ("info", "int64", (len(samples), sum(width for _, width in _IMAGE_COLUMNS)))]


def _fill_columns(batch: dict[str, Any], samples: Sequence[dict[str, Any]],
                  mask_columns: tuple[tuple[str, int], ...]) -> None:
    """Per-mask columns stacked, zero-padded; per-image integers; the keys."""
    columns = batch["columns"].zero_()
    batch["info"].copy_(torch.tensor([[len(x["masks_packed"]), x["image_id"], *x["original_size"],
                                       *x["image_size"]] for x in samples], dtype=torch.int64))
    for i, x in enumerate(samples):
        c = len(x["masks_packed"])
        stacked = np.concatenate([np.reshape(x[name], (c, width)) for name, width in mask_columns], 1)
        columns[i, :c] = torch.from_numpy(stacked.astype(np.float32))
    batch["keys"] = [x["key"] for x in samples]


def collate(samples: Sequence[dict[str, Any]], options: Any, mask_columns: tuple[tuple[str, int], ...]) -> dict:
    """A batch in transit: with pixels (square images zero-padded, masks bit-packed and zero-padded to
    the batch's largest mask count), or with `decode_device` what they are made of (`_compressed`)."""
    if options.decode_device is not None:
        return _compressed(samples, options, mask_columns)
    b, s, m = len(samples), options.image_size, options.mask_frame
    n = max(len(x["masks_packed"]) for x in samples)
    batch = _on_one_buffer([("images", "uint8", (b, 3, s, s)), ("masks_packed", "uint8", (b, n, m, -(-m // 8))),
                            *_columns(samples, mask_columns)])
    padded_images([x["image"] for x in samples], s, s, batch["images"], [x.get("mirrored", False) for x in samples])
    masks = batch["masks_packed"].zero_()
    for i, x in enumerate(samples):
        c, mh, mb = x["masks_packed"].shape
        masks[i, :c, :mh, :mb] = torch.from_numpy(x["masks_packed"])
    _fill_columns(batch, samples, mask_columns)
    return batch


def _compressed(samples: Sequence[dict[str, Any]], options: Any, mask_columns: tuple[tuple[str, int], ...]) -> dict:
    """A batch in transit without pixels: the JPEGs' bytes and the masks' runs, each image's `_VIEW`,
    each chosen mask's index among its image's masks (`rows`), the rows and columns each image's masks
    are sampled at (`indices`: (B, 2, mask frame))."""
    b, m = len(samples), options.mask_frame
    jpegs, masks = [x["image"] for x in samples], [x["masks_packed"] for x in samples]
    n = max(len(x) for x in masks)
    batch = _on_one_buffer([("jpegs", "uint8", (sum(len(j.data) for j in jpegs),)),
                            ("runs", "int32", (sum(len(x.masks.runs) for x in masks),)),
                            ("runs_per", "int64", (sum(len(x.masks) for x in masks),)),
                            ("views", "int64", (b, len(_VIEW))), ("rows", "int64", (b, n)),
                            ("indices", "int64", (b, 2, m)), *_columns(samples, mask_columns)])
    torch.cat([torch.from_numpy(j.data) for j in jpegs], out=batch["jpegs"])
    torch.cat([torch.from_numpy(x.masks.runs.astype(np.int32)) for x in masks], out=batch["runs"])
    torch.cat([torch.from_numpy(x.masks.runs_per) for x in masks], out=batch["runs_per"])
    batch["rows"].zero_()
    batch["indices"].zero_()
    for i, (jpeg, x, sample) in enumerate(zip(jpegs, masks, samples)):
        p = jpeg.placement
        batch["views"][i] = torch.tensor([len(jpeg.data), len(x.masks), len(x.masks.runs), *x.masks.size, *p.scaled,
                                          *p.offset, *p.content, sample.get("mirrored", False), len(x.ys), len(x.xs)])
        batch["rows"][i, : len(x)] = torch.from_numpy(x.rows)
        batch["indices"][i, 0, : len(x.ys)], batch["indices"][i, 1, : len(x.xs)] = \
            torch.from_numpy(x.ys), torch.from_numpy(x.xs)
    _fill_columns(batch, samples, mask_columns)
    batch["urls"] = [j.url for j in jpegs]
    return batch


def _split(stacked: torch.Tensor, layout: tuple[tuple[str, int], ...]) -> dict[str, torch.Tensor]:
    parts = stacked.split([width for _, width in layout], dim=-1)
    return {name: (part if width > 1 else part.squeeze(-1)).contiguous() for (name, width), part in zip(layout, parts)}


def finish(batch: dict[str, Any], options: Any, mask_columns: tuple[tuple[str, int], ...]) -> dict[str, Any]:
    """The batch users get: masks unpacked to bool (B, N, m, m), columns split into their fields; with
    `decode_device`, its images and masks made there (`_pixels`) and the batch on that device."""
    if options.decode_device is None:
        pixels = {"images": batch["images"], "masks": unpack_bits(batch["masks_packed"], options.mask_frame)}
        device = batch["columns"].device
    else:
        device = _decode_device(options)
        pixels = _pixels(batch, device, options)
    finished = {
        **pixels,
        **_split(batch["columns"].to(device), mask_columns),
        **_split(batch["info"].to(device), _IMAGE_COLUMNS),
        "keys": batch["keys"],
    }
    if "point_coords" in finished:  # (B, N, 2K) in transit: (B, N, K, 2)
        finished["point_coords"] = finished["point_coords"].unflatten(-1, (options.points_per_mask, 2))
    return finished


def _decode_device(options: Any) -> torch.device:
    """`decode_device`, "cuda" as the current device (under DDP each rank's own, `torch.cuda.set_device`)."""
    device = torch.device(options.decode_device)
    if device.type == "cuda" and get_worker_info() is not None:
        raise ConfigError("decode_device='cuda' makes pixels in the main process (make_stream_loader's device "
                          "stage), not in a DataLoader worker: use decode_device='cpu' or None here")
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


def _pixels(batch: dict[str, Any], device: torch.device, options: Any) -> dict[str, torch.Tensor]:
    """The batch's images (B, 3, s, s) uint8 and masks (B, N, m, m) bool, made on `decode_device` from
    the JPEGs and runs in transit, as the workers would have made them."""
    views = [dict(zip(_VIEW, row)) for row in batch["views"].tolist()]
    b, n, s, m = len(views), batch["rows"].shape[1], options.image_size, options.mask_frame
    jpegs = batch["jpegs"].cpu().split([v["jpeg_bytes"] for v in views])  # (nvJPEG reads them from the host)
    decoded = decode_jpegs(jpegs, device, list(zip(batch["urls"], batch["keys"])), options.max_image_pixels)
    images = torch.empty((b, 3, s, s), dtype=torch.uint8, device=device)
    masks = torch.zeros((b, n, m, m), dtype=torch.bool, device=device)
    runs = batch["runs"].to(device).split([v["runs"] for v in views])
    runs_per = batch["runs_per"].to(device).split([v["masks"] for v in views])
    rows, indices = batch["rows"].to(device), batch["indices"].to(device)
    counts = batch["info"][:, 0].tolist()
    for i, v in enumerate(views):
        place(decoded[i], Placement((v["scaled_h"], v["scaled_w"]), (v["offset_y"], v["offset_x"]),
                                    (v["content_h"], v["content_w"]), bool(v["mirrored"])), images[i])
        h, w, c = v["mask_h"], v["mask_w"], counts[i]
        raster = run_raster(runs[i], runs_per[i], (v["height"], v["width"]), indices[i, 0, :h], indices[i, 1, :w],
                            bool(v["mirrored"]))
        masks[i, :c, :h, :w] = raster[rows[i, :c]]
    return {"images": images, "masks": masks}
