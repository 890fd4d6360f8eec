"""What a stage and the draft share as replicas of a deployment: the gRPC server with
health and reflection, one compute thread and the loop that feeds it, request leases
(their reaper and `Renew`), the drain on SIGTERM, the rows one step may take, and the
part of `Describe` that tells a router about the model and its cache.

A replica serves a router's requests on one device; its own loop (a stage's compute
rounds, the draft's batches) must run as long as the server does (`Server.supervise`).
The two services differ in what a request holds and how it is computed; each says so
through the few methods below that it defines (`_compute_forever`, `_release`,
`_open_requests`, `_fail_held`, `_describe`, `model_limits`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from specpipe.common.perf.cost_model import COST_CONTEXT, CostCurve
from specpipe.common.runtime.errors import InvalidInput, RequestError
from specpipe.common.runtime.lease import LeaseClaim, LeaseTable
from specpipe.common.runtime.stage import StageInfo
from specpipe.common.runtime.validation import Limits, step_row_cap
from specpipe.v1 import dataplane_pb2 as pb

from .control import cost_curve_to_proto, max_control_bytes
from .grpc_util import Server, wait_until_idle
from .lease import DRAIN_LEASE_SECONDS, lease_claim, reap_expired
from .modelinfo import free_memory_bytes
from .ratelog import RateLimitedLog
from .security import Security
from .status import status_code

log = logging.getLogger(__name__)
rlog = RateLimitedLog(log)


class Replica(ABC):
    """A stage or draft replica's lifecycle: `start`, `drain`, `stop`; leases; `Renew`."""

    # Measured cost per row count (--measure-costs), or None; the stage reads its model's.
    cost_curve: CostCurve | None = None

    def __init__(
        self,
        service_name: str,
        kind: str,
        lease_seconds: float,
        security: Security | None,
        max_step_rows: int | None,
        limits: Limits | None,
    ) -> None:
        """`kind`: the compute thread's name; `max_step_rows`: the most rows one step may
        carry (None: from the measured cost curve); `limits`: the model's, which bound
        the control messages gRPC reads (None: no model yet)."""
        self.security = security
        self._max_step_rows = max_step_rows
        # Each request's state is a lease its router renews (common/runtime/lease.py).
        self.leases = LeaseTable(lease_seconds)
        self._reaper: asyncio.Task | None = None
        self.draining = False
        # One model forward at a time, off the event loop (gRPC stays responsive).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=kind)
        self._loop_task: asyncio.Task | None = None
        self.server = Server(
            [service_name],
            max_receive_bytes=max_control_bytes(limits),
            credentials=security.server_credentials() if security else None,
        )

    # -- what each service defines ---------------------------------------------------------
    @property
    @abstractmethod
    def name(self) -> str:
        """How messages and logs name this replica."""

    @property
    @abstractmethod
    def model_limits(self) -> Limits:
        """What the loaded model accepts (before the rows one step may carry)."""

    @abstractmethod
    def _compute_forever(self) -> Coroutine[Any, Any, None]:
        """The replica's own loop: it feeds the compute thread until cancelled."""

    @abstractmethod
    def _release(self, rid: str) -> object:
        """Free what request `rid` holds here (its lease is over); may be a coroutine."""

    @abstractmethod
    def _open_requests(self) -> int:
        """Requests open here (a drain waits until none is)."""

    @abstractmethod
    def _fail_held(self) -> None:
        """The loop ended: fail whatever waits for it."""

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(
        self, host: str = "127.0.0.1", port: int = 0, health_port: int | None = None
    ) -> int:
        """Start the loop, serve gRPC (health: SERVING once a model is loaded) and reap
        expired leases; returns the gRPC port."""
        self._loop_task = asyncio.create_task(self._compute_forever(), name=f"{self.name} loop")
        self.server.supervise(self._loop_task, self._stopped_computing)
        port = await self.server.start(host, port, health_port)
        await self.server.set_serving(self.ready)
        self._reaper = asyncio.create_task(reap_expired(self.leases, self._expire), name="leases")
        return port

    @property
    def ready(self) -> bool:
        """Whether a model is loaded (health SERVING)."""
        return True

    async def drain(self, seconds: float) -> None:
        """Graceful shutdown, first half: NOT_SERVING, refuse new requests, and keep
        serving open ones until their router releases them or `seconds` pass."""
        self.draining = True
        await self.server.enter_drain()
        self.leases.shorten(DRAIN_LEASE_SECONDS)  # a crashed router's requests go soon
        await wait_until_idle(self._open_requests, seconds)

    async def stop(self) -> None:
        await self._stop_serving()
        self._stop_computing()

    async def _stop_serving(self) -> None:
        """No more leases reaped, no more calls."""
        if self._reaper is not None:
            self._reaper.cancel()
        await self.server.stop()

    def _stop_computing(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _stopped_computing(self) -> None:
        """The loop ended (see `Server.supervise`): refuse new requests, fail held ones."""
        self.draining = True
        self._fail_held()

    async def _refuse_if_draining(self, context) -> None:
        """A draining replica opens no request (the router opens it elsewhere)."""
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{self.name} is shutting down (draining): open the request on another replica",
            )

    # -- steps -----------------------------------------------------------------------------
    @property
    def max_step_rows(self) -> int:
        """The most rows one step (a prefill chunk, a tree feed or layer) may carry here."""
        if self._max_step_rows is not None:
            return self._max_step_rows
        return step_row_cap(self.cost_curve)

    @property
    def limits(self) -> Limits:
        """What this replica's model accepts (context, vocabulary, width, dtype, rows per
        step)."""
        return dataclasses.replace(self.model_limits, max_rows=self.max_step_rows)

    # -- leases ----------------------------------------------------------------------------
    def _claim(self, owner: str, epoch: int, token: bytes, context) -> LeaseClaim | None:
        """The lease claim of a call, as this replica can vouch for its owner."""
        return lease_claim(owner, epoch, token, context, authenticated=self.security is not None)

    async def Renew(self, request, context) -> pb.RenewResponse:
        """A router's keep-alive: only its own requests (its owner's, its epoch's, with
        its token) are renewed; a newer epoch of the same owner frees the older's."""
        try:
            claim = self._claim(request.owner, request.epoch, request.token, context)
            if claim is None:
                raise InvalidInput("Renew names no lease owner")
            unknown, stale = self.leases.renew_all(claim, request.request_ids)
        except RequestError as e:
            await context.abort(status_code(e), f"{self.name}: {e}")
        await self._free_stale(stale)
        return pb.RenewResponse(unknown_ids=unknown)

    async def _free_stale(self, request_ids: list[str]) -> None:
        """Requests of a router process that was replaced (it restarted): free them now
        (without waiting when `_release` does not)."""
        for rid in request_ids:
            await self._released(rid)
        if request_ids:
            log.warning(
                "%s: freed %d requests of a router that restarted", self.name, len(request_ids)
            )

    async def _expire(self, rid: str) -> None:
        rlog.warning("lease", "%s: a request expired (no word from its router for %.0f s): freed",
                     self.name, self.leases.seconds)  # fmt: skip
        log.debug("request %s expired", rid)
        await self._released(rid)

    async def _released(self, rid: str) -> None:
        self.leases.end(rid)
        result = self._release(rid)
        if asyncio.iscoroutine(result):
            await result

    # -- Describe --------------------------------------------------------------------------
    async def Describe(self, request, context):
        return self._describe()

    @abstractmethod
    def _describe(self):
        """The replica's Stage- or DraftDescription."""

    def _describe_replica(self, desc) -> None:
        """The fields of a Stage- or DraftDescription every replica has, model or not."""
        desc.health_status = self.server.status
        desc.active_requests = self._open_requests()
        desc.lease_seconds = self.leases.seconds
        desc.max_step_rows = self.max_step_rows

    def _describe_model(self, desc, info: StageInfo, model_id: str, weight_hash: str) -> None:
        """The fields of a Stage- or DraftDescription about the loaded model and its cache."""
        self._describe_replica(desc)
        desc.model_id, desc.weight_hash = model_id, weight_hash
        desc.vocab_size, desc.num_layers = info.vocab_size, info.num_layers
        desc.dtype, desc.device = info.dtype, info.device
        desc.weight_bytes = info.weight_bytes
        desc.free_memory_bytes = free_memory_bytes(info.device)
        if self.cost_curve is not None:
            desc.cost_curve.CopyFrom(cost_curve_to_proto(self.cost_curve, COST_CONTEXT))
        desc.prefix_caching = info.prefix_caching
        desc.cache_blocks_cached = info.cache_blocks_cached
        desc.prefix_cache_queries = info.prefix_cache_queries
        desc.prefix_cache_hits = info.prefix_cache_hits
