"""One request's draft calls, one at a time in the order the controller created them,
chained by their answers' callbacks: no task, queue or timeout context per request or
call (issue 34: each was an event-loop wake-up per call and pipeline step). A call on the
draft's control stream is an `InPlaceFuture` (in_place.py): its lane sees the answer
where the draft's reply is read, so one reply's answers to many requests are handled in
one pass.

The draft service adds no ordering of its own (services/draft_service.py runs a
stream's `Prefill` and `Prune` calls as tasks of their own, beside the batched
`Propose`s), so a call goes out only once the one before it was answered, as before.
A call's deadline (`Deadline.timeout` when it starts) is checked by one `DeadlineSweep`
per event loop, a timer armed at the earliest deadline of all requests' calls in flight
rather than one per call: a call past it is given up (its future cancelled) and fails
the lane as a unary call past its deadline would. The first failure stops the lane; its
owner tells the driver (which goes on without the draft)."""

from __future__ import annotations

import asyncio
import math
import time
import weakref
from collections import deque
from collections.abc import Callable

import grpc

from .backends import Backend
from .batched import refusal
from .calls import Deadline
from .in_place import when_done

Start = Callable[[Backend], asyncio.Future]  # (the draft) -> the call's answer
OnAnswer = Callable[[object], None]  # the answer's result (a ProposeResponse, or None)
OnFailure = Callable[[str, BaseException], None]  # (what the call was doing, the error)
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


class DraftLane:
    def __init__(self, draft: Backend, deadline: Deadline, on_failure: OnFailure) -> None:
        """`deadline`: the request's (each call's timeout); `on_failure`: told of the
        first call that failed or ran past its deadline (then the lane stops)."""
        self.draft, self.deadline, self.on_failure = draft, deadline, on_failure
        self._todo: deque[tuple[str, Start, OnAnswer | None]] = deque()
        self._call: asyncio.Future | None = None  # the call in flight
        self._what = ""
        self._on_answer: OnAnswer | None = None
        self.due = math.inf  # the call in flight's deadline (time.monotonic())
        self.closed = False
        self._sweep = sweep_of(asyncio.get_running_loop())

    def add(self, what: str, start: Start, on_answer: OnAnswer | None = None) -> None:
        """Call the draft after the calls before it were answered; `on_answer` takes
        the answer's result."""
        if self.closed:
            return
        self._todo.append((what, start, on_answer))
        if self._call is None:
            self._next()

    def close(self) -> None:
        """No more calls: the one in flight is given up, the rest never sent."""
        self.closed = True
        self._todo.clear()
        self._sweep.forget(self)
        call, self._call = self._call, None
        self.due = math.inf
        if call is not None:
            call.cancel()

    def expire(self) -> None:
        """The call in flight is past its deadline: a draft that answers nothing is a
        fault, as a unary call past its deadline."""
        call, self._call = self._call, None
        self.due = math.inf
        if call is None:
            return
        call.cancel()
        self._fail(refusal(DEADLINE_EXCEEDED, f"no answer from {self.draft.label}"))

    # -- the chain ---------------------------------------------------------------------
    def _next(self) -> None:
        while self._call is None and self._todo and not self.closed:
            what, start, on_answer = self._todo.popleft()
            self._what, self._on_answer = what, on_answer
            try:
                call = start(self.draft)
            except Exception as e:
                self._fail(e)
                return
            self._call = call
            self.due = time.monotonic() + self.deadline.timeout()
            self._sweep.watch(self)
            when_done(call, self._answered)  # a frame's answers: in one pass

    def _answered(self, call: asyncio.Future) -> None:
        if call is not self._call:
            return  # given up: closed, or expired (already failed)
        self._call, self.due = None, math.inf
        if call.cancelled():  # by someone else than this lane: the call is lost
            self._fail(RuntimeError("the call was cancelled"))
            return
        error = call.exception()
        if error is not None:
            self._fail(error)
            return
        if self._on_answer is not None:
            try:
                self._on_answer(call.result())
            except Exception as e:  # a malformed answer: as a failed call
                self._fail(e)
                return
        self._next()

    def _fail(self, error: BaseException) -> None:
        what = self._what
        self.close()
        self.on_failure(what, error)


class DeadlineSweep:
    """The deadlines of the draft calls in flight on one event loop: one timer, at the
    earliest of them when it was armed; each time it fires, the lanes past theirs are
    expired and it is armed again at the earliest left. A call that starts with an
    earlier deadline than the timer's moves it."""

    def __init__(self) -> None:
        self.lanes: set[DraftLane] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf

    def watch(self, lane: DraftLane) -> None:
        self.lanes.add(lane)
        if lane.due < self._at:
            self._arm(lane.due)

    def forget(self, lane: DraftLane) -> None:
        """`lane` is closed; with no lane left, no timer either (nor its loop held)."""
        self.lanes.discard(lane)
        if not self.lanes and self._timer is not None:
            self._timer.cancel()
            self._timer, self._at = None, math.inf

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = at
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(at - time.monotonic(), 0.0), self.sweep)

    def sweep(self) -> None:
        """Expire the lanes past their deadline; forget the idle ones."""
        self._timer, self._at = None, math.inf
        now = time.monotonic()
        try:
            for lane in list(self.lanes):
                if lane.closed or lane.due == math.inf:
                    self.lanes.discard(lane)
                elif lane.due <= now:
                    self.lanes.discard(lane)
                    lane.expire()
        finally:  # the other lanes' deadlines stay watched whatever one expiry raised
            earliest = min((lane.due for lane in self.lanes if not lane.closed), default=math.inf)
            if earliest < math.inf:
                self._arm(earliest)


_sweeps: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DeadlineSweep] = (
    weakref.WeakKeyDictionary()
)


def sweep_of(loop: asyncio.AbstractEventLoop) -> DeadlineSweep:
    """The event loop's one sweep of draft-call deadlines (with no lane open it holds no
    timer, so nothing of the loop: the entry goes with the loop)."""
    sweep = _sweeps.get(loop)
    if sweep is None:
        sweep = _sweeps[loop] = DeadlineSweep()
    return sweep
