"""The router's gRPC front end: the client-facing Generation service over the request
engine (engine.py), which it translates requests to and events from; the public port's
limits, TLS and API keys; the process's lifecycle (start, drain, stop).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import time
from typing import TYPE_CHECKING

from specpipe.v1 import generation_pb2 as gen
from specpipe.v1 import generation_pb2_grpc

from ..grpc_util import Server, wait_until_idle
from ..security import PublicTls
from .bounds import context_of, max_prompt_chars, max_request_bytes
from .edge import EdgeLimits, InvalidMessages
from .engine import RouterEngine
from .requests import RequestFailed, invalid, tokenize

if TYPE_CHECKING:
    from ..config import RouterConfig

log = logging.getLogger(__name__)
SERVICE_NAME = "specpipe.v1.Generation"


class RouterService(RouterEngine, generation_pb2_grpc.GenerationServicer):
    """The engine (its constructor's arguments are the engine's, see engine.py) served
    over gRPC."""

    def __init__(
        self,
        *args,
        public_tls: PublicTls | None = None,
        limits: EdgeLimits | None = None,
        describe_internals: bool = False,
        **engine_options,
    ) -> None:
        """`public_tls`: TLS on the public gRPC port (clients use API keys); `limits`:
        connection caps and timeouts of the public ports (edge.py);
        `describe_internals`: without API keys, callers on this host see the replicas'
        addresses in Describe (operators do anyway)."""
        super().__init__(*args, **engine_options)
        self.public_tls = public_tls
        self.describe_internals = describe_internals
        self.limits = limits or EdgeLimits()
        auth = [self.api_keys.grpc_interceptor(SERVICE_NAME)] if self.api_keys.enabled else []
        # Requests larger than any prompt that fits the context are refused by gRPC
        # before they are read (RESOURCE_EXHAUSTED); the HTTP API caps bodies the same.
        self.max_request_bytes = max_request_bytes(context_of(self.tokenizer_dir))
        self.server = Server(
            [SERVICE_NAME],
            interceptors=[*auth, InvalidMessages(SERVICE_NAME)],
            max_receive_bytes=self.max_request_bytes,
            credentials=public_tls.server_credentials() if public_tls else None,
            options=self.limits.grpc_options(),
        )
        generation_pb2_grpc.add_GenerationServicer_to_server(self, self.server.server)

    @classmethod
    def from_config(
        cls,
        config: RouterConfig,
        *,
        public_tls: PublicTls | None = None,
        limits: EdgeLimits | None = None,
        **live,
    ) -> RouterService:
        """The engine of `config` (RouterEngine.from_config, over the `live` objects)
        behind this front end, with the public port's TLS and limits made from it."""
        return super().from_config(
            config,
            public_tls=public_tls,
            limits=limits,
            describe_internals=config.describe_internals,
            **live,
        )

    # -- lifecycle -----------------------------------------------------------------------
    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        data_port: int = 0,
        startup_timeout: float = 120.0,
        health_port: int | None = None,
    ) -> int:
        await self.transport.start(data_port)
        port = await self.server.start(host, port, health_port)
        self.name = self.name or default_router_name(self.transport.advertise_host, port)
        await self.server.set_serving(False)
        await self.start_engine(startup_timeout)
        await self._readiness(self.backends.ready)
        return port

    async def drain(self, seconds: float) -> None:
        """Graceful shutdown, first half: NOT_SERVING at once, refuse new requests, and
        let open ones finish for up to `seconds` (then `stop` fails what is left)."""
        self.draining = True
        await self.server.enter_drain()
        log.info("draining %d open requests for up to %.0f s", len(self.drivers), seconds)
        left = await wait_until_idle(lambda: len(self.drivers), seconds)
        if left:
            log.warning("drain deadline passed with %d requests open", left)

    async def stop(self) -> None:
        await self.stop_engine()
        await self.server.stop()
        await self.close_engine()

    async def _readiness(self, ready: bool) -> None:
        await self.server.set_serving(ready)

    # -- RPCs ------------------------------------------------------------------------------
    async def Generate(self, request, context):
        remaining = context.time_remaining()  # None: the client set no deadline
        deadline = None if remaining is None else time.monotonic() + remaining
        caller = self.api_keys.caller_of_call(context)
        async with contextlib.aclosing(self.generate(request, deadline, caller)) as responses:
            try:
                async for response in responses:
                    yield response
            except RequestFailed as e:
                await context.abort(e.code, e.message, e.trailing_metadata)

    async def Tokenize(self, request, context) -> gen.TokenizeResponse:
        try:
            model = self.check_model(request.model)
            if not request.text:
                raise invalid("the text is empty")
            if len(request.text) > max_prompt_chars(model.max_positions):
                raise invalid(f"the text has {len(request.text)} characters: too long")
            ids = await self.tokenize_off_loop(
                len(request.text), tokenize, self.codec, request.text, request.chat
            )
        except RequestFailed as e:
            await context.abort(e.code, e.message)
        return gen.TokenizeResponse(token_ids=ids)

    async def ListModels(self, request, context) -> gen.ListModelsResponse:
        return gen.ListModelsResponse(models=self.model_cards())

    async def Describe(self, request, context) -> gen.RouterDescription:
        """The router's state. Replicas' addresses and errors and the router's data
        address are internal: only an operator sees them (a key marked `operator`, or,
        on a router without API keys started with --describe-internals, a caller on
        this host); everyone else gets the replicas by kind, layers, version, health
        and load."""
        internal = self._sees_internals(context)
        tenant = self.api_keys.caller_of_call(context).tenant if context is not None else ""
        backends = []
        for b in self.backends.all:
            layers = f"{b.layers[0]}:{b.layers[1]}" if b.kind == "stage" and b.desc else ""
            if internal:
                error = b.refused or b.error
            else:
                error = "refused: incompatible" if b.refused else ("" if b.healthy else "down")
            backends.append(
                gen.Backend(
                    kind=b.kind,
                    address=b.address if internal else "",
                    healthy=b.healthy,
                    layers=layers,
                    error=error,
                    weight_hash=b.version,
                    active_requests=b.active,
                    draining=b.draining or b.endpoint.draining or not b.listed,
                    refused=bool(b.refused),
                )
            )
        return gen.RouterDescription(
            ready=self.backends.ready,
            active_requests=len(self.drivers),
            backends=backends,
            transport=self.transport_kind,
            data_address=self.transport.address if internal else "",
            waiting_requests=len(self.scheduler.waiting),
            max_running=self.scheduler.max_running,
            max_waiting=self.scheduler.max_waiting,
            row_budget=self.scheduler.row_budget or 0,
            tuning=self.tuning.describe(),
            max_running_per_key=self.scheduler.running_cap,
            max_waiting_per_key=self.scheduler.waiting_cap,
            caller_running=self.scheduler.running_of(tenant),
            caller_waiting=self.scheduler.waiting_of(tenant),
        )

    def _sees_internals(self, context) -> bool:
        """Whether the caller of `context` is an operator (None: an in-process call)."""
        if context is None:
            return True
        if self.api_keys.caller_of_call(context).operator:
            return True
        return (
            self.describe_internals and not self.api_keys.enabled and is_local_peer(context.peer())
        )


def default_router_name(advertised: str, port: int) -> str:
    """A router's name on the stages when it is given none: HOST:PORT, where HOST is
    the address it advertises to them, or this machine's hostname when that is loopback
    or a wildcard. Two routers must never share a name (a router restarted under a name
    frees its predecessor's requests): hosts that share a hostname (network namespaces,
    host-network containers) still have their own addresses."""
    try:
        ip = ipaddress.ip_address(advertised.strip("[]"))
        local = ip.is_loopback or ip.is_unspecified
    except ValueError:
        local = advertised in ("", "localhost")
    return f"{socket.gethostname() if local else advertised}:{port}"


def is_local_peer(peer: str) -> bool:
    """Whether a gRPC peer ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") is on
    this host's loopback."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
