"""The services' side of request leases (`common/runtime/lease.py`): who a lease call
comes from, and the task that frees requests whose lease ran out.

A lease owner is the name a router gives itself as the service can vouch for it. With
mutual TLS (--secure) only the deployment's own services reach a stage or the draft, so
the name is the owner. Without it anybody may call, so the owner is the name at the
caller's host (the gRPC peer's address, which a caller elsewhere cannot forge): a call
from another host naming the same router is another owner, and can neither renew,
supersede nor free the router's requests. A restarted router on the same host still
frees its predecessor's requests at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from specpipe.common.runtime.errors import InvalidInput
from specpipe.common.runtime.lease import LeaseClaim, LeaseTable


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:10.0.0.5:4711", "ipv6:[::1]:4711",
    "unix:/path"): what a caller cannot choose."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1 : rest.find("]")]
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return peer  # unix sockets and anything else: the whole string


def lease_claim(
    owner: str, epoch: int, token: bytes, context, authenticated: bool
) -> LeaseClaim | None:
    """The claim of a call that names `owner` (None: it names none). `authenticated`:
    the caller holds the deployment's certificate (--secure)."""
    if not owner:
        if token:
            raise InvalidInput("a lease token without a lease owner")
        return None
    if not authenticated:
        owner = f"{owner}@{peer_host(context.peer() or '')}"
    return LeaseClaim(owner, int(epoch), bytes(token))


# A draining stage or draft (SIGTERM) keeps only the requests their routers still claim:
# its leases shrink to this (`LeaseTable.shorten`), and a router renews the requests it
# has on a draining replica every health check (router/service.py, `_renew_forever`).
# A crashed router's requests then end the drain within seconds instead of holding the
# process for the whole drain (it took 25 s of an idle stage's stop); several missed
# renewals fit in it before a live router's request would be freed.
DRAIN_LEASE_SECONDS = 3.0
# How often a router renews its requests on a draining replica (its health checks' pace).
DRAIN_RENEW_SECONDS = 0.5


async def reap_expired(leases: LeaseTable, free: Callable[[str], object]) -> None:
    """Forever: every quarter of the lease time (at most a second; the lease time may
    shrink while draining), `free` each request whose lease expired (a coroutine
    function's result is awaited)."""
    while True:
        await asyncio.sleep(min(1.0, leases.seconds / 4))
        for rid in leases.expired():
            leases.end(rid)
            result = free(rid)
            if asyncio.iscoroutine(result):
                await result
