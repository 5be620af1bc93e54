"""The project's exceptions: every one names the file, shard or sample it is about.

Each takes its message first and the rest as keywords (`ShardError(message, url=url)`). They pickle
from their attributes (`ShardstreamError.__reduce__`): an error raised in a DataLoader worker reaches
the training process with its type and attributes intact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = [
    "ShardstreamError", "ConfigError", "ManifestError", "DatasetError", "ShardError", "ShardIndexError", "SampleError",
    "InputError", "RowError", "PackError", "TooManySkipped", "PlanError", "RLEError", "excerpt",
    "StallError", "about_sample",
]


def excerpt(value: str | bytes, limit: int = 16) -> str:
    """Untrusted text or bytes for a message: escaped (as `repr` does) and cut to `limit` characters,
    so that an error or a skip line never carries more than a few characters of a file's content."""
    text = value if isinstance(value, str) else value.decode("latin-1")
    shown = repr(text[:limit])
    return f"{shown}... ({len(text)} characters)" if len(text) > limit else shown


class ShardstreamError(Exception):
    """Base class of every error this project raises on purpose: a message about one URL (None where it is
    about no one file: a split that cannot be planned, one mask of a sample), and about one sample of it
    where `key` is set (by the stage that reads the sample: `about_sample`)."""

    key: str | None = None

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url, self.message = url, message

    def __str__(self) -> str:
        sample = "" if self.key is None else f"sample {self.key!r}: "
        return self.message if self.url is None else f"{self.url}: {sample}{self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.message, dict(vars(self)))


def _rebuild(cls: type[ShardstreamError], message: str, attributes: dict[str, Any]) -> ShardstreamError:
    """An unpickled error: its class, `args` (the message) and attributes as they were, with no
    constructor run (a subclass's keywords need not be known here)."""
    error = cls.__new__(cls, message)
    error.__dict__.update(attributes)
    return error


class ConfigError(ShardstreamError, ValueError):
    """An argument or setting is not allowed (a LoaderConfig field, a kind's option, a World, a resume
    state, a name or array given to the format's writers); its message names the value and what is allowed.

    Also a ValueError, as these were before they joined this hierarchy: callers that catch ValueError still do."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class ManifestError(ShardstreamError):
    """A dataset's manifest is missing, unreadable or inconsistent."""


class DatasetError(ManifestError, ValueError):
    """The datasets do not allow what was asked of them (a split one lacks, kinds or fields that do not mix,
    too few samples for one batch, a first batch that breaks its kind's schema), or bytes decoded by
    `pipeline.format` are malformed (their readers raise a SampleError or ShardError naming the file from it).

    A ManifestError that is also a ValueError, as these were; ManifestError itself is not one, so that
    `except ValueError` around a parse never swallows a manifest that cannot be read."""


class ShardError(ShardstreamError):
    """A shard cannot be read or does not hold what the manifest says (about its sample `key`, if given)."""

    def __init__(self, message: str, *, url: str | None = None, key: str | None = None) -> None:
        super().__init__(message, url=url)
        self.key = key


class ShardIndexError(ShardError):
    """A shard's index file is missing, malformed, or disagrees with the manifest or with its shard."""


class SampleError(ShardstreamError):
    """One sample (or one of its fields) of a shard or of a packing source is invalid."""

    def __init__(self, message: str, *, url: str, key: str, field: str | None = None) -> None:
        super().__init__(message, url=url)
        self.key, self.field = key, field

    def __str__(self) -> str:
        where = f"sample {self.key!r}" + (f", field {self.field!r}" if self.field else "")
        return f"{self.url}: {where}: {self.message}"


class StallError(ShardstreamError):
    """No DataLoader worker made progress for `stall_timeout` seconds: what each was doing (stage,
    shard, sample, for how long) and its Python stack, in the message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class InputError(ShardstreamError):
    """A packing input cannot be used as it is (a missing or unsafe file, a schema, arrays that
    disagree); packing stops before anything is written."""


class RowError(InputError):
    """One value of an input array breaks its schema (NaN, out of range, a reference out of bounds)."""

    def __init__(self, message: str, *, url: str, field: str, row: int, value: str) -> None:
        super().__init__(message, url=url)
        self.field, self.row, self.value = field, row, value

    def __str__(self) -> str:
        return f"{self.url}: field {self.field!r}, row {self.row}: value {self.value}: {self.message}"


class PackError(ShardstreamError):
    """Packing cannot proceed: the output folder holds something else, or the input cannot be listed.

    Its message names the folder or file itself, so it takes no URL (the message is as it always was)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class TooManySkipped(PackError):
    """More input samples were bad than `max_skipped` allows; no manifest was written."""


class PlanError(ShardstreamError, ValueError):
    """The split cannot be divided as asked (e.g. fewer samples than ranks).

    Also a ValueError, as it was before it joined this hierarchy: callers that catch ValueError still do."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class RLEError(ShardstreamError, ValueError):
    """An RLE string is malformed or does not describe a mask of the stated size; `index` is the mask's.

    A ValueError too, as it was; readers turn it into a SampleError that names the shard and sample."""

    def __init__(self, message: str, *, index: int) -> None:
        super().__init__(message)
        self.index = index

    def __str__(self) -> str:
        return f"mask {self.index}: {self.message}"


@contextlib.contextmanager
def about_sample(url: str, key: str) -> Iterator[None]:
    """ShardErrors raised inside are about this sample of the shard at `url`: those that name no URL
    or this one, and no sample, get its URL and key (as attributes, and so in their message), once,
    here, so that the functions that read it need not take them only to say them."""
    try:
        yield
    except ShardError as exc:
        if exc.key is None and exc.url in (None, url):
            exc.url, exc.key = url, key
        raise
