"""The limits of the router's public ports (docs/architecture.md, "9. Security"): how
many connections they hold, how long a client may take to send a request, and the
public gRPC port's options. One `EdgeLimits` per router; the HTTP port applies its part
in `http_guard.py`, the gRPC port through `grpc_options` and `InvalidMessages`.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from ..conn_limits import default_max_connections

if TYPE_CHECKING:
    from ..config import RouterConfig

# One client address may hold this many HTTP connections (0: no cap; set it to 0 or to
# the total behind a proxy, where every client comes from the proxy's address).
DEFAULT_PER_CLIENT = 64
# A request's line and headers must arrive within this many seconds of the connection's
# first byte (or of the previous response); a keep-alive connection may stay silent this
# long between requests; its body must arrive within `body_timeout`.
HEADER_TIMEOUT = 5.0
IDLE_TIMEOUT = 5.0
BODY_TIMEOUT = 30.0
MAX_HEADER_BYTES = 16 << 10  # request line and headers (h11's incomplete-event cap)
# The public gRPC port: streams per connection, the time a new connection has to
# finish its handshake, and how long a connection without calls stays open.
GRPC_MAX_STREAMS = 256
GRPC_HANDSHAKE_SECONDS = 10.0
GRPC_MAX_IDLE_SECONDS = 300.0
# The shortest interval between a client's keepalive pings the public gRPC port accepts
# (gRPC's default, 5 minutes, answers faster pings with GOAWAY "too_many_pings").
MIN_CLIENT_PING_MS = 1000


@dataclass(frozen=True)
class EdgeLimits:
    """Connection caps and timeouts of the public HTTP and gRPC ports."""

    # Connections each public port holds at once (the HTTP port and the gRPC port
    # separately): 1024, or a quarter of the file-descriptor limit when that is lower.
    max_connections: int = field(default_factory=default_max_connections)
    max_connections_per_client: int = DEFAULT_PER_CLIENT
    header_timeout: float = HEADER_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT
    body_timeout: float = BODY_TIMEOUT
    max_header_bytes: int = MAX_HEADER_BYTES
    grpc_max_streams: int = GRPC_MAX_STREAMS
    grpc_handshake_seconds: float = GRPC_HANDSHAKE_SECONDS
    grpc_max_idle_seconds: float = GRPC_MAX_IDLE_SECONDS

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_connections_per_client < 0:
            raise ValueError("connection caps must be positive (per client: 0 for none)")
        for name in ("header_timeout", "idle_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")

    @classmethod
    def of(cls, config: RouterConfig) -> EdgeLimits:
        """The limits `config` sets (--http-max-connections..., ValueError for bad
        ones); the others are this class's defaults."""
        given = (
            {"max_connections": config.http_max_connections} if config.http_max_connections else {}
        )
        return cls(
            max_connections_per_client=config.http_max_connections_per_client,
            header_timeout=config.http_header_timeout,
            **given,
        )

    def grpc_options(self) -> list[tuple[str, int]]:
        """Options of the public gRPC server (gRPC core enforces them)."""
        return [
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_concurrent_streams", self.grpc_max_streams),
            ("grpc.server_handshake_timeout_ms", int(self.grpc_handshake_seconds * 1e3)),
            ("grpc.max_connection_idle_ms", int(self.grpc_max_idle_seconds * 1e3)),
            # Clients' keepalive pings (the SDK's, to notice a router gone silent and
            # resume elsewhere) are welcome every second, with data or without.
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_MS),
        ]


class InvalidMessages(grpc.aio.ServerInterceptor):
    """A request to `service` that does not parse (a string that is not UTF-8, a
    truncated message) is INVALID_ARGUMENT with a message, not gRPC's UNKNOWN."""

    def __init__(self, service: str) -> None:
        self.prefix = f"/{service}/"

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (
            handler is None
            or handler.request_streaming
            or not details.method.startswith(self.prefix)
        ):
            return handler
        return _tolerant(handler, details.method.rsplit("/", 1)[-1])


class _Undecodable:
    def __init__(self, why: str) -> None:
        self.why = why


def _tolerant(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` whose request parse failure reaches it as an `_Undecodable`."""
    parse = handler.request_deserializer

    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError:
            return _Undecodable(
                f"the {method} request does not parse (a malformed message, or a string "
                "field that is not valid UTF-8)"
            )

    codec = dict(request_deserializer=deserialize,
                 response_serializer=handler.response_serializer)  # fmt: skip
    if handler.response_streaming and not inspect.iscoroutinefunction(handler.unary_stream):
        inner_stream = handler.unary_stream

        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            async with contextlib.aclosing(inner_stream(request, context)) as responses:
                async for response in responses:
                    yield response

        return grpc.unary_stream_rpc_method_handler(stream, **codec)
    # a unary call, or a stream its handler writes itself (a coroutine, `context.write`)
    inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
        return await inner(request, context)

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(unary, **codec)
    return grpc.unary_unary_rpc_method_handler(unary, **codec)
