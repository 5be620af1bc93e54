"""The last stage: move batches to the device, the next batch's copy overlapping the current step; and
the pixel work a device stage does there, in torch, the same code on "cpu" and "cuda" tensors: masks
rasterised from their COCO runs, JPEGs decoded, resized with antialiasing, cropped and mirrored into a
padded canvas.

Masks (`run_raster`), as `pipeline.rle` makes them on the CPU: each output pixel samples one source
pixel (`rle.nearest_index`'s or `rle.affine_index`'s rule), and the sampled pixels' column-major
indices are sorted, so each run covers a contiguous slice of the output. One search of every run's
end among the sampled indices gives the slices, and a cumulative count of the runs ended before each
output pixel its run (odd runs are 1s), all of a sample's masks at once: O(runs x log pixels + pixels),
no full-size raster, and no host synchronisation on a GPU. The same masks as `rle.bits_at`,
bit for bit (tests/test_device.py).

Images: on a CUDA device the batch's JPEGs are decoded in one call (torchvision's nvJPEG `decode_jpeg`,
imported only then: PyPI's torchvision is built for CUDA torch and does not load beside a CPU build); on
the CPU, and for what nvJPEG refuses, by `images.decode_image` at full scale. `resized` then filters them
to the frame as the CPU path does (antialiased bilinear): on the CPU by the CPU path's uint8 kernel, on
CUDA in float32, which its kernel needs: within a level of the uint8 kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.images import MAX_IMAGE_PIXELS, decode_image

__all__ = ["to_device", "prefetch_to_cuda", "run_raster", "decode_jpegs", "resized", "Placement",
           "place"]


def run_raster(runs: torch.Tensor, runs_per: torch.Tensor, size: tuple[int, int], ys: torch.Tensor,
               xs: torch.Tensor, mirrored: bool = False) -> torch.Tensor:
    """Masks (k, len(ys), len(xs)) bool, on the runs' device: k masks of `size` (H, W), their run lengths
    (column-major, 0s first, alternating) concatenated in `runs`, `runs_per[i]` of them mask i's, each
    mask's covering H x W pixels (as `rle.parse` checked them), sampled at source rows `ys` and columns
    `xs` (non-decreasing, as `rle.nearest_index` and `rle.affine_index` give them); with `mirrored`, the
    columns in reverse order. Equals `rle.bits_at(parsed, ys, xs, mirrored)` unpacked."""
    (height, width), device = size, runs.device
    k, h, w = len(runs_per), len(ys), len(xs)
    if not (k and h and w):
        return torch.zeros((k, h, w), dtype=torch.bool, device=device)
    runs_per = runs_per.to(torch.int64)
    first = torch.cumsum(runs_per, 0) - runs_per
    ends = torch.cumsum(runs.to(torch.int64), 0)  # (over all masks: mask i's pixels are [i, i + 1) x H x W)
    xs, ys = xs.to(torch.int64), ys.to(torch.int64)
    repeat = torch.zeros(w, dtype=torch.bool, device=device)  # a column sampled again (a frame wider than W)
    repeat[1:] = xs[1:] == xs[:-1]
    first_of = torch.cummax(torch.where(repeat, 0, torch.arange(w, device=device)), 0).values
    sampled = xs[:, None] * height + ys[None, :]
    sampled = torch.where(repeat[:, None], sampled[:, -1:], sampled).flatten()  # sorted: repeats copied below
    mask, pixel = ends.div(height * width, rounding_mode="floor"), ends.remainder(height * width)
    before = mask * (h * w) + torch.searchsorted(sampled, pixel)  # output pixels before each run's end
    ended = torch.zeros(k * h * w + 1, dtype=torch.int32, device=device)
    ended.index_add_(0, before, torch.ones_like(before, dtype=torch.int32))
    # An output pixel's run, within its mask: the mask's runs ended at or before it. Odd runs are 1s.
    count = torch.cumsum(ended[:-1], 0, dtype=torch.int32).view(k, h * w).sub_(first[:, None].to(torch.int32))
    masks = count.bitwise_and_(1).bool().view(k, w, h)[:, first_of].transpose(1, 2)
    return masks.flip(-1) if mirrored else masks


def decode_jpegs(data: Sequence[torch.Tensor], device: torch.device, where: Sequence[tuple[str, str]],
                 max_pixels: int = MAX_IMAGE_PIXELS) -> list[torch.Tensor]:
    """Each JPEG (a 1-D uint8 CPU tensor of its bytes) as (3, h, w) uint8 RGB on `device`, at its stored
    size. `where` names each one's (url, key): one that cannot be decoded raises `SampleError` naming it."""
    device = torch.device(device)
    decoded = _nvjpeg(data, device) if device.type == "cuda" else [None] * len(data)
    return [image if image is not None else
            decode_image(bytes(jpeg.numpy()), None, url, key, max_pixels).to(device)
            for image, jpeg, (url, key) in zip(decoded, data, where)]


def _nvjpeg(data: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """The JPEGs decoded on the GPU in one batched call; one it refuses (CMYK, damage: the batch's call
    fails, then each is tried alone) is None, for the CPU decoder to take or name."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as exc:
        raise ImportError(f"JPEGs decoded on a CUDA device need torchvision's nvJPEG ({exc}): pip install the "
                          "torchvision built for your torch (0.28 for torch 2.13)") from exc
    try:
        return list(decode_jpeg(list(data), mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        pass
    decoded: list[torch.Tensor | None] = []
    for jpeg in data:
        try:
            decoded.append(decode_jpeg(jpeg, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            decoded.append(None)
    return decoded


def resized(pixels: torch.Tensor, frame: tuple[int, int], in_float: bool | None = None) -> torch.Tensor:
    """(3, h, w) uint8 at `frame` (h, w) by antialiased bilinear filtering (`images.decode_image`'s), as
    it is when already at `frame`. On the CPU torch's uint8 kernel (the CPU path's); on CUDA, whose
    kernel takes no uint8 (or with `in_float`), in float32, rounded: within a level of it."""
    if tuple(pixels.shape[1:]) == tuple(frame):
        return pixels
    if not (pixels.is_cuda if in_float is None else in_float):
        return F.interpolate(pixels[None], size=tuple(frame), mode="bilinear", antialias=True, align_corners=False)[0]
    scaled = F.interpolate(pixels[None].float(), size=tuple(frame), mode="bilinear", antialias=True,
                           align_corners=False)[0]
    return scaled.round_().clamp_(0, 255).to(torch.uint8)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where an image lands in its canvas: resized to `scaled` (h, w), read from `offset` (y, x) on, its
    `content` (h, w) at the canvas's top left (the rest zeros), mirrored left to right with `mirrored`."""

    scaled: tuple[int, int]
    offset: tuple[int, int]
    content: tuple[int, int]
    mirrored: bool = False


def place(pixels: torch.Tensor, placement: Placement, out: torch.Tensor) -> None:
    """Write the image (3, h, w) uint8, as stored, into its canvas `out` (3, s, s), as `placement` says."""
    (oy, ox), (h, w) = placement.offset, placement.content
    content = resized(pixels, placement.scaled)[:, oy : oy + h, ox : ox + w]
    out[:, :h, :w] = content.flip(-1) if placement.mirrored else content
    out[:, h:] = 0
    out[:, :h, w:] = 0


def to_device(batch: dict[str, Any], device: torch.device, non_blocking: bool = False) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def prefetch_to_cuda(batches: Iterator[dict[str, Any]], device: torch.device,
                     finish: Callable[[dict[str, Any]], dict[str, Any]] = lambda batch: batch,
                     ) -> Iterator[dict[str, Any]]:
    """Copy each (pinned) batch, and `finish` it there (the kind's: with `decode_device`, its pixel
    work), on a side stream one batch ahead, while the step before runs; the consumer's stream waits
    only for it (anything `finish` reads back to the host waits for the side stream alone)."""
    stream = torch.cuda.Stream(device)

    def issue(batch: dict[str, Any]) -> tuple[dict[str, Any], torch.cuda.Event]:
        with torch.cuda.stream(stream):
            finished = finish(to_device(batch, device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(stream)
        return finished, done

    def ready(pending: tuple[dict[str, Any], torch.cuda.Event]) -> dict[str, Any]:
        finished, done = pending
        current = torch.cuda.current_stream(device)
        current.wait_event(done)
        for value in finished.values():
            for tensor in value if isinstance(value, list) else (value,):
                if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                    tensor.record_stream(current)  # memory made on `stream`, used on `current`
        return finished

    pending = None
    for batch in batches:
        issued = issue(batch)
        if pending is not None:
            yield ready(pending)
        pending = issued
    if pending is not None:
        yield ready(pending)
