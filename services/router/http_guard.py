"""The HTTP port's guard around uvicorn: connection caps and request timeouts.

uvicorn has no cap on connections and no timeout before a request's headers (its
keep-alive timeout starts only after a first response), so silent or slow-header
connections would stay open until the process runs out of file descriptors, taking the
gRPC port and /health down with it. Here:

- `GuardedListener`, the listening socket handed to uvicorn: its `accept` counts every
  connection (`ConnectionCounts`: at most `max_connections`, and, on a router without
  API keys, `max_connections_per_client` from one address). When the port is full, the oldest
  idle connection (no request under way) is closed for the new one; when all are busy,
  or the client holds its share, the new one gets a fixed 503 and is closed at once,
  before asyncio builds a transport or a task for it. A connection is counted until its
  socket is closed, so a TLS handshake counts too; one whose handshake has not finished
  within the header timeout is shut down.
- `guarded_protocol`: uvicorn's h11 protocol, plus a timer from the connection's start
  (and from the first byte of every later request) to the end of the request's headers:
  a connection that has not sent them in `header_timeout` seconds is closed.
- `KeyConnections` (a router with API keys): `max_connections_per_client` is per API
  key instead, so clients behind one NAT or ingress address do not lock each other out.
  A connection counts against the key of its first request with a valid key (the key
  is known only from the headers); a request of a key holding its share gets the same
  503 and its connection is closed. Connections without a valid key are bounded by the
  total and, idle, are the first closed for new ones.
- `RateLimitFilter`: refusals and uvicorn's "Invalid HTTP request" warnings are logged
  at a bounded rate.
- `BodyLimit` (ASGI middleware): a body over the router's request cap is refused 413
  before it is parsed, one that does not arrive in time 408, one whose prompt could
  not be tokenized now 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from ..conn_limits import ConnectionCounts
from ..ratelog import RateLimitedLog
from .edge import EdgeLimits
from .http_errors import error_response
from .openai_compat import ApiError

log = logging.getLogger(__name__)
_REFUSAL_BODY = (
    b'{"error":{"message":"too many connections: retry later",'
    b'"type":"service_unavailable_error","param":null,"code":"too_many_connections"}}'
)
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
    % (len(_REFUSAL_BODY), _REFUSAL_BODY)
)
# Connections closed for new ones whose descriptors are not closed yet (their transports
# close them on the loop's next turns): beyond this many, new ones are refused instead,
# so the port never holds more than `max_connections` + this many descriptors.
EVICTIONS_IN_FLIGHT = 64
# Refusals done in one `accept` call; then asyncio's loop runs other work and comes back.
REFUSALS_PER_ACCEPT = 64


class ConnectionGuard:
    """The HTTP port's connections: counted, capped, and the idle ones known.

    A connection is idle from its admission until its request's headers are in, and
    again from the end of each response until the next request's headers are in. When
    the port is full, a new connection takes the place of the oldest idle one (closed),
    so silent or slow connections from many addresses cannot keep clients with a
    request to send out; only when every connection is busy is a new one refused."""

    def __init__(
        self, limits: EdgeLimits, loop: asyncio.AbstractEventLoop, per_key: bool = False
    ) -> None:
        """`per_key`: the per-client cap counts API keys (`claim`), not addresses."""
        self.limits = limits
        self.loop = loop
        per_client = limits.max_connections_per_client
        self.counts = ConnectionCounts(limits.max_connections, 0 if per_key else per_client)
        self.key_counts = ConnectionCounts(limits.max_connections, per_client) if per_key else None
        self.refusals = RateLimitedLog(log)
        self.evicted = 0
        self._closing = 0  # evicted connections not closed yet
        self._open: dict[Any, GuardedConnection] = {}  # peername -> connection
        self._idle: dict[Any, None] = {}  # peernames of idle connections, oldest first

    def listen(self, sock: socket.socket) -> GuardedListener:
        """`sock` (listening) as a `GuardedListener` (the same descriptor)."""
        listener = GuardedListener(sock.family, sock.type, sock.proto, fileno=sock.detach())
        listener.guard = self
        return listener

    def take(self, conn: GuardedConnection, addr) -> bool:
        """Admit a new connection (counted until it closes), or refuse it: False."""
        host = _host(addr)
        per_client = self.counts.per_client
        if self.counts.open >= self.counts.total and not (
            per_client and self.counts.held_by(host) >= per_client
        ):
            self._evict_oldest_idle()
        why = self.counts.admit(host)
        if why is not None:
            self.refuse(conn, why)
            return False
        key = _peer_key(addr)
        conn.host, conn.key = host, key
        conn.on_close = lambda: self._closed(conn)
        self._open[key] = conn
        self._idle[key] = None
        # Until the protocol has it (a TLS handshake first), nothing else would close a
        # connection that never starts.
        conn.unstarted = self.loop.call_later(self.limits.header_timeout, self._expire, conn)
        return True

    def started(self, peername) -> None:
        """The protocol has the connection: from here its own timer applies."""
        conn = self._open.get(_peer_key(peername))
        if conn is not None and conn.unstarted is not None:
            conn.unstarted.cancel()
            conn.unstarted = None

    def busy(self, peername) -> None:
        """The connection's request headers are in: it is not idle."""
        self._idle.pop(_peer_key(peername), None)

    def idle(self, peername) -> None:
        """Its response is done and it waits for the next request (the newest idle)."""
        key = _peer_key(peername)
        if key in self._open:
            self._idle.pop(key, None)
            self._idle[key] = None

    def _evict_oldest_idle(self) -> bool:
        if self._closing >= EVICTIONS_IN_FLIGHT:
            return False
        while self._idle:
            key = next(iter(self._idle))
            del self._idle[key]
            conn = self._open.get(key)
            if conn is None or conn.evicted:
                continue
            conn.evicted = True  # its place is free now; its descriptor at its close
            self._closing += 1
            self.counts.release(conn.host)
            self._unclaim(conn)
            self.evicted += 1
            self.refusals.warning(
                "evicted", "HTTP port full: closed the oldest idle connection for a new one"
            )
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # its transport sees the end and closes
            return True
        return False

    def _closed(self, conn: GuardedConnection) -> None:
        if self._open.get(conn.key) is conn:  # (a new one may have its address by now)
            del self._open[conn.key]
            self._idle.pop(conn.key, None)
        if conn.unstarted is not None:
            conn.unstarted.cancel()
            conn.unstarted = None
        if conn.evicted:
            self._closing -= 1
        else:
            self.counts.release(conn.host)
            self._unclaim(conn)

    def claim(self, peername, tenant: str) -> str | None:
        """The connection from `peername` carries a request of API key `tenant`: count
        it against that key (once); None, or why it may not (the key holds its share)."""
        conn = self._open.get(_peer_key(peername))
        if self.key_counts is None or conn is None or conn.evicted or conn.tenant == tenant:
            return None
        self._unclaim(conn)
        why = self.key_counts.admit(tenant)
        if why is None:
            conn.tenant = tenant
        else:
            self.refusals.warning("key", "HTTP port: refused a request (%s)", why)
        return why

    def _unclaim(self, conn: GuardedConnection) -> None:
        if conn.tenant and self.key_counts is not None:
            self.key_counts.release(conn.tenant)
        conn.tenant = ""

    def _expire(self, conn: GuardedConnection) -> None:
        conn.unstarted = None
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)

    def refuse(self, conn: socket.socket, why: str) -> None:
        """A fixed 503 if the socket takes it at once, then close (what the client
        already sent is read and dropped first: closing over unread bytes would reset
        the connection, and the client might lose the answer)."""
        self.refusals.warning("refused", "HTTP port: refused a connection (%s)", why)
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                for _ in range(4):
                    if not conn.recv(65536):
                        break
            conn.send(REFUSAL)
            conn.shutdown(socket.SHUT_WR)
        conn.close()


class GuardedConnection(socket.socket):
    """An accepted connection that tells its guard when it closes."""

    on_close = None
    host, key = "", None
    tenant = ""  # the API key's tenant id it counts against (KeyConnections)
    unstarted: asyncio.TimerHandle | None = None
    evicted = False

    def close(self) -> None:
        callback, self.on_close = self.on_close, None
        super().close()
        if callback is not None:
            callback()


class GuardedListener(socket.socket):
    """A listening socket whose `accept` enforces the guard's caps."""

    guard: ConnectionGuard

    def accept(self):
        for _ in range(REFUSALS_PER_ACCEPT):
            fd, addr = self._accept()  # BlockingIOError: none waiting (asyncio stops)
            conn = GuardedConnection(self.family, self.type, self.proto, fileno=fd)
            if self.guard.take(conn, addr):
                return conn, addr
        raise BlockingIOError  # more may be waiting: asyncio's next turn takes them


def _host(addr) -> str:
    return str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)


def _peer_key(addr):
    return tuple(addr[:2]) if isinstance(addr, tuple) else addr


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the header timeout of `guard.limits`."""
    timeout = guard.limits.header_timeout

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.client_peer = transport.get_extra_info("peername")
            guard.started(self.client_peer)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._between_requests():
                self._arm()  # the first byte of a later request on a kept-alive connection
            super().data_received(data)
            if self._header_timer is not None and not self._between_requests():
                self._header_timer.cancel()  # its headers are in
                self._header_timer = None
                guard.busy(self.client_peer)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._between_requests() and not self.transport.is_closing():
                guard.idle(self.client_peer)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(timeout, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                guard.refusals.warning(
                    "slow", "HTTP port: closed a connection that sent no request in %.0f s",
                    timeout,
                )  # fmt: skip
                self.transport.close()

    return GuardedH11Protocol


class KeyConnections:
    """ASGI middleware of a router with API keys: each request's connection counts
    against its key's share (`ConnectionGuard.claim`); over it, 503 and close."""

    def __init__(self, app, guard: ConnectionGuard, tenant_of) -> None:
        """`tenant_of(authorization)`: the key's tenant id, None for no valid key."""
        self.app, self.guard, self.tenant_of = app, guard, tenant_of

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("client"):
            auth = dict(scope.get("headers") or ()).get(b"authorization")
            tenant = self.tenant_of(auth.decode("latin-1") if auth else None)
            why = self.guard.claim(scope["client"], tenant) if tenant else None
            if why is not None:
                await _refuse_request(receive, send)
                return
        await self.app(scope, receive, send)


async def _refuse_request(receive, send) -> None:
    """The fixed 503 (its body read first, briefly: closing over unread bytes resets)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1.0):
            while (await receive()).get("more_body"):
                pass
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"1"),
               (b"connection", b"close"), (b"content-length", b"%d" % len(_REFUSAL_BODY))]  # fmt: skip
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": _REFUSAL_BODY})


class RateLimitFilter(logging.Filter):
    """At most one record of each message per `interval` seconds (a flood of invalid
    requests must not fill the disk); the next one says how many were left out."""

    def __init__(self, interval: float = 10.0) -> None:
        super().__init__()
        self.interval = interval
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = str(record.msg)
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._skipped[key] = self._skipped.get(key, 0) + 1
            return False
        if len(self._last) > 256:
            self._last.clear()
        self._last[key] = now
        skipped = self._skipped.pop(key, 0)
        if skipped:
            record.msg = (
                f"{record.msg} ({skipped} more like this in the last {self.interval:.0f} s)"
            )
        return True


def limit_uvicorn_logs() -> None:
    """Rate-limit uvicorn's warnings (once per process)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
        logger.addFilter(RateLimitFilter())


class BodyLimit:
    """ASGI middleware: a request body over `limit()` bytes is refused 413 before it is
    parsed: by its Content-Length, or by reading a chunked body up to the limit (the
    body is then passed on as read); one that has not all arrived `timeout` seconds
    after its headers is refused 408 (a client sending a byte at a time holds nothing
    for long); one whose size alone says its prompt could not be tokenized now
    (`busy(length)`) is refused 429 before it is read or parsed."""

    def __init__(self, app, limit, timeout: float, busy=lambda length: False) -> None:
        self.app, self.limit, self.timeout, self.busy = app, limit, timeout, busy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.limit()
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > cap):
            await self._refuse(cap, scope, receive, send)
            return
        if length is not None and self.busy(int(length)):
            e = ApiError(429, "the router is tokenizing as much as it may at once: retry later",
                         "resource_exhausted")  # fmt: skip
            await _drain(receive)
            await error_response(e, close=True)(scope, receive, send)
            return
        read, seen = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                e = ApiError(408, f"the request body did not arrive within {self.timeout:.0f} s",
                             "request_timeout")  # fmt: skip
                await error_response(e, close=True)(scope, receive, send)
                return
            read.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > cap:
                await self._refuse(cap, scope, receive, send)
                return
            if not message.get("more_body"):
                break

        async def replay():
            return read.pop(0) if read else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(cap: int, scope, receive, send) -> None:
        e = ApiError(413, f"the request body is larger than {cap} bytes", "request_too_large")
        await _drain(receive)
        await error_response(e, close=True)(scope, receive, send)


# A refused body is read and dropped, up to this much for this long, before the answer:
# closing a connection over unread bytes resets it, and the client may lose the answer.
DRAIN_BYTES = 8 << 20
DRAIN_SECONDS = 1.0


async def _drain(receive) -> None:
    seen = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_SECONDS):
            while seen <= DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body"):
                    return
                seen += len(message.get("body", b""))
