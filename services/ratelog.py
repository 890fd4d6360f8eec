"""Log lines that a peer or a client can cause, at a bounded rate.

A failing request, a refused frame or a dropped connection is worth one line; a flood
of them (a broken peer, an attacker) must not fill the disk or slow the event loop.
`RateLimitedLog` writes the first line of each kind, then at most one per `interval`
seconds, saying how many it left out in between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.interval, self.clock = logger, interval, clock
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def log(self, level: int, kind: str, msg: str, *args) -> bool:
        """Log `msg % args` unless a line of `kind` went out less than `interval` ago;
        returns whether it was written."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return False
        if len(self._last) > 1024:  # kinds are few; never let them grow without bound
            self._last.clear()
        self._last[kind] = now
        skipped = self._skipped.pop(kind, 0)
        if skipped:
            msg += " (%d more like this in the last %.0f s)"
            args = (*args, skipped, now - last if last is not None else 0.0)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, kind: str, msg: str, *args) -> bool:
        return self.log(logging.WARNING, kind, msg, *args)

    def error(self, kind: str, msg: str, *args) -> bool:
        return self.log(logging.ERROR, kind, msg, *args)
