"""One send round per event-loop turn (issue 34, point 3): what the router's requests
gave to send while one turn's frames were handled (feeds and prunes for every stage,
calls for the draft) leaves in one callback after it, each replica's as one message or
frame, instead of one callback per replica's stream."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

Flush = Callable[[], None]


class SendRound:
    """One loop's round; it holds no reference to its loop, so a finished loop and its
    round go together (`_rounds` is keyed weakly by the loop)."""

    def __init__(self) -> None:
        self._flushes: list[Flush] = []

    def add(self, flush: Flush) -> None:
        """Call `flush` in this turn's round (in the order they were added; a flush
        added while the round runs goes in the next one)."""
        if not self._flushes:
            asyncio.get_running_loop().call_soon(self._run)
        self._flushes.append(flush)

    def _run(self) -> None:
        flushes, self._flushes = self._flushes, []
        for flush in flushes:
            try:
                flush()
            except Exception as e:  # as a callback of its own: the others still run
                asyncio.get_running_loop().call_exception_handler(
                    {"message": "a send round's flush failed", "exception": e}
                )


_rounds: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SendRound] = (
    weakref.WeakKeyDictionary()
)


def send_round() -> SendRound:
    """The running event loop's send round."""
    loop = asyncio.get_running_loop()
    r = _rounds.get(loop)
    if r is None:
        r = _rounds[loop] = SendRound()
    return r
