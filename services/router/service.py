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

from specpipe.v1 import generation_pb2 as gen
from specpipe.v1 import generation_pb2_grpc

from ..grpc_util import ClientGone, Server, StreamWriter, wait_until_idle
from ..security import PublicTls
from .bounds import max_prompt_chars
from .edge import EdgeLimits, InvalidMessages
from .engine import RouterEngine
from .requests import RequestFailed, invalid, tokenize

log = logging.getLogger(__name__)
SERVICE_NAME = "specpipe.v1.Generation"


class RouterService(generation_pb2_grpc.GenerationServicer):
    """The Generation service over one `RouterEngine`: gRPC in, engine calls, gRPC out."""

    def __init__(
        self,
        engine: RouterEngine,
        public_tls: PublicTls | None = None,
        limits: EdgeLimits | None = None,
    ) -> None:
        """`public_tls`: TLS on the public gRPC port (clients use API keys); `limits`:
        the public ports' connection caps and timeouts (None: the engine's
        configuration's, edge.py)."""
        self.engine = engine
        self.public_tls = public_tls
        self.limits = limits or EdgeLimits.of(engine.config)
        # Without API keys, callers on this host see the replicas' addresses in Describe.
        self.describe_internals = engine.config.describe_internals
        keys = engine.api_keys
        auth = [keys.grpc_interceptor(SERVICE_NAME)] if keys.enabled else []
        self.server = Server(
            [SERVICE_NAME],
            interceptors=[*auth, InvalidMessages(SERVICE_NAME)],
            max_receive_bytes=engine.max_request_bytes,
            credentials=public_tls.server_credentials() if public_tls else None,
            options=self.limits.grpc_options(),
        )
        generation_pb2_grpc.add_GenerationServicer_to_server(self, self.server.server)
        engine.watch_readiness(self.server.set_serving)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        data_port: int = 0,
        startup_timeout: float = 120.0,
        health_port: int | None = None,
    ) -> int:
        """The data plane, the gRPC port (NOT_SERVING until a complete path is up),
        then the engine; the gRPC port."""
        engine = self.engine
        await engine.transport.start(data_port)
        port = await self.server.start(host, port, health_port)
        await self.server.set_serving(False)
        await engine.start(
            startup_timeout, default_router_name(engine.transport.advertise_host, port)
        )
        await self.server.set_serving(engine.backends.ready)
        return port

    async def drain(self, seconds: float) -> None:
        """Graceful shutdown, first half: NOT_SERVING at once, refuse new requests, and
        let open ones finish for up to `seconds` (then `stop` fails what is left)."""
        drivers = self.engine.drivers
        self.engine.draining = True
        await self.server.enter_drain()
        log.info("draining %d open requests for up to %.0f s", len(drivers), seconds)
        left = await wait_until_idle(lambda: len(drivers), seconds)
        if left:
            log.warning("drain deadline passed with %d requests open", left)

    async def stop(self) -> None:
        await self.engine.stop()
        await self.server.stop()
        await self.engine.close()

    # -- RPCs ------------------------------------------------------------------------------
    async def Generate(self, request, context) -> None:
        """The request's messages written as they come: its deltas from the callbacks
        that verified their tokens (`StreamWriter`: no task step per message), `started`
        and `finished` from this handler. A failed send (`ClientGone`, also raised out
        of the engine by a delta's callback) ends the handler quietly and the request
        as a client's cancel does (the engine's generator is closed: it releases the
        request); a request that failed ends with its status even where the send of
        what came before failed."""
        remaining = context.time_remaining()  # None: the client set no deadline
        deadline = None if remaining is None else time.monotonic() + remaining
        caller = self.engine.api_keys.caller_of_call(context)
        writer = StreamWriter(context)
        generate = self.engine.generate(request, deadline, caller, sink=writer.write)
        try:
            async with contextlib.aclosing(generate) as responses:
                try:
                    async for response in responses:
                        writer.write(response)
                    await writer.drain()
                except RequestFailed as e:
                    with contextlib.suppress(ClientGone):
                        await writer.drain()  # what was verified before it failed
                    await context.abort(e.code, e.message, e.trailing_metadata)
        except ClientGone as e:
            log.debug("a Generate stream ended: %s", e)
        finally:
            writer.close()

    async def Tokenize(self, request, context) -> gen.TokenizeResponse:
        try:
            engine = self.engine
            model = engine.check_model(request.model)
            if not request.text:
                raise invalid("the text is empty")
            if len(request.text) > max_prompt_chars(model.max_positions):
                raise invalid(f"the text has {len(request.text)} characters: too long")
            ids = await engine.tokenize_off_loop(
                len(request.text), tokenize, engine.codec, request.text, request.chat
            )
        except RequestFailed as e:
            await context.abort(e.code, e.message)
        return gen.TokenizeResponse(token_ids=ids)

    async def ListModels(self, request, context) -> gen.ListModelsResponse:
        return gen.ListModelsResponse(models=self.engine.model_cards())

    async def Describe(self, request, context) -> gen.RouterDescription:
        """The router's state. Replicas' addresses and errors and the router's data
        address are internal: only an operator sees them (a key marked `operator`, or,
        on a router without API keys started with --describe-internals, a caller on
        this host); everyone else gets the replicas by kind, layers, version, health
        and load."""
        engine = self.engine
        internal = self._sees_internals(context)
        tenant = engine.api_keys.caller_of_call(context).tenant
        backends = []
        for b in engine.backends.all:
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
        scheduler = engine.scheduler
        return gen.RouterDescription(
            ready=engine.backends.ready,
            active_requests=len(engine.drivers),
            backends=backends,
            transport=engine.transport_kind,
            data_address=engine.transport.address if internal else "",
            waiting_requests=len(scheduler.waiting),
            max_running=scheduler.max_running,
            max_waiting=scheduler.max_waiting,
            row_budget=scheduler.row_budget or 0,
            tuning=engine.tuning.describe(),
            max_running_per_key=scheduler.running_cap,
            max_waiting_per_key=scheduler.waiting_cap,
            caller_running=scheduler.running_of(tenant),
            caller_waiting=scheduler.waiting_of(tenant),
        )

    def _sees_internals(self, context) -> bool:
        """Whether the caller of `context` is an operator."""
        keys = self.engine.api_keys
        if keys.caller_of_call(context).operator:
            return True
        return self.describe_internals and not keys.enabled and is_local_peer(context.peer())


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
