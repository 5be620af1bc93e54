"""Progress of long runs (packing, indexing, tuning): a tqdm bar on a terminal, else a plain log
line at most every few seconds, counting items as they are done."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

__all__ = ["Progress"]

log = logging.getLogger("shard_tools.pack")  # (the packers' logger: the lines users and tests know)


class Progress:
    """A tqdm bar on a terminal; otherwise a plain log line at most every `every` seconds (of `clock`)."""

    def __init__(self, total: int, enabled: bool, every: float = 10.0, *, unit: str = "img",
                 what: str = "packed %d/%d samples", clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.done, self.every, self.what, self.clock = total, 0, every, what, clock
        self.start = self.last = clock()
        tty = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, unit=unit, smoothing=0.1, dynamic_ncols=True) if tty else None
        self.enabled = enabled

    def update(self, n: int) -> None:
        """`n` more done (0: only the periodic line, if one is due; the last line comes as the count ends)."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = self.clock()
        if self.enabled and (now - self.last >= self.every or (n and self.done == self.total)):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = f"{(self.total - self.done) / rate:.0f} s" if rate else "unknown"
            log.info(self.what + " (%.1f/s, ETA %s)", self.done, self.total, rate, eta)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
