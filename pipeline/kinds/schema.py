"""A kind's finished batch declared as data: each field's name, dtype and shape. `problems` checks a
batch against that declaration (keys, dtypes, shapes), so no kind writes those loops itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["BatchField", "every_option", "problems"]


@dataclasses.dataclass(frozen=True)
class BatchField:
    """One field of a finished batch: a tensor of `dtype`, or with `dtype=list` a list. Each dim of
    `shape` is a size or a name ("B", "N"): a name is one size wherever it appears in the batch."""

    name: str
    dtype: torch.dtype | type[list]
    shape: tuple[int | str, ...]


def problems(batch: Any, fields: Sequence[BatchField]) -> list[str]:
    """What in `batch` disagrees with `fields` (empty if nothing): its keys, then each field's type,
    dtype and shape; a named dim takes its size from the first field (in order) that has it."""
    expected = {field.name for field in fields}
    if not isinstance(batch, dict):
        return [f"a {type(batch).__name__}, expected a dict of {sorted(expected)}"]
    if set(batch) != expected:
        differences = [f"{what} {names}" for what, names in (("missing", sorted(expected - set(batch))),
                                                             ("unexpected", sorted(set(batch) - expected))) if names]
        return [f"keys {sorted(batch)}, expected {sorted(expected)} ({', '.join(differences)})"]
    sizes: dict[str, int] = {}
    found = (_problem(field, batch[field.name], sizes) for field in fields)
    return [problem for problem in found if problem]


def _problem(field: BatchField, value: Any, sizes: dict[str, int]) -> str | None:
    """What is wrong with one field's value, if anything (`sizes`: the named dims seen so far)."""
    if field.dtype is list:
        if not isinstance(value, list):
            return f"{field.name}: a {type(value).__name__}, expected a list"
        (length,) = _sizes(field.shape, (len(value),), sizes)  # (a list has one dim)
        return None if len(value) == length else f"{field.name}: a list of {len(value)}, expected a list of {length}"
    if not isinstance(value, torch.Tensor):
        return f"{field.name}: a {type(value).__name__}, expected a {field.dtype} tensor"
    if value.dtype != field.dtype:
        return f"{field.name}: dtype {value.dtype}, expected {field.dtype}"
    shape = tuple(value.shape)
    expected = _sizes(field.shape, shape, sizes)
    return None if shape == expected else f"{field.name}: shape {shape}, expected {_text(expected)}"


def _sizes(dims: tuple[int | str, ...], shape: tuple[int, ...], sizes: dict[str, int]) -> tuple[int | str, ...]:
    """`dims` with each name's size: one seen before, or else this shape's (kept when its rank fits)."""
    if len(shape) == len(dims):
        for dim, size in zip(dims, shape):
            if isinstance(dim, str):
                sizes.setdefault(dim, size)
    return tuple(sizes.get(dim, dim) if isinstance(dim, str) else dim for dim in dims)


def _text(dims: tuple[int | str, ...]) -> str:
    """A shape as a tuple prints it, names unquoted: (2, N, 64, 64)."""
    return f"({', '.join(map(str, dims))}{',' if len(dims) == 1 else ''})"


def every_option(options: Any, varies: bool) -> tuple[bool, frozenset[str]]:
    """`Kind.depends` for a kind whose fields are not told apart: every option shapes every field,
    and they change with the epoch when `varies`."""
    return varies, frozenset(f.name for f in dataclasses.fields(options))
