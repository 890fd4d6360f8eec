"""Which requests ran beside a request of another setting: requests of one model version
share every forward, so a request's time between tokens measures its setting only where
no other setting ran beside it (`common/perf/tuning.py`'s phases; the router's
`services/router/tuning.py` tells it when requests are decided, start and end).

A request decided but still waiting in admission runs no forward: it is not live, and
marks no running request mixed, until it starts (`queue`, then `start`)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

QUEUED = -1  # a ticket's mark while its request waits to start


@dataclass
class Overlaps:
    """Which requests ran beside one of another setting (one model version's requests
    share every forward): `begin` when a request starts running (or `queue` when it is
    decided and `start` when admitted), `end` when it finished says whether it was
    clean. A request is mixed once two settings are live together while it is: then
    every live request is (any two settings live mark all: each live one differs from
    one of them), so a count of such moments (`mixings`) decides in O(1)."""

    live: dict[Hashable, int] = field(default_factory=dict)  # setting -> requests live
    mixings: int = 0
    tickets: dict[int, tuple[Hashable, int]] = field(default_factory=dict)
    _next: int = 0

    def queue(self, setting: Hashable) -> int:
        """A request with `setting` is decided but does not run yet; its ticket for
        `start` and `end`."""
        ticket, self._next = self._next, self._next + 1
        self.tickets[ticket] = (setting, QUEUED)
        return ticket

    def start(self, ticket: int) -> None:
        """The queued request starts running (its forwards are shared from now on)."""
        entry = self.tickets.get(ticket)
        if entry is None or entry[1] != QUEUED:  # ended, or started already
            return
        setting = entry[0]
        if any(s != setting for s in self.live):
            self.mixings += 1
        self.live[setting] = self.live.get(setting, 0) + 1
        # a request that starts beside another setting is mixed from its start
        self.tickets[ticket] = (setting, self.mixings - (len(self.live) > 1))

    def begin(self, setting: Hashable) -> int:
        """A request with `setting` starts running now; its ticket for `end`."""
        ticket = self.queue(setting)
        self.start(ticket)
        return ticket

    def end(self, ticket: int) -> bool:
        """The request ended: whether no other setting ran beside it (one that never
        started ran nothing: not clean)."""
        if ticket not in self.tickets:  # ended already
            return False
        setting, seen = self.tickets.pop(ticket)
        if seen == QUEUED:
            return False
        left = self.live[setting] - 1
        if left:
            self.live[setting] = left
        else:
            del self.live[setting]
        return seen == self.mixings
