"""The project's exceptions: every one names the file, shard or sample it is about."""

from __future__ import annotations

__all__ = ["ShardstreamError", "ManifestError", "ShardError", "SampleError"]


class ShardstreamError(Exception):
    """Base class of every error this project raises on purpose."""


class ManifestError(ShardstreamError):
    """A dataset's manifest is missing, unreadable or inconsistent."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class ShardError(ShardstreamError):
    """A shard cannot be read or does not hold what the manifest says."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class SampleError(ShardstreamError):
    """One sample (or one of its fields) of a shard or a source is invalid."""

    def __init__(self, url: str, key: str, field: str | None, message: str) -> None:
        where = f"sample {key!r}" + (f", field {field!r}" if field else "")
        super().__init__(f"{url}: {where}: {message}")
        self.url, self.key, self.field = url, key, field
