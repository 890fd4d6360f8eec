"""Per-request state as a lease, without I/O (docs/architecture.md, "9. Security").

A stage or the draft holds a request's cache only while its router keeps the lease
alive: every call and frame of the request renews it, and the router renews every
request it has open with one cheap `Renew` call per backend while they are idle. A lease
that is not renewed for `seconds` expires and the service frees the request, so a
crashed router leaks nothing.

Each router process claims its leases (`LeaseClaim`) as an owner (its name, as the
service authenticated it: see `services/lease.py`), an epoch (the process's start time
in ns, a number: a later process has a larger one) and a random token of that process.
When a new epoch of an owner shows up, the requests of its earlier epochs are its dead
predecessor's: they are freed at once instead of after the lease time. A call from an
epoch older than the newest one seen is `Superseded`; a call from the newest epoch with
another token is `NotOwner` (it renews and frees nothing); a keep-alive renews only the
leases of its own owner and epoch.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .errors import InvalidInput, NotOwner, RequestError

DEFAULT_LEASE_SECONDS = 60.0
MIN_TOKEN_BYTES = 16  # a router's lease token: random, never guessed
MAX_TOKEN_BYTES = 64
MAX_OWNER_CHARS = 512
MAX_OWNERS = 4096  # owners remembered without live leases (routers: few, never unbounded)


class Superseded(RequestError):
    """A call from a router process that has been replaced by a newer one of the same
    owner (its requests were freed)."""


@dataclass(frozen=True)
class LeaseClaim:
    """Who holds or renews leases: an owner's process (`epoch`, `token`)."""

    owner: str
    epoch: int
    token: bytes

    def __post_init__(self) -> None:
        if not self.owner:
            raise InvalidInput("a lease claim needs an owner")
        if len(self.owner) > MAX_OWNER_CHARS:
            raise InvalidInput(
                f"a lease owner of {len(self.owner)} characters; at most {MAX_OWNER_CHARS}"
            )
        if not 0 <= self.epoch < 1 << 64:
            raise InvalidInput(f"lease epoch {self.epoch} is outside [0, 2^64)")
        if not MIN_TOKEN_BYTES <= len(self.token) <= MAX_TOKEN_BYTES:
            raise InvalidInput(
                f"a lease token of {len(self.token)} bytes; "
                f"it takes {MIN_TOKEN_BYTES} to {MAX_TOKEN_BYTES}"
            )


@dataclass
class Lease:
    owner: str  # "" without a claim: the lease only expires
    epoch: int
    expires: float


@dataclass(frozen=True)
class _Process:
    """An owner's newest process seen."""

    epoch: int
    token: bytes


class LeaseTable:
    def __init__(
        self, seconds: float = DEFAULT_LEASE_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if seconds <= 0:
            raise ValueError(f"the lease time must be positive, got {seconds}")
        self.seconds, self.clock = seconds, clock
        self._leases: dict[str, Lease] = {}
        self._owners: dict[str, _Process] = {}  # newest process seen per owner

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def _claimed(self, claim: LeaseClaim) -> list[str]:
        """Check `claim` against its owner's newest process; the requests of the owner's
        older epochs (to free now) when it is a newer process. Superseded if a newer
        epoch of the owner was seen already, NotOwner for the newest epoch with another
        token."""
        newest = self._owners.get(claim.owner)
        if newest is not None:
            if claim.epoch < newest.epoch:
                raise Superseded(
                    f"router {claim.owner!r} epoch {claim.epoch} was replaced by epoch "
                    f"{newest.epoch}: its requests were freed"
                )
            if claim.epoch == newest.epoch:
                if not hmac.compare_digest(claim.token, newest.token):
                    raise NotOwner(
                        f"router {claim.owner!r} epoch {claim.epoch}: the lease token is not "
                        "the one its requests were opened with"
                    )
                return []
        if len(self._owners) >= MAX_OWNERS:
            live = {lease.owner for lease in self._leases.values()}
            self._owners = {o: p for o, p in self._owners.items() if o in live}
        self._owners[claim.owner] = _Process(claim.epoch, claim.token)
        return [
            rid
            for rid, lease in self._leases.items()
            if lease.owner == claim.owner and lease.epoch != claim.epoch
        ]

    def grant(self, request_id: str, claim: LeaseClaim | None = None) -> list[str]:
        """Start the lease of a newly opened request (`claim`: its router's; None: the
        lease only expires); returns the requests of the owner's earlier epochs, which
        the caller frees (and `end`s)."""
        stale = self._claimed(claim) if claim is not None else []
        owner, epoch = (claim.owner, claim.epoch) if claim is not None else ("", 0)
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
        self, claim: LeaseClaim, request_ids: Iterable[str]
    ) -> tuple[list[str], list[str]]:
        """A router's keep-alive: renew those of `request_ids` that it holds (its owner's,
        of its epoch); returns (the other ids: no lease of its here, the requests of the
        owner's earlier epochs to free now)."""
        stale = self._claimed(claim)
        unknown = []
        for rid in request_ids:
            lease = self._leases.get(rid)
            if lease is None or lease.owner != claim.owner or lease.epoch != claim.epoch:
                unknown.append(rid)
            else:
                self.renew(rid)
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
