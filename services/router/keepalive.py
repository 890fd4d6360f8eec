"""The router's lease keep-alive: every replica renews the leases of this router's
requests on it, and a request a replica no longer holds is replayed elsewhere
(services/lease.py has the replicas' side)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from specpipe.common.runtime.lease import DEFAULT_LEASE_SECONDS
from specpipe.v1 import dataplane_pb2 as pb

from ..lease import DRAIN_RENEW_SECONDS
from .backends import Backend, Backends
from .calls import LeaseClaim
from .driver import RequestDriver

log = logging.getLogger(__name__)


class LeaseKeepAlive:
    """Renews, under `claim`, the leases of the requests in `drivers` (request id:
    driver, the engine's live table) on `backends`."""

    def __init__(
        self, backends: Backends, drivers: Mapping[str, RequestDriver], claim: LeaseClaim
    ) -> None:
        self.backends, self.drivers, self.claim = backends, drivers, claim
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._forever(), name="lease-renewal")

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def interval(self) -> float:
        """A third of the shortest lease any backend grants (they say in Describe)."""
        leases = [b.desc.lease_seconds for b in self.backends.all if b.desc is not None]
        leases = [t for t in leases if t > 0] or [DEFAULT_LEASE_SECONDS]
        return min(leases) / 3

    async def renew(self, draining_only: bool = False) -> None:
        """One keep-alive round: every backend (or, `draining_only`, every draining one)
        renews the leases of this router's requests on it (by their ids on their current
        paths); a request a backend no longer holds (its lease expired, or the backend
        restarted) is replayed elsewhere."""
        held: dict[Backend, dict[str, RequestDriver]] = {}
        for d in self.drivers.values():
            if d.holding:
                for b in d.path.backends:
                    held.setdefault(b, {})[d.wire_id] = d
        backends = [
            b for b in self.backends.all if b.stub is not None and (b.draining or not draining_only)
        ]
        c = self.claim
        calls = [
            b.stub.Renew(
                pb.RenewRequest(
                    owner=c.owner, epoch=c.epoch, token=c.token, request_ids=list(held.get(b, {}))
                ),
                timeout=5.0,
            )
            for b in backends
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for b, r in zip(backends, results, strict=True):
            if isinstance(r, BaseException):
                log.debug("renewing leases on %s failed: %s", b.label, r)
                continue
            for wire_id in r.unknown_ids:
                d = held.get(b, {}).get(wire_id)
                if d is not None and d.wire_id == wire_id:
                    d.backend_down(
                        b, "it no longer holds this request (its lease expired or it restarted)"
                    )

    async def _forever(self) -> None:
        """Every `interval`; and a draining replica's leases every DRAIN_RENEW_SECONDS,
        since it frees what no router renews within its short drain lease."""
        due = time.monotonic() + self.interval()
        while True:
            await asyncio.sleep(max(0.0, min(DRAIN_RENEW_SECONDS, due - time.monotonic())))
            if time.monotonic() >= due:
                await self.renew()
                due = time.monotonic() + self.interval()
            elif any(b.draining for b in self.backends.all):
                await self.renew(draining_only=True)
