"""gRPC plumbing shared by the three services: servers with health and reflection,
channels with raised message caps, and status codes carried as numbers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Logits of a tree layer (rows x vocab x 4 bytes) exceed gRPC's 4 MB default.
MAX_MESSAGE_BYTES = 1 << 30
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Reconnect quickly to a restarted backend (gRPC's default backoff grows to 2 minutes).
CHANNEL_OPTIONS = [
    *MESSAGE_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

log = logging.getLogger(__name__)


class Server:
    """A grpc.aio server plus the standard health and reflection services."""

    def __init__(
        self,
        service_names: Sequence[str],
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
        credentials: grpc.ServerCredentials | None = None,
        options: Sequence[tuple[str, int]] = (),
    ) -> None:
        """`max_receive_bytes`: larger messages are refused (RESOURCE_EXHAUSTED) by gRPC
        before they are read; each service derives it from its model. `credentials`:
        TLS (mutual TLS between a deployment's services, `security.py`); None: plaintext.
        `options`: more gRPC server options (the router's public port: its caps)."""
        self.credentials = credentials
        self.health_server: grpc.aio.Server | None = None
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive_bytes),
            *options,
        ]
        self.server = grpc.aio.server(options=options, interceptors=list(interceptors))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0
        self._dead: asyncio.Future | None = None  # entering drain after a loop died
        # What the health service answers for the whole server ("" ), which every
        # Describe repeats (a router's check is one call): SERVING until set otherwise,
        # as grpc's HealthServicer starts; NOT_SERVING for good once draining.
        self.status: int = SERVING
        self._draining = False

    async def start(self, host: str, port: int, health_port: int | None = None) -> int:
        """Listen on `port` (0: any); with `health_port`, also serve plaintext gRPC health
        alone there (Kubernetes' gRPC probes speak no TLS)."""
        address = f"{host}:{port}"
        if self.credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, self.credentials)
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        await self.server.start()
        if health_port is not None:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            if self.health_server.add_insecure_port(f"{host}:{health_port}") == 0:
                raise OSError(f"cannot listen on {host}:{health_port} (health)")
            await self.health_server.start()
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)
        if not self._draining:
            self.status = status

    async def enter_drain(self) -> None:
        """NOT_SERVING for good (later `set_serving` calls are ignored): load balancers and
        routers stop sending new work while open work finishes."""
        self._draining, self.status = True, NOT_SERVING
        await self.health.enter_graceful_shutdown()

    def supervise(self, task: asyncio.Task, on_death: Callable[[], None] = lambda: None) -> None:
        """A service's own loop (a stage's compute loop, the draft's batches) must run
        as long as the server: if it ends other than by cancellation, the replica goes
        NOT_SERVING for good (routers' health checks take it out and replay its requests)
        and `on_death` fails what it holds, instead of a replica that accepts work it
        will never do."""

        def done(t: asyncio.Task) -> None:
            if t.cancelled():
                return
            log.critical(
                "%s ended: the replica stops serving", t.get_name(), exc_info=t.exception()
            )
            on_death()
            self._dead = asyncio.ensure_future(self.enter_drain())

        task.add_done_callback(done)

    async def stop(self, grace: float | None = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(None)


async def wait_until_idle(open_work: Callable[[], int], seconds: float) -> int:
    """Wait until `open_work()` is 0 or `seconds` pass; returns what is still open."""
    deadline = time.monotonic() + seconds
    while open_work() and time.monotonic() < deadline:
        await asyncio.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))
    return open_work()


def channel(address: str, security=None) -> grpc.aio.Channel:
    """A channel to a service of the deployment: mutual TLS with `security` (a
    `security.Security`), else plaintext."""
    if security is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = [*CHANNEL_OPTIONS, *security.channel_options()]
    return grpc.aio.secure_channel(address, security.channel_credentials(), options=options)


def code_from_number(number: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code
    return grpc.StatusCode.UNKNOWN


def rpc_error_text(e: grpc.RpcError) -> str:
    """`CODE: details` of a failed call, for messages that name the backend."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return f"{code.name if code else 'UNKNOWN'}: {details}"
