"""The services' side of request leases (`common/runtime/lease.py`): the task that frees
requests whose lease ran out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from specpipe.common.runtime.lease import LeaseTable

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
