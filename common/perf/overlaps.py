"""Which requests ran beside a request of another setting: requests of one model version
share every forward, so a request's time between tokens measures its setting only where
no other setting ran beside it (`common/perf/tuning.py`'s phases; the router's
`services/router/tuning.py` tells it when requests begin and end)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass
class Overlaps:
    """Which requests ran beside one of another setting (one model version's requests
    share every forward): `begin` when a request is decided, `end` when it finished says
    whether it was clean. A request is mixed once two settings are live together while
    it is: then every live request is (any two settings live mark all: each live one
    differs from one of them), so a count of such moments (`mixings`) decides in O(1)."""

    live: dict[Hashable, int] = field(default_factory=dict)  # setting -> requests live
    mixings: int = 0
    tickets: dict[int, tuple[Hashable, int]] = field(default_factory=dict)
    _next: int = 0

    def begin(self, setting: Hashable) -> int:
        """A request with `setting` starts; its ticket for `end`."""
        if any(s != setting for s in self.live):
            self.mixings += 1
        self.live[setting] = self.live.get(setting, 0) + 1
        ticket, self._next = self._next, self._next + 1
        # a request that starts beside another setting is mixed from its start
        self.tickets[ticket] = (setting, self.mixings - (len(self.live) > 1))
        return ticket

    def end(self, ticket: int) -> bool:
        """The request ended: whether no other setting ran beside it."""
        if ticket not in self.tickets:  # ended already
            return False
        setting, seen = self.tickets.pop(ticket)
        left = self.live[setting] - 1
        if left:
            self.live[setting] = left
        else:
            del self.live[setting]
        return seen == self.mixings
