"""Admission: a request waits here for a running slot. The scheduler
(common/spec/scheduler.py) decides who runs, fair between tenants and then by
priority; this turns its decisions into awaitable answers and applies the widths it
grants to the running requests' controllers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import grpc
from specpipe.common.spec.scheduler import (
    DEFAULT_MAX_RUNNING,
    DEFAULT_MAX_WAITING,
    DEFAULT_MAX_WAITING_PER_TENANT,
    QueueFull,
    Scheduler,
    Ticket,
    default_running_per_tenant,
)

from .driver import RequestDriver
from .requests import Plan, RequestFailed


class Admission:
    """Running slots for the requests of `drivers` (request id: driver, the engine's
    live table). A key (tenant) runs at most `max_running_per_key` requests (None: all
    but an eighth of `max_running`) and queues at most `max_waiting_per_key`."""

    def __init__(
        self,
        drivers: Mapping[str, RequestDriver],
        max_running: int = DEFAULT_MAX_RUNNING,
        max_waiting: int = DEFAULT_MAX_WAITING,
        max_running_per_key: int | None = None,
        max_waiting_per_key: int = DEFAULT_MAX_WAITING_PER_TENANT,
    ) -> None:
        self.drivers = drivers
        self.scheduler = Scheduler(
            max_running,
            max_waiting,
            clock=time.monotonic,
            max_running_per_tenant=max_running_per_key or default_running_per_tenant(max_running),
            max_waiting_per_tenant=max_waiting_per_key,
            on_bumped=self._bumped,
        )
        self._waiting: dict[str, asyncio.Future] = {}

    async def admit(
        self, rid: str, plan: Plan, priority: int, deadline: float | None, tenant: str = ""
    ) -> None:
        """Run now, or wait in the queue (fair between tenants, then by priority) until
        a running request leaves; RESOURCE_EXHAUSTED when refused, now or later (a full
        queue made room for a tenant queueing less)."""
        ticket = Ticket(rid, priority, plan.mode, plan.opts.width, plan.opts.depth, tenant=tenant)
        try:
            if self.scheduler.submit(ticket):
                return
        except QueueFull as e:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        admitted = self._waiting[rid] = asyncio.get_running_loop().create_future()
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            await asyncio.wait_for(asyncio.shield(admitted), timeout)
        except TimeoutError:
            raise RequestFailed(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the deadline passed while the request waited for a slot (the router is busy)",
            ) from None
        finally:
            if not admitted.done():  # gave up waiting (deadline, or the client left)
                self.leave(rid)

    def _bumped(self, ticket: Ticket) -> None:
        """A waiting request refused to make room for a tenant queueing less."""
        fut = self._waiting.pop(ticket.request_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(
                RequestFailed(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "the queue is full and this client queues more than others: retry later",
                )
            )

    def check_room(self, tenant: str, n: int) -> None:
        """RESOURCE_EXHAUSTED unless `tenant` may hold `n` more requests now."""
        try:
            self.scheduler.check_room(tenant, n)
        except QueueFull as e:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None

    def leave(self, rid: str) -> None:
        """`rid` no longer runs or waits: admit whom it makes room for, share the width."""
        self._waiting.pop(rid, None)
        for t in self.scheduler.finish(rid):
            fut = self._waiting.pop(t.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        self.apply_widths()

    def apply_widths(self) -> None:
        for rid, ticket in self.scheduler.running.items():
            driver = self.drivers.get(rid)
            if driver is not None:
                driver.controller.set_width(ticket.granted)
