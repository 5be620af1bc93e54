"""Ranged reads of shards, a client per URL scheme from a table (`CLIENTS`): a scheme whose hot path
needs a lean client names its factory there (one module, one line); every other URL, and one whose
factory declines (options it cannot honour, no library), is read through fsspec.

Either way the reads go through `fs.read_range`: pieces of `PIECE_BYTES`, each retried under one
`Retry` (a retry redoes one piece), errors naming the URL and the sample."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from pipeline.errors import ShardError
from pipeline.storage.azure import SCHEMES as AZURE_SCHEMES
from pipeline.storage.azure import client as azure_client
import pipeline.storage.gcs as gcs
from pipeline.storage.s3 import client as s3_client
from pipeline.storage.fs import PIECE_BYTES, filesystem, read_range
from pipeline.storage.retry import Retry, Tries, Truncated, describe, http_status, transient, with_retries

__all__ = ["CLIENTS", "Client", "Ranged", "client_for", "ranged_reader"]

log = logging.getLogger("pipeline.storage")


class Client(Protocol):
    """What a ranged client does, one request per call, by fsspec's names (so a filesystem is one)."""

    def cat_file(self, path: str, start: int, end: int) -> Any: ...  # bytes [start, end), or a buffer of them

    def size(self, path: str) -> int: ...


# scheme -> factory(url, storage_options): (a client made in this process, the object's path for it),
# or None to leave the URL to fsspec.
CLIENTS: dict[str, Callable[[str, dict[str, Any] | None], tuple[Client, str] | None]] = {
    "s3": s3_client,
    "s3a": s3_client,
    **{scheme: azure_client for scheme in AZURE_SCHEMES},
    **{scheme: gcs.client for scheme in gcs.SCHEMES},
}


@dataclasses.dataclass(frozen=True)
class Ranged:
    """One shard's bytes by range, and its size, through its scheme's client; `expected`: its size
    as the manifest says, checked where the client's answers say the object's (`checks_size`)."""

    client: Client
    path: str
    url: str
    retry: Retry
    expected: int | None = None

    def checks_size(self) -> bool:
        """Whether the client's answers say the object's size (`S3Client.seen_size`): then `read` checks
        it against `expected`, and no request asks for it apart."""
        return hasattr(self.client, "seen_size")

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end): a ShardError if the shard is missing, is short, or fails past the
        retries; for a client whose answers say the object's size, a ShardError saying both sizes
        (before the bytes are used) where it is not `expected`."""
        checked = self.expected is not None and self.checks_size()
        try:
            data = read_range(self.client, self.path, self.url, start, end, retry=self.retry)  # type: ignore[arg-type]
        except ShardError as exc:  # (a range past a shortened object's end: say why)
            if checked and http_status(exc.__cause__) == 416:
                self._check_size(self.known_size(), exc)
            raise
        if checked:
            self._check_size(self.client.seen_size(self.path))  # type: ignore[attr-defined]
        return data

    def known_size(self) -> int:
        """The object's size as an answer said it already (`checks_size` clients), else asked for (a HEAD)."""
        seen = self.client.seen_size(self.path) if self.checks_size() else None  # type: ignore[attr-defined]
        return seen if seen is not None else self.size()

    def _check_size(self, actual: int | None, cause: Exception | None = None) -> None:
        if actual is not None and actual != self.expected:
            raise ShardError(f"shard is {actual} bytes, the manifest says {self.expected}", url=self.url) from cause

    def stream(self, start: int, end: int) -> Iterator[bytes | memoryview]:
        """Bytes [start, end) in order as they arrive: by one request where the client streams
        (resumed from the byte reached after a transient failure: a try counts from the last byte
        that arrived), else by `read` in pieces of `PIECE_BYTES`. Fails as `read` does."""
        if not hasattr(self.client, "stream"):
            for first in range(start, end, PIECE_BYTES):
                yield self.read(first, min(first + PIECE_BYTES, end))
            return
        at, tries = start, Tries(self.retry)
        while at < end:
            try:
                for chunk in self.client.stream(self.path, at, end):
                    yield chunk
                    at, tries = at + len(chunk), Tries(self.retry)
                if at != end:
                    raise Truncated(f"bytes {at}-{end}: the body ended early")
            except FileNotFoundError as exc:
                raise ShardError("shard is missing", url=self.url) from exc
            except Exception as exc:
                wait = tries.again(exc)
                if wait is None:
                    after = f" after {tries}" if transient(exc) else ""
                    raise ShardError(f"cannot read bytes {at}-{end}{after}: {describe(exc)}", url=self.url) from exc
                log.info("%s bytes %d-%d: %r; try %d in %.2f s", self.url, at, end, exc, tries.count + 1, wait)
                self.retry.sleep(wait)

    def size(self) -> int:
        """The shard's size in bytes."""
        try:
            return with_retries(self.retry, self.url, lambda: self.client.size(self.path))
        except FileNotFoundError as exc:
            raise ShardError("shard is missing", url=self.url) from exc
        except Exception as exc:
            raise ShardError(f"cannot stat shard: {describe(exc)}", url=self.url) from exc


def client_for(url: str, storage_options: dict[str, Any] | None) -> tuple[Client, str]:
    """(the client, the path for it) of a URL: its scheme's from `CLIENTS`, else fsspec's filesystem.
    Call it in the process that reads: clients are not fork-safe."""
    factory = CLIENTS.get(url.partition("://")[0]) if "://" in url else None
    found = factory(url, storage_options) if factory is not None else None
    return found if found is not None else filesystem(url, storage_options)  # type: ignore[return-value]


def ranged_reader(url: str, storage_options: dict[str, Any] | None, retry: Retry) -> Ranged:
    """The ranged reader of a URL, through `client_for`'s client."""
    return Ranged(*client_for(url, storage_options), url, retry)
