"""`shard-pack preview`: a picture of a split's first decoded samples exactly as the loader yields
them, to check geometry and decoding by eye before a long run.

- SA-1B: each image cropped to its frame (`image_sizes`: the zero padding cut away), its masks
  scaled from the mask frame into it by the loader's own nearest rule, each in its own colour
  (smaller masks over larger ones) at `ALPHA` opacity, and each mask's box outlined in that colour.
- VQA: each image with its question and answer written under it.
- Embeddings: a table of the fields over the batch's rows: dtype and shape, min, mean, max, and
  a histogram.
Tiles are scaled to a long side of `tile` pixels.
"""

from __future__ import annotations

import colorsys
import dataclasses
import os
import pathlib
import textwrap
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from pipeline import make_stream_loader, validate_first_batch
from pipeline.rle import fit, nearest_index
from pipeline.storage import read_manifest

__all__ = ["ALPHA", "BACKGROUND", "Preview", "mask_colours", "preview", "write_png"]

ALPHA = 0.5  # masks' opacity over the image
BACKGROUND = (24, 24, 24)
_TEXT = (235, 235, 235)
_PAD = 6


@dataclasses.dataclass(frozen=True)
class Preview:
    """The picture, the keys shown (embeddings: the rows), and where each sample's picture lies in
    it: (left, top, width, height), empty for embeddings."""

    image: Image.Image
    keys: tuple[str, ...]
    frames: tuple[tuple[int, int, int, int], ...]


def mask_colours(n: int) -> list[tuple[int, int, int]]:
    """n distinct saturated colours (hues a golden-ratio step apart)."""
    return [tuple(round(255 * c) for c in colorsys.hsv_to_rgb((i * 0.618034) % 1.0, 0.85, 1.0)) for i in range(n)]


def preview(source: str, split: str, *, n: int = 8, seed: int = 0, tile: int = 256, columns: int = 4,
            options: dict[str, Any] | None = None, storage_options: dict[str, Any] | None = None,
            allowed_roots: Sequence[str] = ()) -> Preview:
    """The first `n` samples of `split` (shuffled by `seed`), decoded with the kind's `options`
    as `make_stream_loader` does and checked by `validate_first_batch`, drawn in a grid.
    `storage_options` and `allowed_roots` as the loader's (fsspec's options, e.g. an s3 endpoint and
    credentials; places outside the folder its manifest may name)."""
    if n < 1 or tile < 16 or columns < 1:
        raise ValueError(f"n must be >= 1, tile >= 16 and columns >= 1, got {n}, {tile}, {columns}")
    kind = read_manifest(source, storage_options).kind
    loader = make_stream_loader(source, split, batch_size=n, num_workers=0, seed=seed, drop_last=False,
                                storage_options=storage_options, allowed_roots=allowed_roots, **(options or {}))
    batch = validate_first_batch(loader)
    if kind == "embeddings":
        return _embeddings(batch)
    tiles = _TILES[kind](batch, tile)
    return _grid(tiles, list(batch["keys"]), tile, columns)


def write_png(image: Image.Image, path: str | os.PathLike[str]) -> None:
    """Write `image` as PNG at `path` atomically (a temporary file beside it, then a rename), with the
    mode the user's umask gives a new file (mkstemp's would be 0600)."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            image.save(f, format="PNG")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default()


def _picture(image: torch.Tensor, size: torch.Tensor, tile: int) -> Image.Image:
    """A (3, S, S) image cut to its (h, w) frame and scaled to long side `tile`."""
    h, w = size.tolist()
    th, tw = fit(h, w, tile)
    return Image.fromarray(image[:, :h, :w].permute(1, 2, 0).cpu().numpy()).resize((tw, th), Image.Resampling.BILINEAR)


def _sa1b_tiles(batch: dict[str, Any], tile: int) -> list[tuple[Image.Image, list[str]]]:
    tiles, m = [], batch["masks"].shape[-1]
    for i in range(len(batch["keys"])):
        picture = _picture(batch["images"][i], batch["image_sizes"][i], tile)
        (h, w), (tw, th) = batch["image_sizes"][i].tolist(), picture.size
        mh, mw = fit(*batch["original_sizes"][i].tolist(), m)  # the mask frame
        rows, cols = nearest_index(mh, th), nearest_index(mw, tw)
        count = int(batch["mask_counts"][i])
        colours = mask_colours(count)
        paint, covered = np.zeros((th, tw, 3), np.float32), np.zeros((th, tw), bool)
        for j in np.argsort(-batch["areas"][i, :count].cpu().numpy(), kind="stable"):  # smaller masks on top
            inside = batch["masks"][i, j, :mh, :mw].cpu().numpy()[rows][:, cols]
            paint[inside], covered = colours[j], covered | inside
        pixels = np.asarray(picture, dtype=np.float32).copy()
        pixels[covered] = (1 - ALPHA) * pixels[covered] + ALPHA * paint[covered]
        picture = Image.fromarray(pixels.round().astype(np.uint8))
        draw = ImageDraw.Draw(picture)
        for j, (x0, y0, x1, y1) in enumerate(batch["boxes"][i, :count].tolist()):
            box = [round(x0 * tw / w), round(y0 * th / h), round(x1 * tw / w) - 1, round(y1 * th / h) - 1]
            draw.rectangle([box[0], box[1], max(box[0], box[2]), max(box[1], box[3])], outline=colours[j])
        size = "x".join(map(str, batch["original_sizes"][i].tolist()))
        tiles.append((picture, _wrap(str(batch["keys"][i]), tile, 1) + [f"{count} masks, original {size}"]))
    return tiles


def _vqa_tiles(batch: dict[str, Any], tile: int) -> list[tuple[Image.Image, list[str]]]:
    tiles = []
    for i in range(len(batch["keys"])):
        questions, answers = batch["questions"][i], batch["answers"][i]
        pairs = list(zip(questions, answers))[:3] if isinstance(questions, list) else [(questions, answers)]
        text = _wrap(str(batch["keys"][i]), tile, 1)
        for question, answer in pairs:
            text += _wrap(f"Q: {question}", tile) + _wrap(f"A: {answer}", tile)
        tiles.append((_picture(batch["images"][i], batch["image_sizes"][i], tile), text))
    return tiles


_TILES: dict[str, Callable[[dict[str, Any], int], list[tuple[Image.Image, list[str]]]]] = {
    "sa1b": _sa1b_tiles, "vqa": _vqa_tiles,
}


def _wrap(text: str, width: int, max_lines: int = 4) -> list[str]:
    """`text` wrapped to `width` pixels (at most `max_lines`, the last cut with an ellipsis)."""
    chars = max(8, int(width / max(_font().getlength("n"), 1)))
    lines = textwrap.wrap(" ".join(text.split()), chars) or [""]
    return lines if len(lines) <= max_lines else lines[: max_lines - 1] + [lines[max_lines - 1][: chars - 1] + "…"]


def _line_height() -> int:
    box = _font().getbbox("Ag")
    return box[3] - box[1] + 3


def _grid(tiles: list[tuple[Image.Image, list[str]]], keys: list[str], tile: int, columns: int) -> Preview:
    """Tiles in rows of `columns`, each picture at its cell's top left with its text under it."""
    columns = min(columns, len(tiles))
    text_h = max(len(text) for _, text in tiles) * _line_height()
    cell_w, cell_h = tile + 2 * _PAD, tile + text_h + 3 * _PAD
    rows = -(-len(tiles) // columns)
    image = Image.new("RGB", (columns * cell_w, rows * cell_h), BACKGROUND)
    draw, frames = ImageDraw.Draw(image), []
    for i, (picture, text) in enumerate(tiles):
        left, top = (i % columns) * cell_w + _PAD, (i // columns) * cell_h + _PAD
        image.paste(picture, (left, top))
        frames.append((left, top, *picture.size))
        for k, line in enumerate(text):
            draw.text((left, top + tile + _PAD + k * _line_height()), line, fill=_TEXT, font=_font())
    return Preview(image, tuple(keys), tuple(frames))


def _embeddings(batch: dict[str, torch.Tensor], bins: int = 32) -> Preview:
    """A row per field: dtype and per-row shape, min, mean, max over the batch, and a histogram."""
    line, hist_w = _line_height(), 4 * bins
    names = [name for name in batch if name != "row"]
    columns = [_PAD, 170, 330, 420, 510, 600]
    image = Image.new("RGB", (columns[-1] + hist_w + _PAD, (len(names) + 2) * (line + 4) + _PAD), BACKGROUND)
    draw = ImageDraw.Draw(image)
    rows = [str(r) for r in batch["row"].tolist()]
    draw.text((_PAD, _PAD), f"{len(rows)} rows: " + ", ".join(rows[:12]) + (" ..." if len(rows) > 12 else ""),
              fill=_TEXT, font=_font())
    for x, head in zip(columns, ("field", "dtype (per row)", "min", "mean", "max", "histogram")):
        draw.text((x, _PAD + line + 4), head, fill=_TEXT, font=_font())
    for k, name in enumerate(names):
        y = _PAD + (k + 2) * (line + 4)
        values = batch[name].detach().cpu().to(torch.float64).flatten().numpy()
        low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
        cells = [name, f"{str(batch[name].dtype).removeprefix('torch.')} {tuple(batch[name].shape[1:])}",
                 f"{low:.4g}", f"{values.mean() if values.size else 0.0:.4g}", f"{high:.4g}"]
        for x, cell in zip(columns, cells):
            draw.text((x, y), cell, fill=_TEXT, font=_font())
        counts, _ = np.histogram(values, bins=bins, range=(low, high if high > low else low + 1))
        for b, c in enumerate(counts):
            bar = round(line * c / max(counts.max(), 1))
            draw.rectangle([columns[-1] + 4 * b, y + line - bar, columns[-1] + 4 * b + 2, y + line], fill=(90, 170, 250))
    return Preview(image, tuple(rows), ())
