"""One retry policy for every storage request: transient failures (HTTP 5xx, 429/SlowDown, a
connection reset, a body cut short, a timeout) are tried again after an exponential backoff with
jitter; anything else (a missing object, bad credentials) fails at once. A request is tried
`attempts` times, but throttling (503 SlowDown, 429 and the S3 throttling codes: the server asking
for fewer requests, not failing) is retried for as long as the request stays within its time
budget, `throttle_seconds`: a throttled epoch slows down, it does not fail. The clients' own retry
loops are off (botocore's, s3fs's and gcsfs's in `fs`, obstore's in `s3` and `gcs`)."""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import time
from collections.abc import Callable
from typing import TypeVar

from pipeline.checks import is_int_at_least
from pipeline.errors import ConfigError

__all__ = ["Retry", "Tries", "Truncated", "describe", "http_status", "throttled", "transient", "with_retries"]

log = logging.getLogger("pipeline.storage")
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
_TRANSPORT_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "http", "azure")
# S3 error codes of answers that may succeed if tried again, whatever their status (botocore's list,
# less those of other services): throttling, and the server's own timeout of a slow request.
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "RequestLimitExceeded",
                    "BandwidthLimitExceeded", "RequestTimeout", "RequestTimeoutException", "InternalError",
                    "ServiceUnavailable"}
# obstore's errors that a try again cannot mend (FileNotFoundError is raised as the builtin).
_OBSTORE_PERMANENT = {"NotFoundError", "PermissionDeniedError", "UnauthenticatedError", "InvalidPathError",
                      "NotSupportedError", "AlreadyExistsError", "PreconditionError", "NotModifiedError",
                      "UnknownConfigurationKeyError"}
# S3 error codes (and HTTP statuses) of a server asking for fewer requests: retried within `Retry.throttle_seconds`.
_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "RequestLimitExceeded",
                   "BandwidthLimitExceeded", "TooManyRequests", "TooManyRequestsException"}
_THROTTLE_STATUSES = (429, 503)
T = TypeVar("T")


def _sleep(seconds: float) -> None:
    time.sleep(seconds)  # (`time` looked up at the call: a test may replace this module's)


def _monotonic() -> float:
    return time.monotonic()


@dataclasses.dataclass(frozen=True)
class Retry:
    """How transient storage failures are retried: up to `attempts` tries of each request, waiting
    `initial_delay * 2**n` (at most `max_delay`) times a random factor in [0.5, 1.5) between tries.
    Throttling (`throttled`) does not use up tries while the request is within `throttle_seconds`
    of its first try (waits included); past that it counts as any failure. 0: exact tries for all.
    `sleep(seconds)` waits between tries and `clock()` measures the budget (`time.sleep` and
    `time.monotonic` unless given: a test passes its own, to see the waits without waiting)."""

    attempts: int = 6
    initial_delay: float = 0.2
    max_delay: float = 10.0
    throttle_seconds: float = 120.0
    sleep: Callable[[float], None] = dataclasses.field(default=_sleep, compare=False, repr=False)
    clock: Callable[[], float] = dataclasses.field(default=_monotonic, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not is_int_at_least(self.attempts, 1):
            raise ConfigError(f"attempts must be an int >= 1, got {self.attempts!r}")
        if not (0 <= self.initial_delay <= self.max_delay):
            raise ConfigError(f"need 0 <= initial_delay <= max_delay, got {self.initial_delay}, {self.max_delay}")
        budget = self.throttle_seconds
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget < float("inf"):
            raise ConfigError(f"throttle_seconds must be a finite number of seconds >= 0 (how long a throttled request "
                              f"is retried; 0: throttling uses up tries as other failures do), got {budget!r}")

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


def throttled(exc: BaseException) -> bool:
    """Whether a failure is the server asking for fewer requests (503 SlowDown, 429, an S3 throttling
    code), here or in its causes (s3fs raises an OSError caused by botocore's ClientError)."""
    seen = 0
    while exc is not None and seen < 8:
        code = vars(exc).get("code")  # (`s3.S3Error`'s; aiohttp's `code` property is deprecated)
        response = vars(exc).get("response")  # (botocore's ClientError)
        if not isinstance(code, str) and isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        else:
            status = http_status(exc)
        if (isinstance(code, str) and code in _THROTTLE_CODES) or status in _THROTTLE_STATUSES:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1  # type: ignore[assignment]
    return False


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a failed request: its `status` (aiohttp, http, `s3.S3Error`) or `status_code`
    (azure-core, under adlfs), gcsfs's HttpError's `code`, or the one obstore's message states; None
    where no answer came."""
    status = getattr(exc, "status", None)
    status = status if isinstance(status, int) else getattr(exc, "status_code", None)
    if isinstance(status, int):
        return status
    code = vars(exc).get("code")  # (an attribute, not aiohttp's deprecated property)
    if type(exc).__module__.split(".")[0] == "gcsfs" and isinstance(code, int):
        return code
    if type(exc).__module__.split(".")[0] == "obstore":
        found = re.search(r"status code: (\d{3})", str(exc))
        return int(found.group(1)) if found else None
    return None


class Truncated(Exception):
    """A read returned fewer bytes than asked for (a body cut short)."""


class Tries:
    """One request's tries under a `Retry`: `again(exc)` says whether a failure is tried again, after
    how long. Counts what messages say: tries made, and seconds of throttling ridden out."""

    def __init__(self, retry: Retry) -> None:
        self.retry, self.count, self.counted = retry, 0, 0
        self.start = retry.clock()
        self.throttled = False  # the last failure was throttling

    def again(self, exc: BaseException) -> float | None:
        """The wait before trying again after the failure `exc` (of try `count + 1`), or None: give up."""
        self.count += 1
        if not transient(exc):
            return None
        retry = self.retry
        wait = retry.delay(min(self.count, 64))
        self.throttled = throttled(exc)
        if not (self.throttled and retry.clock() + wait - self.start <= retry.throttle_seconds):
            self.counted += 1  # (a try used up: anything but throttling within the budget)
        return wait if self.counted < retry.attempts else None

    def __str__(self) -> str:
        spent = self.retry.clock() - self.start
        throttling = f" over {spent:.1f} s of throttling (throttle_seconds={self.retry.throttle_seconds:g})" \
            if self.throttled and self.count > self.counted else ""
        return f"{self.count} tries{throttling}"


def with_retries(retry: Retry, what: str, call: Callable[[], T], tries: Tries | None = None) -> T:
    """`call()`, tried again on transient failures as `retry` says; the last failure propagates (with a
    note). `tries`: where the caller reads how many were made (for its message)."""
    tries = tries or Tries(retry)
    while True:
        try:
            return call()
        except Exception as exc:
            wait = tries.again(exc)
            if wait is None:
                if tries.count > 1:
                    exc.add_note(f"{what}: failed {tries}")
                raise
            left = "" if tries.throttled else f" of {retry.attempts}"
            log.info("%s: %r; try %d%s in %.2f s", what, exc, tries.count + 1, left, wait)
        retry.sleep(wait)



def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

