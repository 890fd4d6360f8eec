"""The events of one request's driver, one typed union: a data-plane frame from the last
stage (routed from the router's inbox), a draft's answer, a failed call, the end of a
late-draft hold. They reach the driver in order, one at a time, so that its controller
is never touched concurrently: handled at once where the driver is parked waiting for
one, else through its `EventQueue`."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

import grpc
from specpipe.common.spec.messages import Candidates

from ..transport.codec import Frame
from .backends import Backend


@dataclass(frozen=True)
class Proposal:
    """The draft answered `Propose` `ticket` (on path `attempt`)."""

    attempt: int
    ticket: int
    cand: Candidates


@dataclass(frozen=True)
class Failure:
    """A call of path `attempt` failed, a replica of it went down or stalled, or the path
    went silent (`backend`: which replica, when known; `replayable`: another path may
    serve the request)."""

    attempt: int
    code: grpc.StatusCode
    message: str
    backend: Backend | None = None
    replayable: bool = False


@dataclass(frozen=True)
class HoldExpired:
    """Verifications held for a late draft may wait no longer (`late_draft.py`)."""


Event = Frame | Proposal | Failure | HoldExpired


class EventQueue:
    """A driver's events waiting for it, in arrival order, and its one wait for the next
    (an `asyncio.Queue` without what one owner does not need: its put and get cost a
    good part of a step's event-loop work, issue 34)."""

    def __init__(self) -> None:
        self._items: deque[Event] = deque()
        self._waiter: asyncio.Future | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, ev: Event) -> None:
        self._items.append(ev)
        self.wake()

    def get_nowait(self) -> Event:
        return self._items.popleft()

    @property
    def parked(self) -> bool:
        """Whether the owner waits in `wait` and nothing woke it yet."""
        return self._waiter is not None and not self._waiter.done()

    def wake(self) -> None:
        """End the owner's `wait` (an event came, or something else needs it)."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        """Until `wake` (returns at once while events wait)."""
        if self._items:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
