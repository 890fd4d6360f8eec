"""Per-request state as a lease (docs/architecture.md, "9. Security"), without I/O.

A stage or the draft holds a request's cache only while its router keeps the lease
alive: every call and frame of the request renews it, and the router renews every
request it has open with one cheap `Renew` call per backend while they are idle. A lease
that is not renewed for `seconds` expires and the service frees the request, so a
crashed router leaks nothing.

Each router names itself (`owner`: host and port, stable across restarts of the same
router) and each of its processes (`epoch`: start time first, so a later process has a
larger epoch). When a new epoch of an owner shows up, the requests of its earlier epochs
are its dead predecessor's: they are freed at once instead of after the lease time. A
call from an epoch older than the newest one seen is `Superseded`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .errors import RequestError

DEFAULT_LEASE_SECONDS = 60.0


class Superseded(RequestError):
    """A call from a router process that has been replaced by a newer one of the same
    owner (its requests were freed)."""


@dataclass
class Lease:
    owner: str
    epoch: str
    expires: float


class LeaseTable:
    def __init__(
        self, seconds: float = DEFAULT_LEASE_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if seconds <= 0:
            raise ValueError(f"the lease time must be positive, got {seconds}")
        self.seconds, self.clock = seconds, clock
        self._leases: dict[str, Lease] = {}
        self._epochs: dict[str, str] = {}  # newest epoch seen per owner

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def _owner_seen(self, owner: str, epoch: str) -> list[str]:
        """Record that `owner` runs as `epoch`; the requests of its older epochs (to free
        now). Superseded if a newer epoch of the owner was seen already."""
        if not owner:
            return []
        newest = self._epochs.get(owner)
        if newest is not None and epoch < newest:
            raise Superseded(
                f"router {owner!r} epoch {epoch!r} was replaced by epoch {newest!r}: "
                "its requests were freed"
            )
        if newest == epoch:
            return []
        if len(self._epochs) > 4096:  # owners are routers: few, but never unbounded
            live = {lease.owner for lease in self._leases.values()}
            self._epochs = {o: e for o, e in self._epochs.items() if o in live}
        self._epochs[owner] = epoch
        return [
            rid
            for rid, lease in self._leases.items()
            if lease.owner == owner and lease.epoch != epoch
        ]

    def grant(self, request_id: str, owner: str = "", epoch: str = "") -> list[str]:
        """Start the lease of a newly opened request; returns the requests of the owner's
        earlier epochs, which the caller frees (and `end`s)."""
        stale = self._owner_seen(owner, epoch)
        self._leases[request_id] = Lease(owner, epoch, self.clock() + self.seconds)
        return stale

    def renew(self, request_id: str) -> bool:
        """Traffic of the request: its lease runs for `seconds` from now. False if the
        request holds no lease here."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        lease.expires = self.clock() + self.seconds
        return True

    def renew_all(
        self, owner: str, epoch: str, request_ids: Iterable[str]
    ) -> tuple[list[str], list[str]]:
        """A router's keep-alive: renew its requests; returns (the ids that hold no lease
        here, the requests of the owner's earlier epochs to free now)."""
        stale = self._owner_seen(owner, epoch)
        unknown = [rid for rid in request_ids if not self.renew(rid)]
        return unknown, stale

    def expired(self) -> list[str]:
        """Requests whose lease ran out (the caller frees and `end`s them)."""
        now = self.clock()
        return [rid for rid, lease in self._leases.items() if lease.expires <= now]

    def end(self, request_id: str) -> None:
        self._leases.pop(request_id, None)

    def shorten(self, seconds: float) -> None:
        """From now on a lease runs at most `seconds` past its last renewal (a draining
        service: what its router no longer renews is freed soon, not after the full
        lease time)."""
        if seconds <= 0:
            raise ValueError(f"the lease time must be positive, got {seconds}")
        self.seconds = min(self.seconds, seconds)
        latest = self.clock() + self.seconds
        for lease in self._leases.values():
            lease.expires = min(lease.expires, latest)
