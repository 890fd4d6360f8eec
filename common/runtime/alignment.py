"""When a stage's (or the draft's) compute round should wait for requests expected
shortly (no I/O).

A stage runs every ready activation of all its requests in one batched forward
(SpecPipe-DB). Requests of one pipeline step rarely become ready at the same instant:
the router feeds stage 1 one gRPC call per request, and requests that joined at other
times run out of phase. A request that misses a round by a few milliseconds waits a
whole forward for the next one, and it keeps that phase at every stage after (a
convoy: each stage runs two forwards per step where one would do).

`StepAligner` decides how long a round that could start now should wait. It waits only
for requests *expected*: open here, not ready, and either with work already pending that
waits for something in flight (an earlier activation or a prune) or whose next
activation is due within the window by its own cadence (the mean time between its
activations here, give or take their usual spread: one step in specpipe, S steps in
pp, so a pp request that left for the next stage is not waited for, nor one whose
activations come too irregularly to tell). The draft, where every open request asks
once per step at irregular times, also expects the requests of its last batch. The
wait is bounded: `window` seconds per round (fixed, or a fraction of the recent
forwards with a hard cap), counted from the moment the round could first have started,
so no ready request waits longer. It never waits with one request open, or when every
request it would wait for is ready.

What it does not do: merge groups of requests a whole forward apart (a convoy that
formed when a request joined). That takes a wait as long as a forward, which costs
every ready request that much whenever the guess is wrong (measured:
benchmarks/README.md, "Step alignment").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

AUTO_FRACTION = 0.5  # of the stage's recent forward time
AUTO_CAP = 0.020  # seconds: the most an automatic window waits
MAX_WAIT = 1.0  # seconds: the most an explicit window may be
EMA = 0.5  # weight of the newest sample in the running means


@dataclass
class _Cadence:
    """When a request's activations reach this stage."""

    last: float  # arrival of its latest activation
    period: float | None = None  # mean time between activations (bursts excluded)
    spread: float = 0.0  # mean deviation of those times from `period`


class StepAligner:
    """Per stage: how long a compute round waits for requests expected shortly."""

    def __init__(
        self,
        wait: float | None = None,
        fraction: float = AUTO_FRACTION,
        cap: float = AUTO_CAP,
        clock: Callable[[], float] = time.monotonic,
        expect_recent: bool = False,
    ) -> None:
        """`wait`: a fixed window in seconds (0: never wait); None: `fraction` of the
        stage's recent forward time, at most `cap` (nothing before the first forward).
        `expect_recent`: requests of the previous round are expected too (the draft:
        every open request asks once per step, at irregular times)."""
        if wait is not None and not 0 <= wait <= MAX_WAIT:
            raise ValueError(f"the batch wait must be in [0, {MAX_WAIT * 1e3:.0f}] ms")
        self.wait, self.fraction, self.cap = wait, fraction, cap
        self.clock = clock
        self.forward_seconds: float | None = None  # running mean of forwards with rows
        self._cadence: dict[str, _Cadence] = {}
        self._deadline: float | None = None  # end of the current round's wait
        self.expect_recent = expect_recent
        self._previous: frozenset[str] = frozenset()  # requests of the last round

    @property
    def window(self) -> float:
        """The most one round waits, in seconds."""
        if self.wait is not None:
            return self.wait
        if self.forward_seconds is None:
            return 0.0
        return min(self.cap, self.fraction * self.forward_seconds)

    @property
    def requests(self) -> Collection[str]:
        """Requests that arrived here and were not forgotten (the draft's active set)."""
        return self._cadence.keys()

    # -- what the stage reports ------------------------------------------------------------
    def arrived(self, request_id: str, now: float | None = None) -> None:
        """An activation of `request_id` reached the stage. Arrivals closer together than
        half the window (prefill chunks, turns an upstream stage ran in one round) are one
        burst: they do not count as the request's cadence."""
        now = self.clock() if now is None else now
        c = self._cadence.get(request_id)
        if c is None:
            self._cadence[request_id] = _Cadence(now)
            return
        gap = now - c.last
        if gap >= self.window / 2 and gap > 0:
            if c.period is None:
                c.period = gap
            else:
                c.spread = EMA * abs(gap - c.period) + (1 - EMA) * c.spread
                c.period = EMA * gap + (1 - EMA) * c.period
        c.last = now

    def computed(self, seconds: float) -> None:
        """A forward that computed rows took `seconds` (the automatic window follows it)."""
        f = self.forward_seconds
        self.forward_seconds = seconds if f is None else EMA * seconds + (1 - EMA) * f

    def forget(self, request_id: str) -> None:
        """The request left the stage."""
        self._cadence.pop(request_id, None)

    # -- the decision ----------------------------------------------------------------------
    def expected(
        self,
        ready: Collection[str],
        active: Collection[str],
        blocked: Collection[str] = (),
        now: float | None = None,
    ) -> set[str]:
        """Requests a round starting now would miss and that should come within the
        window: `blocked` ones (work pending behind something in flight) and those due by
        their cadence (at most one period overdue: one later than that has stopped; and
        regular enough to tell: their spread within the window)."""
        now = self.clock() if now is None else now
        window, out = self.window, set()
        for rid in active:
            if rid in ready:
                continue
            if rid in blocked or (self.expect_recent and rid in self._previous):
                out.add(rid)
                continue
            c = self._cadence.get(rid)
            if c is None or c.period is None:
                continue
            due = c.last + c.period
            if c.spread <= window and due - now <= window and now - due <= c.period:
                out.add(rid)
        return out

    def hold(
        self,
        ready: Collection[str],
        active: Collection[str],
        blocked: Collection[str] = (),
        now: float | None = None,
    ) -> float:
        """Seconds the round that could start now should still wait (0: start it). The
        window is counted from the first call since the last `started`."""
        now = self.clock() if now is None else now
        window = self.window
        if window <= 0 or not ready or len(active) <= 1:
            return 0.0
        if not self.expected(ready, active, blocked, now):
            return 0.0
        if self._deadline is None:
            self._deadline = now + window
        return max(0.0, self._deadline - now)

    def started(self, requests: Collection[str] | None = None) -> None:
        """The round of `requests` started (None: no round, nothing is ready): the next
        one's wait is counted afresh."""
        self._deadline = None
        if requests is not None:
            self._previous = frozenset(requests)
