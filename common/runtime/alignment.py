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
waits for something in flight (an earlier activation or a prune), or just opened on
the first stage (its prompt follows the Open at once: requests that start together
prefill together), or
whose next activation is due within the window by its own cadence (the mean time
between its activations here, give or take their usual spread: one step in specpipe,
S steps in pp, so a pp request that left for the next stage is not waited for, nor one
whose activations come too irregularly to tell). The draft, where every open request asks
once per step at irregular times, also expects the requests of its last batch. The
wait is bounded: `window` seconds per round (fixed, or a fraction of the recent
forwards with a hard cap), counted from the moment the round could first have started,
so no ready request waits longer. It never waits with one request open, or when every
request it would wait for is ready.

Requests out of phase by up to a whole forward (a client's next request joining while
others run, or two groups that formed so) would wait for each other in turn, one short
window each, and never merge. So the *younger* requests also wait for older ones due
within a longer join window (a few forwards, capped): only they pay it, once, and then
run in the older requests' phase; an older request waited for in vain is not waited
for again until it has come (measured: benchmarks/README.md, "Step alignment").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

AUTO_FRACTION = 0.5  # of the stage's recent forward time
AUTO_CAP = 0.020  # seconds: the most an automatic window waits
MAX_WAIT = 1.0  # seconds: the most an explicit window may be
JOIN_FRACTION = 2.0  # younger requests wait for older ones up to 2 recent forwards,
JOIN_CAP = 0.250  # and at most this many seconds
EMA = 0.5  # weight of the newest sample in the running means


@dataclass
class _Cadence:
    """When a request's activations reach this stage."""

    last: float  # arrival of its latest activation (or its opening, before any)
    period: float | None = None  # mean time between activations (bursts excluded)
    spread: float = 0.0  # mean deviation of those times from `period`
    fresh: bool = False  # opened here, no activation yet


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
        self._established: set[str] = set()  # requests that took part in a round
        self._rank: dict[str, int] = {}  # order in which requests first showed up here
        self._next_rank = 0
        self._joins: set[str] = set()  # requests that wait to join older ones' phase
        self._missed: set[str] = set()  # waited for to join, did not come: not again yet

    @property
    def window(self) -> float:
        """The most one round waits, in seconds."""
        if self.wait is not None:
            return self.wait
        if self.forward_seconds is None:
            return 0.0
        return min(self.cap, self.fraction * self.forward_seconds)

    @property
    def join_window(self) -> float:
        """The most a round of younger requests only waits for older ones: a few
        forwards, so that they enter the older requests' phase (a newcomer computed
        alone runs a forward out of phase with them: a convoy that lasts)."""
        f = self.forward_seconds or 0.0
        return max(self.window, min(JOIN_CAP, JOIN_FRACTION * f)) if self.window > 0 else 0.0

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
        self._rank_of(request_id)
        self._missed.discard(request_id)
        c = self._cadence.get(request_id)
        if c is None or c.fresh:
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

    def opened(
        self, request_id: str, now: float | None = None, joins: bool = False, first: bool = True
    ) -> None:
        """The request was opened here. On the `first` stage its first activation (the
        prompt, which the router feeds right after opening it everywhere) is expected
        within a window of now; a later stage gets it only after the stages before have
        computed it, so there nothing is expected of it yet. `joins`:
        it has an activation at every stage each step (specpipe), so it waits the join
        window for older such requests (for pp a phase of its own costs nothing: its
        one activation is at one stage at a time, and waiting would)."""
        now = self.clock() if now is None else now
        if joins:
            self._joins.add(request_id)
        self._rank_of(request_id)
        self._cadence[request_id] = _Cadence(now, fresh=first)

    def _rank_of(self, request_id: str) -> None:
        if request_id not in self._rank:
            self._rank[request_id] = self._next_rank
            self._next_rank += 1

    def computed(self, seconds: float) -> None:
        """A forward that computed rows took `seconds` (the automatic window follows it)."""
        f = self.forward_seconds
        self.forward_seconds = seconds if f is None else EMA * seconds + (1 - EMA) * f

    def forget(self, request_id: str) -> None:
        """The request left the stage."""
        self._cadence.pop(request_id, None)
        self._established.discard(request_id)
        self._rank.pop(request_id, None)
        self._missed.discard(request_id)
        self._joins.discard(request_id)

    # -- the decision ----------------------------------------------------------------------
    def expected(
        self,
        ready: Collection[str],
        active: Collection[str],
        blocked: Collection[str] = (),
        now: float | None = None,
        horizon: float | None = None,
    ) -> set[str]:
        """Requests a round starting now would miss and that should come within
        `horizon` (default: the window): `blocked` ones (work pending behind something in
        flight), ones opened on the first stage less than a window ago that have sent
        nothing yet, and those due by their cadence (at most one period overdue: one
        later than that has stopped; and regular enough to tell: their spread within the
        horizon)."""
        now = self.clock() if now is None else now
        window, out = self.window, set()
        horizon = window if horizon is None else horizon
        for rid in active:
            if rid in ready:
                continue
            if rid in blocked or (self.expect_recent and rid in self._previous):
                out.add(rid)
                continue
            c = self._cadence.get(rid)
            if c is not None and c.fresh:
                if now - c.last <= window:
                    out.add(rid)
                continue
            if c is None or c.period is None:
                continue
            due = c.last + c.period
            if c.spread <= horizon and due - now <= horizon and now - due <= c.period:
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
        wait is counted from the first call since the last `started`: at most the window,
        or the join window when requests older than every ready one (running here
        before them) are due within it: the younger wait for the older, never the other
        way round, so groups out of phase merge into one instead of waiting for each
        other in turn. An older request waited for in vain is not waited for again to
        join until it has come."""
        now = self.clock() if now is None else now
        window = self.window
        if window <= 0 or not ready or len(active) <= 1:
            return 0.0
        expected = self.expected(ready, active, blocked, now)
        joining = self.expected(ready, self._seniors(ready, active), (), now, self.join_window)
        if not expected and not joining:
            return 0.0
        if self._deadline is None:
            self._deadline = now + (self.join_window if joining else window)
        if now >= self._deadline:
            self._missed |= joining
            return 0.0
        return self._deadline - now

    def _seniors(self, ready: Collection[str], active: Collection[str]) -> set[str]:
        """Running requests that showed up here before every ready one (all of them
        requests that join: see `opened`)."""
        if not ready or not self._joins.issuperset(ready):
            return set()
        first = min(self._rank.get(r, 1 << 62) for r in ready)
        return {
            r
            for r in active
            if r in self._joins
            and r in self._established
            and r not in self._missed
            and self._rank.get(r, 1 << 62) < first
        }

    def started(self, requests: Collection[str] | None = None) -> None:
        """The round of `requests` started (None: no round, nothing is ready): the next
        one's wait is counted afresh."""
        self._deadline = None
        if requests is not None:
            self._previous = frozenset(requests)
            self._established.update(requests)
