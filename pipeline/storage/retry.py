"""One retry policy for every storage request: transient failures (HTTP 5xx, 429/SlowDown, a
connection reset, a body cut short, a timeout) are tried again after an exponential backoff with
jitter; anything else (a missing object, bad credentials) fails at once."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["Retry", "Truncated", "describe", "transient", "with_retries"]

log = logging.getLogger("pipeline.storage")
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
_TRANSPORT_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "http")
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Retry:
    """How transient storage failures are retried: up to `attempts` tries of each request, waiting
    `initial_delay * 2**n` (at most `max_delay`) times a random factor in [0.5, 1.5) between tries."""

    attempts: int = 6
    initial_delay: float = 0.2
    max_delay: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts must be an int >= 1, got {self.attempts!r}")
        if not (0 <= self.initial_delay <= self.max_delay):
            raise ValueError(f"need 0 <= initial_delay <= max_delay, got {self.initial_delay}, {self.max_delay}")

    def delay(self, failures: int) -> float:
        return min(self.max_delay, self.initial_delay * 2 ** (failures - 1)) * random.uniform(0.5, 1.5)


def transient(exc: BaseException) -> bool:
    """Whether a storage failure may go away if tried again."""
    if isinstance(exc, _PERMANENT):
        return False
    status = getattr(exc, "status", None)  # aiohttp / http responses
    if isinstance(status, int):
        return status >= 500 or status == 429
    return isinstance(exc, (OSError, TimeoutError, Truncated)) or type(exc).__module__.split(".")[0] in _TRANSPORT_MODULES


class Truncated(Exception):
    """A read returned fewer bytes than asked for (a body cut short)."""


def with_retries(retry: Retry, what: str, call: Callable[[], T]) -> T:
    """`call()`, tried again on transient failures; the last failure propagates (with a note)."""
    for attempt in range(1, retry.attempts + 1):
        try:
            return call()
        except Exception as exc:
            if not transient(exc) or attempt == retry.attempts:
                if attempt > 1:
                    exc.add_note(f"{what}: failed {attempt} times")
                raise
            wait = retry.delay(attempt)
            log.info("%s: %r; try %d of %d in %.2f s", what, exc, attempt + 1, retry.attempts, wait)
        time.sleep(wait)
    raise AssertionError("unreachable")



def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

