"""The services' side of request leases (`common/runtime/lease.py`): the task that frees
requests whose lease ran out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from specpipe.common.runtime.lease import LeaseTable


async def reap_expired(leases: LeaseTable, free: Callable[[str], object]) -> None:
    """Forever: every quarter of the lease time (at most a second), `free` each request
    whose lease expired (a coroutine function's result is awaited)."""
    every = min(1.0, leases.seconds / 4)
    while True:
        await asyncio.sleep(every)
        for rid in leases.expired():
            leases.end(rid)
            result = free(rid)
            if asyncio.iscoroutine(result):
                await result
