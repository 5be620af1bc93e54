"""COCO compressed RLE, rasterised straight to a target size without a full-resolution decode.

A COCO mask of size (H, W) is a list of run lengths over its pixels in column-major order,
alternating 0s and 1s (starting with 0s); the compressed string stores them as 5-bit groups
with delta coding (pycocotools `rleFrString`). Sampling the mask at an (h, w) grid by nearest
neighbour (`nearest_index`) picks h*w of the H*W pixels; their column-major order is sorted, so
each run maps to a contiguous slice of the output and the whole raster is one `np.repeat` over
the runs. Work is O(runs + h*w), never O(H*W). Many masks are decoded in one vectorised pass.

`raster_bits` gives the same masks 8 pixels to a byte, as the loader sends them: it packs the
column-major raster as it comes and transposes 8x8 bit blocks, so the row-major bool masks (a
byte-wise transpose, ~40% of `raster`'s time) are never made.

`foreground_pixels` picks pixels of the masks at full resolution from the runs alone: the n-th
foreground pixel in column-major order lies in the foreground run whose cumulative length first
passes n, found by one search over the runs. O(runs + picks), no raster at all. `parse` gives
masks parsed once for both (`bits_of`, `foreground_pixels`).

`crop` keeps the pixels of a window of rows and columns, as masks of the window's size: the
window's pixels in column-major order are a sub-sequence of the mask's, so each run keeps the
count of its pixels inside (`areas`, `tight_boxes` and `foreground_pixels` then see only those).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from pipeline.errors import RLEError

__all__ = ["RLEError", "Runs", "fit", "nearest_index", "affine_index", "run_lengths", "parse", "check", "raster",
           "raster_bits", "bits_of", "bits_at", "foreground_pixels", "crop", "areas", "tight_boxes"]

_MAX_CHARS_PER_VALUE = 12  # 60 bits: more would overflow int64, and no valid mask needs it


def fit(height: int, width: int, size: int) -> tuple[int, int]:
    """(h, w) with the long side `size` and the aspect of (height, width), rounded half up."""
    long = max(height, width)
    return max(1, (height * size + long // 2) // long), max(1, (width * size + long // 2) // long)


def nearest_index(src: int, dst: int) -> np.ndarray:
    """Source index sampled by each of `dst` output positions: floor((i + 0.5) * src / dst), exactly."""
    return (2 * np.arange(dst, dtype=np.int64) + 1) * src // (2 * dst)


def affine_index(src: int, scaled: int, offset: int, step: tuple[int, int], count: int) -> np.ndarray:
    """Source index sampled by each of `count` output positions over a source of `src` pixels scaled to
    `scaled`, read from `offset` (scaled pixels) on, each output pixel p / q scaled pixels wide (`step`):
    floor(((i + 0.5) * p / q + offset) * src / scaled), exactly; only those inside the source (a prefix).
    `affine_index(src, dst, 0, (1, 1), dst)` is `nearest_index(src, dst)`."""
    p, q = step
    index = ((2 * np.arange(count, dtype=np.int64) + 1) * p + 2 * offset * q) * src // (2 * q * scaled)
    return index[: np.searchsorted(index, src)]


def run_lengths(strings: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Run lengths of every string, concatenated, and the number of runs of each string."""
    runs, runs_per, _ = _run_lengths(strings)
    return runs, runs_per


def _cumsum(values: np.ndarray) -> np.ndarray:
    """`np.cumsum` of int64 `values`, by torch: ~6x faster than numpy's loop on the ~10^5 runs of a
    sample's masks (most of the time of parsing them and of drawing points)."""
    return torch.cumsum(torch.from_numpy(values), 0).numpy()


def _run_lengths(strings: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`run_lengths`, and whether each run is odd within its string (a foreground run)."""
    lens = np.fromiter((len(s) for s in strings), np.int64, len(strings))
    for index in np.flatnonzero(lens == 0):
        raise RLEError("empty counts string", index=int(index))
    raw = np.frombuffer(b"".join(strings), np.uint8)
    chars = raw - np.uint8(48)  # (a byte below 48 wraps above 63)
    bad = np.flatnonzero(chars > 63)
    if bad.size:
        raise RLEError(f"invalid character {chr(raw[bad[0]])!r}", index=_owner(lens, bad[0]))
    ends = np.flatnonzero(chars < 0x20)  # a value's last character: no continuation bit
    string_end = np.cumsum(lens)
    for index in np.flatnonzero(chars[string_end - 1] >= 0x20):
        raise RLEError("truncated counts string", index=int(index))
    starts = np.empty_like(ends)
    starts[:1], starts[1:] = 0, ends[:-1] + 1
    nchars = ends - starts + 1
    longest = int(nchars.max()) if nchars.size else 0
    if longest > _MAX_CHARS_PER_VALUE:
        raise RLEError("run length value too long", index=_owner(lens, starts[np.argmax(nchars)]))
    groups = chars & np.uint8(0x1F)
    values = groups[starts].astype(np.int64)
    for j in range(1, longest):  # 5 more bits from each value's j-th character (most have one)
        more = np.flatnonzero(nchars > j)
        values[more] |= groups[starts[more] + j].astype(np.int64) << (5 * j)
    values -= (groups[ends] >> 4).astype(np.int64) << (5 * nchars)  # the last group's top bit: the sign
    # Undo the delta coding: for m > 2, run[m] = value[m] + run[m - 2], per string. Sums over
    # every other value (c2) give it in one pass: run[m] = c2[m] - c2 just before its chain.
    runs_per = np.diff(np.searchsorted(ends, np.concatenate(([0], string_end))))
    first = np.cumsum(runs_per) - runs_per
    c2 = np.empty_like(values)
    c2[0::2], c2[1::2] = _cumsum(values[0::2]), _cumsum(values[1::2])
    odd = (np.arange(values.size) & 1).astype(bool) != np.repeat((first & 1).astype(bool), runs_per)  # m is odd
    before_odd = np.where(first > 0, c2[first - 1], 0)  # (m = 1, 3, ... follow the previous string's values)
    runs = c2 - np.where(odd, np.repeat(before_odd, runs_per), np.repeat(c2[first], runs_per))
    runs[first] = values[first]
    return runs, runs_per, odd


def _owner(lens: np.ndarray, char_index: int) -> int:
    return int(np.searchsorted(np.cumsum(lens), char_index, side="right"))


@dataclasses.dataclass(frozen=True)
class Runs:
    """Masks parsed once and checked (`parse`), for `bits_of` and `foreground_pixels` alike: run lengths
    of all (concatenated), runs per mask, each run's end counted over all, each mask's first run, and
    which runs are of 1s. A window of larger masks (`crop`) starts at `origin` (row, column) of them."""

    size: tuple[int, int]
    runs: np.ndarray
    runs_per: np.ndarray
    total: np.ndarray
    first: np.ndarray
    foreground: np.ndarray  # bool per run: odd within its mask (runs alternate 0s and 1s, 0s first)
    origin: tuple[int, int] = (0, 0)

    def __len__(self) -> int:
        return len(self.runs_per)

    @property
    def ends(self) -> np.ndarray:
        """Each run's end, counted in its own mask's pixels (column-major)."""
        return self.total - np.repeat(self.total[self.first] - self.runs[self.first], self.runs_per)

    def subset(self, keep: np.ndarray) -> Runs:
        """These masks, only those `keep` (bool, one per mask) marks."""
        runs_per, kept = self.runs_per[keep], np.flatnonzero(np.repeat(keep, self.runs_per))
        return Runs(self.size, self.runs.take(kept), runs_per, self.total.take(kept), np.cumsum(runs_per) - runs_per,
                    self.foreground.take(kept), self.origin)


def parse(strings: Sequence[bytes], size: tuple[int, int]) -> Runs:
    """The masks' runs, checked to describe masks of `size` (else RLEError, naming the mask)."""
    if not strings:
        none = np.zeros(0, np.int64)
        return Runs(size, none, none, none, none, none.astype(bool))
    runs, runs_per, total, odd = _checked_runs(strings, size)
    return Runs(size, runs, runs_per, total, np.cumsum(runs_per) - runs_per, odd)


def _checked_runs(strings: Sequence[bytes], size: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Run lengths, runs per string, each run's end and whether it is a foreground run, after checking
    they describe masks of `size`."""
    runs, runs_per, odd = _run_lengths(strings)
    if runs.size and runs.min() < 0:
        raise RLEError("negative run",
                       index=int(np.searchsorted(np.cumsum(runs_per), np.argmax(runs < 0), side="right")))
    total = _cumsum(runs)
    last = np.cumsum(runs_per) - 1
    sums = total[last] - np.concatenate(([0], total[last[:-1]]))
    for index in np.flatnonzero(sums != size[0] * size[1]):
        raise RLEError(f"runs cover {int(sums[index])} pixels, not {size[0]}x{size[1]}", index=int(index))
    return runs, runs_per, total, odd


def check(strings: Sequence[bytes], size: tuple[int, int]) -> None:
    """Raise RLEError unless every string is a valid COCO compressed RLE of a `size` mask."""
    if strings:
        _checked_runs(strings, size)


def _columns(parsed: Runs, ys: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The masks sampled at rows `ys` and the distinct of columns `xs` (both non-decreasing), column-major:
    (k, columns, len(ys)) bool, and each output column's index among them."""
    (height, width), h = parsed.size, len(ys)
    k, bounds, first = len(parsed), parsed.ends, parsed.first
    columns, column_of = np.unique(xs, return_inverse=True)
    # Sampled pixels before a boundary at (col, row): all of the sampled columns left of col,
    # plus, when col is sampled, its sampled rows above row. Tables make both lookups gathers.
    left = np.searchsorted(columns, np.arange(width + 1)) * h
    above = np.searchsorted(ys, np.arange(height))
    sampled = np.zeros(width + 1, bool)
    sampled[columns] = True
    col, row = np.divmod(bounds, height)
    index = left[col] + np.where(sampled[col], above[row], 0)
    lengths = np.diff(index, prepend=0)
    lengths[first] = index[first]
    return np.repeat(parsed.foreground, lengths).reshape(k, columns.size, h), column_of


def raster(strings: Sequence[bytes], size: tuple[int, int], out: tuple[int, int]) -> np.ndarray:
    """Masks (k, h, w) bool: each (H, W) = `size` mask sampled at nearest_index(H, h) x nearest_index(W, w).

    Equals `pycocotools.mask.decode(rle)[ys][:, xs]` exactly, for every valid RLE; raises RLEError
    (naming the mask's index) for a string that is malformed or whose runs do not cover H*W pixels.
    """
    if not strings:
        return np.zeros((0, *out), bool)
    return _row_major(*_columns(parse(strings, size), nearest_index(size[0], out[0]), nearest_index(size[1], out[1])),
                      out[1])


def _row_major(by_column: np.ndarray, column_of: np.ndarray, w: int) -> np.ndarray:
    """`_columns`' masks as (k, h, w) bool, each sampled column where the output wants it."""
    masks = by_column.transpose(0, 2, 1)
    return np.ascontiguousarray(masks if by_column.shape[1] == w else masks[:, :, column_of])


# Transposing an 8x8 bit block held in a uint64 across its anti-diagonal (three delta swaps):
# bit 8r + c goes to bit 8(7 - c) + (7 - r).
_SWAPS = tuple((np.uint64(mask), np.uint64(shift)) for mask, shift in
               ((0xAA00AA00AA00AA00, 9), (0xCCCC0000CCCC0000, 18), (0xF0F0F0F00F0F0F0F, 36)))


def raster_bits(strings: Sequence[bytes], size: tuple[int, int], out: tuple[int, int]) -> np.ndarray:
    """`raster`'s masks with each row packed 8 pixels to a byte, most significant bit first:
    (k, h, ceil(w / 8)) uint8, equal to `np.packbits(raster(strings, size, out), axis=-1)`."""
    return bits_of(parse(strings, size), out)


def bits_of(parsed: Runs, out: tuple[int, int]) -> np.ndarray:
    """`raster_bits` of masks already parsed."""
    return bits_at(parsed, nearest_index(parsed.size[0], out[0]), nearest_index(parsed.size[1], out[1]))


def bits_at(parsed: Runs, ys: np.ndarray, xs: np.ndarray, mirrored: bool = False) -> np.ndarray:
    """`bits_of` with the sampled rows `ys` and columns `xs` given (non-decreasing source indices, as
    `nearest_index` or `affine_index` gives): `np.packbits(full[:, ys][:, :, xs], axis=-1)`; with
    `mirrored`, its columns in reverse order (a horizontal flip, at no cost: columns are packed first)."""
    (h, w), k = (len(ys), len(xs)), len(parsed)
    wb, hb = -(-w // 8), -(-h // 8)
    if not (k and h and w):
        return np.zeros((k, h, wb), np.uint8)
    by_column, column_of = _columns(parsed, ys, xs)
    if by_column.shape[1] != w:  # (a frame wider than the mask repeats columns: rare, done the plain way)
        full = _row_major(by_column, column_of, w)
        return np.packbits(full[..., ::-1] if mirrored else full, axis=-1)
    packed = np.packbits(by_column, axis=-1)  # (k, w, hb): byte j of column x holds rows 8j..8j+7
    if mirrored:
        packed = packed[:, ::-1]
    if w % 8:
        packed = np.concatenate([packed, np.zeros((k, 8 * wb - w, hb), np.uint8)], axis=1)
    # One uint64 per 8x8 block: its byte i is column 8b + i (bit 7 - r: row r of the block).
    blocks = np.ascontiguousarray(packed.reshape(k, wb, 8, hb).transpose(0, 1, 3, 2)).view("<u8")[..., 0]
    for mask, shift in _SWAPS:  # now its byte r is row r of the block (bit 7 - i: column 8b + i)
        if shift == 36:
            t = blocks ^ (blocks << shift)
            blocks ^= mask & (t ^ (blocks >> shift))
        else:
            t = mask & (blocks ^ (blocks << shift))
            blocks ^= t ^ (t >> shift)
    rows = blocks[..., None].view(np.uint8)  # (k, wb, hb, 8): byte b of row 8j + r
    return np.ascontiguousarray(rows.transpose(0, 2, 3, 1).reshape(k, 8 * hb, wb)[:, :h])


def foreground_pixels(parsed: Runs, fractions: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """Full-resolution pixels of parsed masks: for fractions (n, K) in [0, 1), mask rows[i]'s (rows:
    default 0..n-1) foreground pixel number floor(fractions[i, j] * its area) in column-major (COCO)
    order, as (n, K, 2) int64 (x, y) = (column, row), of the full masks when these are a window
    (`crop`). Uniform fractions give pixels uniform over each mask. Raises RLEError (naming i) for a
    row whose mask has no foreground pixel."""
    runs, total, first = parsed.runs, parsed.total, parsed.first
    if rows is None:
        rows = np.arange(len(parsed))
    if not len(rows):
        return np.zeros((0, fractions.shape[1], 2), np.int64)
    foreground = _cumsum(runs * parsed.foreground)  # foreground pixels up to each run's end, over all masks
    before = np.where(first > 0, foreground[first - 1], 0)  # those of the masks before each
    areas = foreground[first + parsed.runs_per - 1] - before
    for index in np.flatnonzero(areas[rows] <= 0):
        raise RLEError("no foreground pixel", index=int(index))
    area = areas[rows][:, None]
    wanted = before[rows][:, None] + np.minimum((fractions * area).astype(np.int64), area - 1)
    run = np.searchsorted(foreground, wanted, side="right")  # the (foreground) run holding each wanted pixel
    mask_start = (total[first] - runs[first])[rows][:, None]
    pixel = total[run] - foreground[run] + wanted - mask_start  # its run's end, less what of the run is after it
    column, row = np.divmod(pixel, parsed.size[0])
    return np.stack([column + parsed.origin[1], row + parsed.origin[0]], axis=-1)


def crop(parsed: Runs, rows: tuple[int, int], columns: tuple[int, int]) -> Runs:
    """The masks' pixels in rows [top, bottom) and columns [left, right) (`rows`, `columns`), as masks
    of that window (origin (top, left)): each run keeps the count of its pixels inside, maybe 0. O(runs)."""
    (top, bottom), (left, right), height = rows, columns, parsed.size[0]
    h, w = max(0, bottom - top), max(0, right - left)
    pixel = parsed.ends
    column = pixel // height
    row = np.clip(pixel - column * height - top, 0, h)
    ends = np.clip(column - left, 0, w) * h + np.where((column >= left) & (column < right), row, 0)
    runs = np.diff(ends, prepend=0)  # (a run starts where the one before it ends, but a mask's first at 0)
    runs[parsed.first] = ends[parsed.first]
    return Runs((h, w), runs, parsed.runs_per, ends, parsed.first, parsed.foreground, (top, left))


def areas(parsed: Runs) -> np.ndarray:
    """The foreground pixels of each mask: (k,) int64."""
    if not len(parsed):
        return np.zeros(0, np.int64)
    return np.add.reduceat(parsed.runs * parsed.foreground, parsed.first)


def tight_boxes(parsed: Runs) -> np.ndarray:
    """Each mask's foreground's tight box, (k, 4) int64 pixel edges XYXY (x1, y1 one past the last
    pixel), of the full masks when these are a window (`crop`); (0, 0, 0, 0) for a mask with none."""
    k, height = len(parsed), parsed.size[0]
    boxes = np.zeros((k, 4), np.int64)
    solid = parsed.foreground & (parsed.runs > 0)
    if not k or not solid.any():
        return boxes
    counts = np.add.reduceat(solid.astype(np.int64), parsed.first)  # (each mask's solid runs: they come in order)
    taken = np.flatnonzero(solid)  # (then `take`: ~2x faster than a boolean index here)
    last = parsed.ends.take(taken) - 1
    first = last + 1 - parsed.runs.take(taken)
    c0, c1 = first // height, last // height
    wraps = c0 != c1  # (a run over a column's end covers its last row and the next column's first)
    top, bottom = np.where(wraps, 0, first - c0 * height), np.where(wraps, height - 1, last - c1 * height)
    present = counts > 0
    at = (np.cumsum(counts) - counts)[present]
    boxes[present] = np.stack([c0[at], np.minimum.reduceat(top, at), c1[at + counts[present] - 1] + 1,
                               np.maximum.reduceat(bottom, at) + 1], 1) + [parsed.origin[1], parsed.origin[0]] * 2
    return boxes
