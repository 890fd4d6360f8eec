"""gRPC plumbing shared by the three services: servers with health and reflection,
channels with raised message caps, status codes carried as numbers, and a server
stream written from plain callbacks (`StreamWriter`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence

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


class ClientGone(Exception):
    """A server stream's send failed: the client went away (or its call ended). Not a
    failure of the request: its handler stops and releases it, as for a cancel."""


class StreamWriter:
    """A server stream's messages written from plain callbacks on the event loop, in
    order, without a task (issue 34): grpc.aio's `context.write` is a coroutine that
    starts the send and then waits for gRPC to complete it, which from a handler costs
    two task steps per message (one to write, one to wake when it is sent). Here each
    write's coroutine is stepped by hand: the send starts where `write` is called (a
    frame's callback), and the coroutine is finished at the next write (or by a
    callback once gRPC completed the send, where a message waits for it); no task
    wakes for it.
    gRPC takes one send at a time per call, so a message written while one is under
    way waits here, in order.

    The handler that owns the stream must `drain` before it returns or aborts (the
    status must not pass a message), and `close` at the end whatever happened (a
    cancelled handler abandons a send in flight, as grpc.aio's own cancellation does).
    A send that fails (the client went away) drops what waits and fails the stream
    with `ClientGone`, raised by the next `write` or `drain`, whatever gRPC raised (its
    own errors are plain Exceptions, and its send may end cancelled before gRPC
    cancels the handler): the handler ends quietly, as for a client's cancel."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._waiting: deque = deque()  # messages after the one being sent
        self._sending: Coroutine | None = None  # the write under way
        self._on: asyncio.Future | None = None  # what it waits for
        self._watched = False  # a callback resumes it when `_on` is done
        self.error: ClientGone | None = None

    @property
    def busy(self) -> bool:
        """A send under way or messages waiting."""
        return self._sending is not None or bool(self._waiting)

    def write(self, message) -> None:
        """Send `message` after those written before it (at once where none is under
        way). Raises the stream's failure, if it failed."""
        if self.error is not None:
            raise self.error
        self._waiting.append(message)
        self._pump()

    async def drain(self) -> None:
        """Until every message written is sent; raises the stream's failure
        (`ClientGone`), or CancelledError only where the handler itself is cancelled (a
        send of gRPC's that ends cancelled fails the stream)."""
        while self.busy and self.error is None:
            self._pump()
            if self._on is not None and not self._on.done():
                # not shield: it raises CancelledError where `_on` ends cancelled too
                await asyncio.wait((self._on,))
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Abandon a send in flight and what waits (the handler ends); a send gRPC
        completed is finished (its buffers freed)."""
        self._waiting.clear()
        if self.error is None:
            self._pump()
        sending, on = self._sending, self._on
        self._sending = self._on = None
        if on is not None and not on.done():
            on.cancel()
        if sending is not None:
            sending.close()

    def _pump(self) -> None:
        """Carry the writes on as far as they go without waiting."""
        while True:
            if self._sending is not None:
                on = self._on
                if on is not None and not on.done():
                    # a callback finishes it only for a message that waits: else the
                    # next write does (no callback per message)
                    if self._waiting and not self._watched:
                        self._watched = True
                        on.add_done_callback(self._resume)
                    return
                self._step()
                continue
            if not self._waiting or self.error is not None:
                return
            self._sending, self._on = self._context.write(self._waiting.popleft()), None
            self._step()

    def _step(self) -> None:
        """Resume the write under way until it waits (or ends)."""
        sending = self._sending
        assert sending is not None
        try:
            on = sending.send(None)
        except StopIteration:
            self._sending = self._on = None
        except (Exception, asyncio.CancelledError) as e:  # the stream is broken
            self._sending = self._on = None
            self._waiting.clear()
            self.error = ClientGone(f"a send to the client failed: {e!r}")
            self.error.__cause__ = e
        else:
            self._on = on  # a future (or None: resumed at once by `_pump`)
            self._watched = False

    def _resume(self, done: asyncio.Future) -> None:
        if done is not self._on:
            # a write finished that send since (and watches the next itself where a
            # message waits): carrying on here would add a second callback to the next
            # send's future, and those would pile up, one more per send
            return
        self._watched = False
        if self._sending is not None:
            self._pump()


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
