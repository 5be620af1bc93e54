"""One retry policy for every storage request: transient failures (HTTP 5xx, 429/SlowDown, a
connection reset, a body cut short, a timeout) are tried again after an exponential backoff with
jitter; anything else (a missing object, bad credentials) fails at once. The clients' own retry
loops are off (botocore's and s3fs's in `fs`, obstore's in `s3`)."""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["Retry", "Truncated", "describe", "http_status", "transient", "with_retries"]

log = logging.getLogger("pipeline.storage")
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
_TRANSPORT_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "http")
# S3 error codes of answers that may succeed if tried again, whatever their status (botocore's list,
# less those of other services): throttling, and the server's own timeout of a slow request.
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "RequestLimitExceeded",
                    "BandwidthLimitExceeded", "RequestTimeout", "RequestTimeoutException", "InternalError",
                    "ServiceUnavailable"}
# obstore's errors that a try again cannot mend (FileNotFoundError is raised as the builtin).
_OBSTORE_PERMANENT = {"NotFoundError", "PermissionDeniedError", "UnauthenticatedError", "InvalidPathError",
                      "NotSupportedError", "AlreadyExistsError", "PreconditionError", "NotModifiedError",
                      "UnknownConfigurationKeyError"}
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
    code = getattr(exc, "code", None)  # (an S3 answer: `s3.S3Error`)
    if isinstance(code, str) and code in _TRANSIENT_CODES:
        return True
    status = http_status(exc)
    if status is not None:
        return status >= 500 or status == 429
    module = type(exc).__module__.split(".")[0]
    if module == "obstore":  # (raised by obstore itself, not through `s3`): a failure of the transport
        return type(exc).__name__ not in _OBSTORE_PERMANENT and "HTTP error" in str(exc)
    return isinstance(exc, (OSError, TimeoutError, Truncated)) or module in _TRANSPORT_MODULES


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a failed request: its `status` (aiohttp, http, `s3.S3Error`), or the one
    obstore's message states; None where no answer came."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    if type(exc).__module__.split(".")[0] == "obstore":
        found = re.search(r"status code: (\d{3})", str(exc))
        return int(found.group(1)) if found else None
    return None


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

