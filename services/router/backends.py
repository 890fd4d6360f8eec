"""The router's view of the deployment: stage and draft replicas, their health, and
the path (one replica per stage, one draft) each new request runs on (docs/architecture.md,
"1. Services")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import draft_pb2_grpc, stage_pb2_grpc

from ..grpc_util import SERVING, channel, rpc_error_text

log = logging.getLogger(__name__)


class NoPath(RuntimeError):
    """No complete set of healthy replicas can serve a request right now."""


@dataclass(eq=False)
class Backend:
    kind: str  # "stage" or "draft"
    address: str
    channel: grpc.aio.Channel
    stub: object
    health: health_pb2_grpc.HealthStub
    desc: object | None = None
    healthy: bool = False
    error: str = "not contacted yet"
    slow_checks: int = 0
    active: int = 0  # requests of this router on this replica
    draining: bool = False  # reports NOT_SERVING: takes no new requests, finishes its own

    @property
    def layers(self) -> tuple[int, int]:
        assert self.kind == "stage" and self.desc is not None
        return (self.desc.layer_start, self.desc.layer_end)

    @property
    def label(self) -> str:
        if self.kind == "stage" and self.desc is not None:
            a, b = self.layers
            return f"stage {a}:{b} at {self.address}"
        return f"{self.kind} at {self.address}"


@dataclass
class RequestPath:
    """One replica per stage (in layer order) and the draft, for one request."""

    stages: list[Backend]
    draft: Backend | None

    @property
    def backends(self) -> list[Backend]:
        return [*self.stages, *([self.draft] if self.draft else [])]


@dataclass
class ModelInfo:
    model_id: str
    weight_hash: str
    num_layers: int
    vocab_size: int
    max_positions: int
    eos_token_ids: tuple[int, ...]
    ranges: list[tuple[int, int]] = field(default_factory=list)
    draft_model: str = ""
    draft_vocab: int = 0


class Backends:
    def __init__(
        self,
        stage_addresses: list[str],
        draft_address: str | None,
        on_down: Callable[[Backend, str], None],
        on_readiness: Callable[[bool], object],
        check_interval: float = 0.5,
        check_timeout: float = 2.0,
        make_channel: Callable[[str], grpc.aio.Channel] = channel,
    ) -> None:
        if not stage_addresses:
            raise ValueError("a router needs at least one stage")
        self._make_channel = make_channel  # mutual TLS with --secure
        self.stages = [self._backend("stage", a) for a in stage_addresses]
        self.draft = self._backend("draft", draft_address) if draft_address else None
        self.on_down, self.on_readiness = on_down, on_readiness
        self.check_interval, self.check_timeout = check_interval, check_timeout
        self.model: ModelInfo | None = None
        self._ready = False
        self._monitor: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    def _backend(self, kind: str, address: str) -> Backend:
        ch = self._make_channel(address)
        stub = (stage_pb2_grpc.StageStub if kind == "stage" else draft_pb2_grpc.DraftStub)(ch)
        return Backend(kind, address, ch, stub, health_pb2_grpc.HealthStub(ch))

    @property
    def all(self) -> list[Backend]:
        return [*self.stages, *([self.draft] if self.draft else [])]

    @property
    def ready(self) -> bool:
        return self._ready

    # -- start-up ------------------------------------------------------------------------
    async def connect(self, timeout: float) -> ModelInfo:
        """Describe every backend (waiting for slow starters) and check they fit together."""
        deadline = time.monotonic() + timeout
        await asyncio.gather(*(self._describe_until(b, deadline) for b in self.all))
        self.model = self._check_layout()
        self._set_ready()
        self._monitor = asyncio.create_task(self._watch(), name="health-monitor")
        return self.model

    async def _describe_until(self, b: Backend, deadline: float) -> None:
        while True:
            try:
                desc = await b.stub.Describe(pb.DescribeRequest(), timeout=2.0)
                if b.kind == "draft" or desc.ready:
                    b.desc, b.healthy, b.error = desc, True, ""
                    return
                b.error = "no model loaded yet"
            except grpc.aio.AioRpcError as e:
                b.error = rpc_error_text(e)
            if time.monotonic() > deadline:
                raise NoPath(f"{b.kind} at {b.address} did not come up: {b.error}")
            await asyncio.sleep(0.2)

    def _check_layout(self) -> ModelInfo:
        descs = [b.desc for b in self.stages]
        first = descs[0]
        for d, b in zip(descs, self.stages, strict=True):
            if d.weight_hash != first.weight_hash or d.num_layers != first.num_layers:
                raise NoPath(
                    f"{b.label} serves model {d.model_id} ({d.weight_hash}), "
                    f"{self.stages[0].label} serves {first.model_id} ({first.weight_hash})"
                )
        ranges = sorted({b.layers for b in self.stages})
        end = 0
        for a, b in ranges:
            if a != end:
                raise NoPath(
                    f"stage layer ranges {ranges} do not chain from 0 to {first.num_layers}"
                )
            end = b
        if end != first.num_layers:
            raise NoPath(f"stage layer ranges {ranges} stop at {end} of {first.num_layers} layers")
        info = ModelInfo(
            model_id=first.model_id,
            weight_hash=first.weight_hash,
            num_layers=first.num_layers,
            vocab_size=first.vocab_size,
            max_positions=first.max_position_embeddings,
            eos_token_ids=tuple(first.eos_token_ids),
            ranges=ranges,
        )
        if self.draft is not None:
            dd = self.draft.desc
            if dd.vocab_size > info.vocab_size:
                raise NoPath(
                    f"draft vocabulary ({dd.vocab_size}) is larger than the target's ({info.vocab_size})"
                )
            info.draft_model, info.draft_vocab = dd.model_id, dd.vocab_size
        return info

    # -- paths ---------------------------------------------------------------------------
    def path(self, needs_draft: bool = True) -> RequestPath:
        """The least loaded healthy replica of every stage, and the draft (not needed, and
        not in the path, for modes without one: pp and autoregressive run while the draft
        is down)."""
        assert self.model is not None
        chosen = []
        for rng in self.model.ranges:
            replicas = [b for b in self.stages if b.layers == rng]
            healthy = [b for b in replicas if b.healthy]
            if not healthy:
                down = "; ".join(f"{b.label}: {b.error}" for b in replicas)
                raise NoPath(f"no healthy replica of layers {rng[0]}:{rng[1]} ({down})")
            chosen.append(min(healthy, key=lambda b: b.active))
        draft = self.draft if needs_draft else None
        if draft is not None and not draft.healthy:
            raise NoPath(f"{draft.label} is down: {draft.error}")
        return RequestPath(chosen, draft)

    # -- health ----------------------------------------------------------------------------
    def _set_ready(self) -> None:
        ready = all(b.healthy for b in self.all)
        if ready != self._ready:
            self._ready = ready
            log.info("router %s", "ready" if ready else "NOT ready")
            result = self.on_readiness(ready)
            if asyncio.iscoroutine(result):
                task = asyncio.ensure_future(result)
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._check(b) for b in self.all))
            self._set_ready()
            await asyncio.sleep(self.check_interval)

    async def _check(self, b: Backend) -> None:
        try:
            resp = await b.health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self.check_timeout
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                b.slow_checks += 1
                if b.slow_checks < 3:
                    return  # busy, not necessarily dead
            if b.healthy or b.draining:
                err = rpc_error_text(e)
                b.healthy, b.draining, b.error = False, False, err
                log.warning("%s is down: %s", b.label, err)
                self.on_down(b, err)
            return
        b.slow_checks = 0
        if resp.status != SERVING:
            # Draining (shutting down): no new requests go there, but it still serves the
            # ones it has, so they are not failed; if it dies, the next check says so.
            if b.healthy:
                log.warning("%s reports NOT_SERVING (draining?)", b.label)
            b.healthy, b.draining = False, True
            b.error = "reports NOT_SERVING (shutting down or not loaded)"
            return
        if not b.healthy:
            try:  # it came back, maybe restarted: its data address may have changed
                b.desc = await b.stub.Describe(pb.DescribeRequest(), timeout=self.check_timeout)
            except grpc.aio.AioRpcError:
                return
            b.healthy, b.draining, b.error = True, False, ""
            log.info("%s is back", b.label)

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for b in self.all:
            await b.channel.close()
