"""API keys of the router's client APIs: `Authorization: Bearer KEY` on the HTTP API and
`authorization: Bearer KEY` metadata on the gRPC Generation service.

One `ApiKeys` serves both. Without keys everything is open (the default); with keys, a
request needs one of them. Health and reflection stay open (probes and tools call them).
Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc

SCHEME = "bearer"
MISSING_KEY = (
    "this server needs an API key: send 'Authorization: Bearer KEY' "
    "(the openai client's api_key, or specpipe's --api-key)"
)
WRONG_KEY = "the API key is not valid"


class ApiKeyError(ValueError):
    """A key file that cannot be read or names no key."""


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [k.encode() for k in dict.fromkeys(k.strip() for k in keys) if k]

    @classmethod
    def load(cls, keys: Sequence[str] = (), files: Sequence[str | Path] = ()) -> ApiKeys:
        """Keys given directly plus those of key files: one a line; blank lines and lines
        starting with '#' are skipped."""
        found = list(keys)
        for f in files:
            try:
                lines = Path(f).read_text().splitlines()
            except OSError as e:
                raise ApiKeyError(f"cannot read API key file {f}: {e.strerror}") from None
            names = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
            if not names:
                raise ApiKeyError(f"API key file {f} lists no key")
            found += names
        return cls(found)

    @property
    def keys(self) -> list[str]:
        return [k.decode() for k in self._keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def valid(self, key: str) -> bool:
        """Whether `key` is one of the keys (every key compared, in constant time)."""
        given = key.encode()
        ok = False
        for k in self._keys:
            ok |= hmac.compare_digest(given, k)
        return ok

    def check(self, authorization: str | None) -> str | None:
        """None when the `Authorization` value lets the request through, else why not."""
        if not self.enabled:
            return None
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != SCHEME or not key.strip():
            return MISSING_KEY
        return None if self.valid(key.strip()) else WRONG_KEY

    def grpc_interceptor(self, service: str) -> grpc.aio.ServerInterceptor:
        """Checks the `authorization` metadata of every call to `service` (full name,
        e.g. specpipe.v1.Generation); other services pass."""
        return _GrpcAuth(self, f"/{service}/")


class _GrpcAuth(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys, prefix: str) -> None:
        self.keys, self.prefix = keys, prefix

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        metadata = {k.lower(): v for k, v in details.invocation_metadata or ()}
        why = self.keys.check(metadata.get("authorization"))
        if why is None:
            return handler
        return _refuse(handler, why)


def _refuse(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that fails UNAUTHENTICATED."""

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    codec = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **codec)
    return grpc.unary_unary_rpc_method_handler(deny, **codec)
