"""Which requests run, which wait, and how wide each one's tree may be (SpecPipe-DB).

No I/O: the router asks it on every arrival and departure.

- **Admission**: at most `max_running` requests run at once; up to `max_waiting` more
  wait, and a request beyond that is refused at once (the router answers
  RESOURCE_EXHAUSTED). Waiting requests are admitted by priority, highest first, then
  by arrival; a waiting request gains one priority level per `aging_seconds` it has
  waited, so none waits forever behind a stream of more important ones.
- **Elastic width**: the rows one pipeline step can take cheaply (`row_budget`, from the
  stages' measured cost curves) are shared by the running requests. Each takes about
  `width` rows per step per stage (specpipe: one tree layer in every stage; pp and
  autoregressive: one row; specinfer: its tree of `depth` x `width` rows once per S
  steps). Every request keeps width 1; the rest of the budget goes to requests by
  priority, highest first, then by arrival, up to the width each asked for, so
  best-effort requests shrink first and come back when the load drops.
- **No starvation** of admitted requests: every stage runs every ready row of every
  running request each step (the budget shapes trees, it never skips a request).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from .options import Mode

DEFAULT_MAX_RUNNING = 64  # requests decoding at once
DEFAULT_MAX_WAITING = 256  # requests queued beyond those; more are refused


class QueueFull(Exception):
    """The waiting queue is full: refuse the request now."""


@dataclass
class Ticket:
    """One request as the scheduler sees it."""

    request_id: str
    priority: int
    mode: Mode
    width: int  # as asked for
    depth: int = 1  # specinfer tree depth
    arrival: int = 0
    queued_at: float = 0.0
    granted: int = 0  # width it may use now


@dataclass
class Scheduler:
    max_running: int
    max_waiting: int
    num_stages: int = 1
    row_budget: int | None = None  # None: every request gets the width it asked for
    aging_seconds: float = 10.0
    clock: Callable[[], float] = field(default=lambda: 0.0)
    running: dict[str, Ticket] = field(default_factory=dict)
    waiting: list[Ticket] = field(default_factory=list)
    _arrivals: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        if self.row_budget is not None and self.row_budget < 1:
            raise ValueError("row_budget must be >= 1")

    def submit(self, ticket: Ticket) -> bool:
        """True: runs now; False: waits (see `admitted` after each `finish`). QueueFull
        when it can do neither."""
        ticket.arrival = next(self._arrivals)
        ticket.queued_at = self.clock()
        if len(self.running) < self.max_running and not self.waiting:
            self.running[ticket.request_id] = ticket
            self._share_width()
            return True
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(
                f"{len(self.running)} requests are running and {len(self.waiting)} waiting "
                "(the most this router queues); retry later"
            )
        self.waiting.append(ticket)
        return False

    def finish(self, request_id: str) -> list[Ticket]:
        """A request left (done, failed or cancelled, running or waiting); the waiting
        requests it makes room for, now running."""
        self.waiting = [t for t in self.waiting if t.request_id != request_id]
        if self.running.pop(request_id, None) is None:
            return []
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            best = max(self.waiting, key=self._rank)
            self.waiting.remove(best)
            self.running[best.request_id] = best
            admitted.append(best)
        self._share_width()
        return admitted

    def _rank(self, t: Ticket) -> tuple[float, int]:
        waited = self.clock() - t.queued_at
        aged = t.priority + (math.floor(waited / self.aging_seconds) if self.aging_seconds else 0)
        return (aged, -t.arrival)

    # -- elastic width ---------------------------------------------------------------------
    def _rows_per_step(self, t: Ticket, width: int) -> float:
        if t.mode == Mode.SPECINFER:
            return width * t.depth / max(self.num_stages, 1)
        return width if t.mode == Mode.SPECPIPE else 1

    def _share_width(self) -> None:
        tickets = sorted(self.running.values(), key=lambda t: (-t.priority, t.arrival))
        if self.row_budget is None:
            for t in tickets:
                t.granted = t.width
            return
        left = self.row_budget - sum(self._rows_per_step(t, 1) for t in tickets)
        for t in tickets:
            t.granted = 1
            if t.mode not in (Mode.SPECPIPE, Mode.SPECINFER) or left <= 0:
                continue
            per_width = self._rows_per_step(t, 1)
            extra = min(t.width - 1, int(left // per_width))
            t.granted += extra
            left -= extra * per_width
