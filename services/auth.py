"""API keys of the router's client APIs: `Authorization: Bearer KEY` on the HTTP API and
`authorization: Bearer KEY` metadata on the gRPC Generation service.

One `ApiKeys` serves both. Without keys everything is open (the default); with keys, a
request needs one of them. Health and reflection stay open (probes and tools call them).
Keys are compared in constant time.

What a caller may do comes with its key (`Caller`): the highest `priority` its requests
may ask for, and whether it is an operator (the router's `Describe` then shows internal
addresses), and which tenant it is (`Caller.tenant`: the router's fair shares and
prefix-cache isolation are per tenant; an id derived from the key, never the key, or
the client's address on a router without keys). A key file line is `KEY [max_priority=N] [operator]`; keys without
`max_priority`, keys given on the command line, and every caller of a router without
keys get the default cap (`--max-priority`, DEFAULT_MAX_PRIORITY).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

SCHEME = "bearer"
MISSING_KEY = (
    "this server needs an API key: send 'Authorization: Bearer KEY' "
    "(the openai client's api_key, or specpipe's --api-key)"
)
WRONG_KEY = "the API key is not valid"
# The highest priority a request may ask for unless its key allows more. Waiting
# requests gain one level per aging period (10 s, common/spec/scheduler.py), so nobody
# waits more than about cap x 10 s behind requests of higher priority.
DEFAULT_MAX_PRIORITY = 10
OPERATOR = "operator"
MAX_PRIORITY = "max_priority"


class ApiKeyError(ValueError):
    """A key file that cannot be read, names no key, or has a line it cannot parse."""


@dataclass(frozen=True)
class Caller:
    """What the client of one call may do (from its key, or the defaults)."""

    max_priority: int = DEFAULT_MAX_PRIORITY
    operator: bool = False
    tenant: str = ""  # "key:<hash of the key>", "addr:<client address>", "" (in-process)


def key_tenant(key: str) -> str:
    """A key's tenant id: a hash (it may reach logs and the cache salts' derivation;
    the key itself never leaves the router's memory)."""
    return "key:" + hashlib.blake2b(key.encode(), digest_size=12, person=b"sp-tenant").hexdigest()


def peer_host(peer: str) -> str:
    """The host of a gRPC peer ("ipv4:10.0.0.5:5000" -> "10.0.0.5", "ipv6:[::1]:5" ->
    "::1"; "unix:..." as it is)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    return rest.rsplit(":", 1)[0].strip("[]")


@dataclass(frozen=True)
class KeyPolicy:
    """A key file's attributes of one key (None: the default cap)."""

    max_priority: int | None = None
    operator: bool = False


def parse_key_line(line: str) -> tuple[str, KeyPolicy]:
    """`KEY [max_priority=N] [operator]`."""
    key, *attrs = line.split()
    max_priority, operator = None, False
    for a in attrs:
        name, eq, value = a.partition("=")
        if a == OPERATOR:
            operator = True
        elif name == MAX_PRIORITY and eq and value.lstrip("-").isdigit():
            max_priority = int(value)
        else:
            raise ApiKeyError(
                f"unknown key attribute {a!r} (a line is: KEY [{MAX_PRIORITY}=N] [{OPERATOR}])"
            )
    return key, KeyPolicy(max_priority, operator)


class ApiKeys:
    def __init__(
        self,
        keys: Iterable[str] = (),
        policies: dict[str, KeyPolicy] | None = None,
        default_max_priority: int = DEFAULT_MAX_PRIORITY,
    ) -> None:
        """`policies`: attributes of some keys (every key in them is a key too)."""
        policies = policies or {}
        names = dict.fromkeys(k.strip() for k in [*keys, *policies])
        self._keys = [k.encode() for k in names if k]
        self._policies = [policies.get(k, KeyPolicy()) for k in names if k]
        self.default_max_priority = default_max_priority

    @classmethod
    def load(
        cls,
        keys: Sequence[str] = (),
        files: Sequence[str | Path] = (),
        default_max_priority: int = DEFAULT_MAX_PRIORITY,
    ) -> ApiKeys:
        """Keys given directly plus those of key files: one a line, `KEY
        [max_priority=N] [operator]`; blank lines and lines starting with '#' are
        skipped."""
        policies: dict[str, KeyPolicy] = {}
        for f in files:
            try:
                lines = Path(f).read_text().splitlines()
            except OSError as e:
                raise ApiKeyError(f"cannot read API key file {f}: {e.strerror}") from None
            lines = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
            if not lines:
                raise ApiKeyError(f"API key file {f} lists no key")
            for ln in lines:
                try:
                    key, policy = parse_key_line(ln)
                except ApiKeyError as e:
                    raise ApiKeyError(f"API key file {f}: {e}") from None
                policies[key] = policy
        return cls(keys, policies, default_max_priority)

    @property
    def keys(self) -> list[str]:
        return [k.decode() for k in self._keys]

    @property
    def lines(self) -> list[str]:
        """The keys as key file lines, with their attributes (what `load` reads back)."""
        out = []
        for k, p in zip(self.keys, self._policies, strict=True):
            attrs = [] if p.max_priority is None else [f"{MAX_PRIORITY}={p.max_priority}"]
            out.append(" ".join([k, *attrs, *([OPERATOR] if p.operator else [])]))
        return out

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def valid(self, key: str) -> bool:
        """Whether `key` is one of the keys (every key compared, in constant time)."""
        return self._find(key) is not None

    def _find(self, key: str) -> int | None:
        """The index of `key` among the keys; every key is compared (constant time)."""
        given = key.encode()
        found = None
        for i, k in enumerate(self._keys):
            if hmac.compare_digest(given, k):
                found = i
        return found

    def caller(self, authorization: str | None, client: str = "") -> Caller:
        """What the client presenting this `Authorization` value from address `client`
        may do (call `check` first: an invalid key gets the defaults here)."""
        _, _, key = (authorization or "").strip().partition(" ")
        i = self._find(key.strip()) if self.enabled else None
        if i is None:
            return Caller(self.default_max_priority, tenant=f"addr:{client}" if client else "")
        p = self._policies[i]
        cap = self.default_max_priority if p.max_priority is None else p.max_priority
        return Caller(cap, p.operator, key_tenant(key.strip()))

    def caller_of_call(self, context) -> Caller:
        """`caller` for a gRPC call (its `authorization` metadata and peer); None: no
        call."""
        if context is None:
            return self.caller(None)
        found = {k.lower(): v for k, v in context.invocation_metadata() or ()}
        return self.caller(found.get("authorization"), peer_host(context.peer() or ""))

    def valid_tenant(self, authorization: str | None) -> str | None:
        """The tenant of a valid key in this `Authorization` value (None: no valid key)."""
        if self.check(authorization) is not None:
            return None
        return self.caller(authorization).tenant or None

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
