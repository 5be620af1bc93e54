"""What a kind hands `shard-pack preview` (`Drawing`: how to draw a decoded batch), and the drawing
pieces kinds share: the `Preview` picture, colours, text, a sample's image cut to its frame, and
a grid of tiles."""

from __future__ import annotations

import colorsys
import dataclasses
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image, ImageDraw, ImageFont

from pipeline.rle import fit

__all__ = ["ALPHA", "BACKGROUND", "PAD", "TEXT", "Drawing", "Preview", "Tiles", "font", "grid", "line_height",
           "mask_colours", "picture", "tiled", "wrap"]

ALPHA = 0.5  # masks' opacity over the image
BACKGROUND = (24, 24, 24)
TEXT = (235, 235, 235)
PAD = 6
Tiles = list[tuple[Image.Image, list[str]]]  # each sample's picture and the lines of text under it


@dataclasses.dataclass(frozen=True)
class Preview:
    """The picture, the keys shown (embeddings: the rows), and where each sample's picture lies in
    it: (left, top, width, height), empty for embeddings."""

    image: Image.Image
    keys: tuple[str, ...]
    frames: tuple[tuple[int, int, int, int], ...]


@dataclasses.dataclass(frozen=True)
class Drawing:
    """A kind that `preview` can draw: `draw(batch, tile, columns)` -> the picture of a batch as the
    loader yields it (tiles of `tile` pixels, `columns` a row); `shows`: what it draws, as
    `preview`'s help says it ("KIND: what")."""

    draw: Callable[[dict[str, Any], int, int], Preview]
    shows: str


def tiled(tiles: Callable[[dict[str, Any], int], Tiles]) -> Callable[[dict[str, Any], int, int], Preview]:
    """A kind's `draw` from its `tiles(batch, tile)`: the tiles in a grid, under the batch's keys."""
    def draw(batch: dict[str, Any], tile: int, columns: int) -> Preview:
        return grid(tiles(batch, tile), list(batch["keys"]), tile, columns)
    return draw


def mask_colours(n: int) -> list[tuple[int, int, int]]:
    """n distinct saturated colours (hues a golden-ratio step apart)."""
    return [tuple(round(255 * c) for c in colorsys.hsv_to_rgb((i * 0.618034) % 1.0, 0.85, 1.0)) for i in range(n)]


def font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default()


def picture(image: torch.Tensor, size: torch.Tensor, tile: int) -> Image.Image:
    """A (3, S, S) image cut to its (h, w) frame and scaled to long side `tile`."""
    h, w = size.tolist()
    th, tw = fit(h, w, tile)
    return Image.fromarray(image[:, :h, :w].permute(1, 2, 0).cpu().numpy()).resize((tw, th), Image.Resampling.BILINEAR)


def wrap(text: str, width: int, max_lines: int = 4) -> list[str]:
    """`text` wrapped to `width` pixels (at most `max_lines`, the last cut with an ellipsis)."""
    chars = max(8, int(width / max(font().getlength("n"), 1)))
    lines = textwrap.wrap(" ".join(text.split()), chars) or [""]
    return lines if len(lines) <= max_lines else lines[: max_lines - 1] + [lines[max_lines - 1][: chars - 1] + "…"]


def line_height() -> int:
    box = font().getbbox("Ag")
    return box[3] - box[1] + 3


def grid(tiles: Tiles, keys: list[str], tile: int, columns: int) -> Preview:
    """Tiles in rows of `columns`, each picture at its cell's top left with its text under it."""
    columns = min(columns, len(tiles))
    text_h = max(len(text) for _, text in tiles) * line_height()
    cell_w, cell_h = tile + 2 * PAD, tile + text_h + 3 * PAD
    rows = -(-len(tiles) // columns)
    image = Image.new("RGB", (columns * cell_w, rows * cell_h), BACKGROUND)
    draw, frames = ImageDraw.Draw(image), []
    for i, (shown, text) in enumerate(tiles):
        left, top = (i % columns) * cell_w + PAD, (i // columns) * cell_h + PAD
        image.paste(shown, (left, top))
        frames.append((left, top, *shown.size))
        for k, line in enumerate(text):
            draw.text((left, top + tile + PAD + k * line_height()), line, fill=TEXT, font=font())
    return Preview(image, tuple(keys), tuple(frames))
