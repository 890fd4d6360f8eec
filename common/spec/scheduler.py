"""Which requests run, which wait, and how wide each one's tree may be (SpecPipe-DB).

No I/O: the router asks it on every arrival and departure.

- **Admission**: at most `max_running` requests run at once; up to `max_waiting` more
  wait, and a request beyond that is refused at once (the router answers
  RESOURCE_EXHAUSTED). Each choice of a request with `n` choices is a request here.
- **Fair shares between tenants** (an API key, or a client address on a router without
  keys; `Ticket.tenant`): one tenant runs at most `max_running_per_tenant` requests (the
  router keeps an eighth of the slots for others, so a neighbour runs at once while one
  key floods) and queues at most `max_waiting_per_tenant`. A freed slot goes to the
  waiting tenant that runs fewest; a full queue refuses the newest waiting request of
  the tenant queueing most (`on_bumped`) for one of a tenant queueing less. Within a
  tenant (and between tenants running as many), waiting requests run by priority,
  highest first, then by arrival; a waiting request gains one priority level per
  `aging_seconds` it has waited, so none waits forever behind more important ones.
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
DEFAULT_MAX_WAITING_PER_TENANT = 64  # requests one API key (or address) may queue
RESERVE_SHARE = 8  # 1/8 of the running slots stay free for tenants other than a flooder


def default_running_per_tenant(max_running: int) -> int:
    """The most requests one tenant runs unless told: all but an eighth of the slots."""
    return max_running - max_running // RESERVE_SHARE


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
    tenant: str = ""  # who asked: an API key's id, or a client address
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
    # Per tenant (None: no cap beyond max_running / max_waiting).
    max_running_per_tenant: int | None = None
    max_waiting_per_tenant: int | None = None
    on_bumped: Callable[[Ticket], None] | None = None  # a waiting request refused for room
    running: dict[str, Ticket] = field(default_factory=dict)
    waiting: list[Ticket] = field(default_factory=list)
    _arrivals: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        if self.row_budget is not None and self.row_budget < 1:
            raise ValueError("row_budget must be >= 1")
        if (self.max_running_per_tenant or 1) < 1 or (self.max_waiting_per_tenant or 0) < 0:
            raise ValueError("max_running_per_tenant must be >= 1, max_waiting_per_tenant >= 0")

    @property
    def running_cap(self) -> int:
        return min(self.max_running_per_tenant or self.max_running, self.max_running)

    @property
    def waiting_cap(self) -> int:
        cap = self.max_waiting_per_tenant
        return self.max_waiting if cap is None else min(cap, self.max_waiting)

    def running_of(self, tenant: str) -> int:
        return sum(t.tenant == tenant for t in self.running.values())

    def waiting_of(self, tenant: str) -> int:
        return sum(t.tenant == tenant for t in self.waiting)

    def room(self, tenant: str) -> int:
        """How many more requests `tenant` may hold now (running or waiting)."""
        run = min(self.max_running - len(self.running), self.running_cap - self.running_of(tenant))
        return max(0, run) + max(0, self.waiting_cap - self.waiting_of(tenant))

    def check_room(self, tenant: str, n: int) -> None:
        """QueueFull unless `tenant` may hold `n` more requests now (a request's `n`
        choices, admitted together or not at all)."""
        room = self.room(tenant)
        if n > room:
            raise QueueFull(
                f"a request of {n} choices needs {n} slots; this client may take {room} now "
                f"(at most {self.running_cap} running and {self.waiting_cap} waiting): "
                "retry later, or ask for fewer choices"
            )

    def submit(self, ticket: Ticket) -> bool:
        """True: runs now; False: waits (see `admitted` after each `finish`). QueueFull
        when it can do neither."""
        ticket.arrival = next(self._arrivals)
        ticket.queued_at = self.clock()
        tenant = ticket.tenant
        running = self.running_of(tenant)
        if len(self.running) < self.max_running and running < self.running_cap:
            # (No waiting request could take the slot: `_fill` runs after every change.)
            self.running[ticket.request_id] = ticket
            self._share_width()
            return True
        queued = self.waiting_of(tenant)
        if queued >= self.waiting_cap:
            raise QueueFull(
                f"this client has {running} requests running and {queued} waiting, the most "
                "one API key (or address) may queue; retry later"
            )
        if len(self.waiting) >= self.max_waiting and not self._bump(tenant, queued):
            raise QueueFull(
                f"{len(self.running)} requests are running and {len(self.waiting)} waiting "
                "(the most this router queues); retry later"
            )
        self.waiting.append(ticket)
        return False

    def _bump(self, tenant: str, queued: int) -> bool:
        """Room in a full queue for a request of `tenant` (`queued` waiting): the newest
        waiting request of the tenant queueing most, if it queues more than `tenant`
        would."""
        counts: dict[str, int] = {}
        for t in self.waiting:
            counts[t.tenant] = counts.get(t.tenant, 0) + 1
        most = max(counts, key=counts.__getitem__, default=None)
        if most is None or counts[most] <= queued + 1:
            return False
        newest = max((t for t in self.waiting if t.tenant == most), key=lambda t: t.arrival)
        self.waiting.remove(newest)
        if self.on_bumped is not None:
            self.on_bumped(newest)
        return True

    def finish(self, request_id: str) -> list[Ticket]:
        """A request left (done, failed or cancelled, running or waiting); the waiting
        requests it makes room for, now running."""
        self.waiting = [t for t in self.waiting if t.request_id != request_id]
        if self.running.pop(request_id, None) is None:
            return []
        admitted = self._fill()
        self._share_width()
        return admitted

    def _fill(self) -> list[Ticket]:
        """Run waiting requests while slots are free: each time, of the tenants under
        their cap, the one running fewest, its best-ranked request."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            counts: dict[str, int] = {}
            for t in self.running.values():
                counts[t.tenant] = counts.get(t.tenant, 0) + 1
            ready = [t for t in self.waiting if counts.get(t.tenant, 0) < self.running_cap]
            if not ready:
                break
            best = max(ready, key=lambda t: (-counts.get(t.tenant, 0), self._rank(t)))
            self.waiting.remove(best)
            self.running[best.request_id] = best
            admitted.append(best)
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
