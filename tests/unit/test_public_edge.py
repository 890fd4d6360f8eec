"""The router's public edge without a deployment (issue 22): connection caps and header,
idle and body timeouts on the HTTP port, rate-limited refusal logs, the bounded
tokenization queue, 400/INVALID_ARGUMENT for out-of-range or malformed fields, priority
capped per API key, Describe without internal addresses for the public, and the
metrics servers' bounded threads.

A router here knows its model but reaches no stage ("127.0.0.1:9"), so a request
that passes every check ends 503 ("no complete path"): that status means "admitted".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import urllib.request
from types import SimpleNamespace

import grpc
import pytest
from specpipe.services import metrics as metrics_module
from specpipe.services.auth import ApiKeyError, ApiKeys
from specpipe.services.metrics import ServiceMetrics
from specpipe.services.router.backends import ModelInfo
from specpipe.services.router.edge import EdgeLimits
from specpipe.services.router.http_api import HttpServer
from specpipe.services.router.http_guard import RateLimitFilter
from specpipe.services.router.requests import RequestFailed
from specpipe.services.router.service import is_local_peer
from specpipe.services.router.tokenizing import SHORT_CHARS
from specpipe.v1 import generation_pb2 as gen
from specpipe.v1 import generation_pb2_grpc

from ..router_config import router_service

ADMITTED = 503  # passed every check; no stage to run on
ATTACKER = "127.0.0.2"  # another loopback address: a second client
WAIT = 30.0  # generous bound on anything that must happen (a test, not a benchmark)


# -- a router with its public ports, no stages ------------------------------------------------
@contextlib.asynccontextmanager
async def edge(limits=None, keys=None, codec=None, max_positions=256, with_grpc=False, **kw):
    router = router_service(
        ["127.0.0.1:9"], api_keys=keys or ApiKeys(), limits=limits or EdgeLimits(), **kw
    )
    router.engine.model = ModelInfo("m", "h", num_layers=4, vocab_size=97, max_positions=max_positions,
                             eos_token_ids=(96,), ranges=[(0, 4)])  # fmt: skip
    router.engine.backends._ready = True
    router.engine.codec = codec
    http = HttpServer(router.engine, router.limits)
    port = await http.start("127.0.0.1", 0)
    grpc_port = await router.server.start("127.0.0.1", 0) if with_grpc else 0
    try:
        yield SimpleNamespace(router=router, http=http, port=port, grpc=f"127.0.0.1:{grpc_port}")
    finally:
        await http.stop()
        if with_grpc:
            await router.server.stop(None)
        await router.engine.backends.close()
        router.engine._tokenizing.shutdown()


async def request(port, path="/health", body=None, key=None, source=None, method=None):
    """(status, JSON body) of one request on its own connection."""
    data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    head = [f"{method or ('POST' if body is not None else 'GET')} {path} HTTP/1.1",
            "Host: x", "Connection: close", f"Content-Length: {len(data)}",
            "Content-Type: application/json"]  # fmt: skip
    if key:
        head.append(f"Authorization: Bearer {key}")
    r, w = await asyncio.open_connection(
        "127.0.0.1", port, local_addr=(source, 0) if source else None
    )
    w.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    raw = await asyncio.wait_for(r.read(), WAIT)
    w.close()
    return parse(raw)


def parse(raw: bytes) -> tuple[int, dict]:
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(payload) if payload.strip() else {}


async def silent(port, n, source=None):
    """`n` connections that send nothing."""
    addr = (source, 0) if source else None
    return [await asyncio.open_connection("127.0.0.1", port, local_addr=addr) for _ in range(n)]


async def answers(conns) -> list[bytes]:
    """What each connection receives until the server closes it (b"": closed silently)."""

    async def one(r):
        with contextlib.suppress(ConnectionResetError):
            return await asyncio.wait_for(r.read(), WAIT)
        return b""

    try:
        return await asyncio.gather(*(one(r) for r, _ in conns))
    finally:
        for _, w in conns:
            w.close()


# -- N2: the HTTP port's caps and timeouts -----------------------------------------------------
def test_silent_connections_are_closed_and_requests_still_served() -> None:
    async def main():
        async with edge(EdgeLimits(header_timeout=0.5)) as e:
            conns = await silent(e.port, 20)
            assert (await request(e.port))[0] == 200  # served meanwhile
            got = await answers(conns)  # closed by the header timeout, with nothing said
            return got, e.http.guard.counts.open

    got, left = asyncio.run(main())
    assert got == [b""] * 20 and left == 0


def test_slow_headers_are_closed() -> None:
    """A client sending its headers a byte at a time is closed after the header timeout,
    also on a kept-alive connection's second request (uvicorn's keep-alive timer stops
    at the first byte)."""

    async def main():
        limits = EdgeLimits(header_timeout=0.5, idle_timeout=60)
        async with edge(limits) as e:
            r, w = await asyncio.open_connection("127.0.0.1", e.port)
            closed = asyncio.ensure_future(r.read())
            sent = 0
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
                if closed.done():
                    break
                with contextlib.suppress(ConnectionError):
                    w.write(bytes([byte]))
                    sent += 1
                await asyncio.sleep(0.02)
            # Closed: the end of the stream, or a reset (bytes of ours were still unread).
            first = closed.done() and (closed.exception() is not None or closed.result() == b"")
            w.close()
            # Keep-alive: one complete request, then a second that never finishes.
            r, w = await asyncio.open_connection("127.0.0.1", e.port)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), WAIT)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await r.readexactly(length)
            w.write(b"GET /hea")
            rest = b"reset"
            with contextlib.suppress(ConnectionResetError):
                rest = await asyncio.wait_for(r.read(), WAIT)
            rest = b"" if rest == b"reset" else rest
            w.close()
            return first, sent, rest

    first, sent, rest = asyncio.run(main())
    assert first and sent < 1000 and rest == b""


def test_a_body_that_does_not_arrive_is_refused_408() -> None:
    async def main():
        async with edge(EdgeLimits(body_timeout=0.5)) as e:
            r, w = await asyncio.open_connection("127.0.0.1", e.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                    b"Content-Type: application/json\r\n\r\n{\"prompt\": ")  # fmt: skip
            raw = await asyncio.wait_for(r.read(), WAIT)  # then closed
            w.close()
            return parse(raw)

    status, body = asyncio.run(main())
    assert status == 408 and "did not arrive" in body["error"]["message"]


def test_tls_connections_that_never_finish_their_handshake_are_closed(tmp_path) -> None:
    """With public TLS the protocol sees a connection only after its handshake: the
    guard shuts down one whose handshake has not finished within the header timeout
    (asyncio's own handshake timeout is 60 s), and counts it until then."""
    import ssl

    from specpipe.services.security import PublicTls, make_pki

    pki = make_pki(tmp_path / "public", hosts=["127.0.0.1"])
    tls = PublicTls.load(pki / "tls.crt", pki / "tls.key")

    async def main():
        router = router_service(["127.0.0.1:9"], limits=EdgeLimits(header_timeout=2.0))
        http = HttpServer(router.engine, router.limits)
        port = await http.start("127.0.0.1", 0, tls)
        try:
            conns = await silent(port, 5)
            counted = http.guard.counts.open  # counted before any handshake
            got = await answers(conns)
            left = http.guard.counts.open
            ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
            r, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            status = parse(await asyncio.wait_for(r.read(), WAIT))[0]
            w.close()
            return counted, got, status, left
        finally:
            await http.stop()
            await router.engine.backends.close()

    counted, got, status, left = asyncio.run(main())
    assert counted >= 1 and got == [b""] * 5 and left == 0
    assert status == 503  # starting: but served over TLS


def test_connections_per_client_are_capped_and_other_clients_served() -> None:
    async def main():
        limits = EdgeLimits(max_connections_per_client=4, header_timeout=5.0)
        async with edge(limits) as e:
            conns = await silent(e.port, 10, source=ATTACKER)
            status, _ = await request(e.port)  # another address: served at once
            got = await answers(conns)
            return status, got

    status, got = asyncio.run(main())
    assert status == 200
    refused = [g for g in got if g.startswith(b"HTTP/1.1 503")]
    assert len(refused) == 6 and got.count(b"") == 4
    assert b"too many connections" in refused[0] and b"Retry-After: 1" in refused[0]


def test_with_api_keys_the_connection_cap_is_per_key_not_per_address() -> None:
    """Issue 35 residue: one client behind a NAT or an ingress used up its address's
    connections and locked out everyone there. With keys, key a holds its 2 (a third
    request of a's is refused 503 and closed); key b, from the same address, is served;
    silent connections from that address are not refused for it."""

    async def kept(port, key):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n"
                .encode())  # fmt: skip
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), WAIT)
        return int(head.split(b" ", 2)[1]), (r, w)

    async def main():
        limits = EdgeLimits(max_connections_per_client=2, header_timeout=5.0)
        async with edge(limits, keys=ApiKeys(["key-a", "key-b"])) as e:
            silent_ones = await silent(e.port, 4)  # same address: not refused now
            a1, c1 = await kept(e.port, "key-a")
            a2, c2 = await kept(e.port, "key-a")
            a3, c3 = await kept(e.port, "key-a")
            b1, c4 = await kept(e.port, "key-b")
            c1[1].close()
            await c1[1].wait_closed()
            await asyncio.sleep(0.2)
            a4, c5 = await kept(e.port, "key-a")  # a's first connection closed: room again
            for _, w in (c2, c3, c4, c5):
                w.close()
            for _, w in silent_ones:
                w.close()
            return [a1, a2, a3, b1, a4]

    assert asyncio.run(main()) == [200, 200, 503, 200, 200]


def test_a_full_port_closes_its_oldest_idle_connection_for_a_new_one(caplog) -> None:
    """40 silent connections (as from 40 addresses) on a port that holds 6: at most 6
    are open at any time, each new one closes the oldest idle one, and a client with a
    request is served at once; one log line."""

    async def main():
        limits = EdgeLimits(max_connections=6, max_connections_per_client=0, header_timeout=5.0)
        async with edge(limits) as e:
            conns = await silent(e.port, 40)
            served = await request(e.port)
            guard = e.http.guard
            most = guard.counts.open
            got = await answers(conns)
            return served, most, got, guard.evicted, guard.counts.open

    with caplog.at_level(logging.WARNING):
        served, most, got, evicted, left = asyncio.run(main())
    assert served == (200, {"status": "ok", "model": "m"})
    assert most <= 6 and evicted == 35 and got == [b""] * 40 and left == 0
    lines = [r for r in caplog.records if "oldest idle" in r.getMessage()]
    assert len(lines) == 1


def test_a_port_full_of_busy_connections_refuses_new_ones_503(caplog) -> None:
    """When every connection has a request under way, a new one is answered 503 and
    closed (not queued, no descriptor kept); 30 refusals, one log line."""
    release = asyncio.Event

    async def main():
        limits = EdgeLimits(max_connections=2, max_connections_per_client=0)
        async with edge(limits) as e:
            go = release()

            async def held(req):
                await go.wait()
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "released")
                yield

            e.router.engine.generate = lambda req, deadline=None, caller=None, model=None: held(req)
            busy = [asyncio.ensure_future(request(e.port, "/v1/completions", {"prompt": [1]}))
                    for _ in range(2)]  # fmt: skip
            while e.http.guard._idle or e.http.guard.counts.open < 2:
                await asyncio.sleep(0.01)
            refused = []
            for _ in range(30):
                try:
                    refused.append(await request(e.port))
                except ConnectionResetError:  # closed before our request was read: refused
                    refused.append((503, {"error": {"code": "too_many_connections"}}))
            go.set()
            return refused, [await b for b in busy], await request(e.port)

    with caplog.at_level(logging.WARNING):
        refused, busy, after = asyncio.run(main())
    assert {s for s, _ in refused} == {503}
    assert refused[0][1]["error"]["code"] == "too_many_connections"
    assert [s for s, _ in busy] == [503, 503] and after[0] == 200  # released, then free
    lines = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(lines) == 1


def test_uvicorn_warnings_are_rate_limited() -> None:
    f = RateLimitFilter(interval=60)
    records = [logging.LogRecord("uvicorn.error", logging.WARNING, "", 0,
                                 "Invalid HTTP request received.", (), None)
               for _ in range(1000)]  # fmt: skip
    assert sum(f.filter(r) for r in records) == 1
    assert f.filter(logging.LogRecord("u", logging.WARNING, "", 0, "other", (), None))


# -- N6: tokenization is bounded ---------------------------------------------------------------
class SlowCodec:
    """A tokenizer whose long texts take until `release` is set (a 4 MB prompt's
    seconds, held open), one id per character; short texts are immediate."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.long_started = 0

    def encode_chat(self, messages, tools=None, add_generation_prompt=True):
        text = "".join(m["content"] for m in messages)
        if len(text) > SHORT_CHARS:
            self.long_started += 1
            self.release.wait(WAIT)
        return [1 + (ord(c) % 90) for c in text[:8]]

    def encode(self, text, chat=False):
        return self.encode_chat([{"content": text}])


def test_long_prompts_beyond_the_tokenizer_budget_are_429_and_short_ones_pass() -> None:
    """Context 4096: prompts up to 131072 characters, as many characters tokenized at
    once. Eight 100k-character chats at once: one is tokenized, seven refused 429 at
    once; a neighbour's short chat passes tokenization meanwhile."""
    codec = SlowCodec()
    chat = lambda n: {"messages": [{"role": "user", "content": "x" * n}], "max_tokens": 4}  # noqa: E731

    async def main():
        async with edge(codec=codec, max_positions=4096) as e:
            longs = [asyncio.ensure_future(request(e.port, "/v1/chat/completions", chat(100_000)))
                     for _ in range(8)]  # fmt: skip
            deadline = time.monotonic() + WAIT
            while sum(t.done() for t in longs) < 7 and time.monotonic() < deadline:
                await asyncio.wait(longs, timeout=0.05)
            refused = [t.result() for t in longs if t.done()]
            neighbour = await request(e.port, "/v1/chat/completions", chat(10))
            # 600 kB cannot be under 150k characters: refused before it is read or parsed
            # (it is not even JSON).
            unread = await request(e.port, "/v1/chat/completions", b"x" * 600_000)
            queue = e.router.engine._tokenizing
            held = (queue.long_chars, codec.long_started)
            codec.release.set()
            rest = await asyncio.gather(*longs)
            return refused, neighbour, unread, held, rest, queue.long_chars

    refused, neighbour, unread, held, rest, after = asyncio.run(main())
    assert unread[0] == 429 and "tokenizing" in unread[1]["error"]["message"]
    assert [s for s, _ in refused] == [429] * 7
    assert "retry later" in refused[0][1]["error"]["message"]
    assert neighbour[0] == ADMITTED  # tokenized while the long ones were held
    assert held == (100_000, 1) and after == 0
    assert sorted(s for s, _ in rest) == [429] * 7 + [ADMITTED]


# -- N11: every out-of-range or malformed field is 400 ------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 2**63),
        ("max_completion_tokens", 2**63),
        ("priority", 2**31),
        ("priority", -(2**31) - 1),
        ("seed", 2**64),
        ("width", 2**63),
        ("layers_per_step", 2**63),
        ("top_k", 2**63),
        ("top_k_children", 2**63),
        ("depth", 2**63),
        ("prefill_chunk", 2**63),
        ("stop_token_ids", [2**63]),
        ("prompt", [2**63]),
        ("stop", "x" * 2000),
        ("stop_token_ids", list(range(1025))),
    ],
)
def test_out_of_range_integers_are_400_naming_the_field(field, value) -> None:
    body = {"prompt": [1, 2], "mode": "pp", field: value}

    async def main():
        async with edge() as e:
            return await request(e.port, "/v1/completions", body)

    status, got = asyncio.run(main())
    assert status == 400, got
    message = got["error"]["message"]
    assert field in message or "stop token ids" in message, message


@pytest.mark.parametrize(
    "path, raw",
    [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        ("/v1/chat/completions",
         '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'),
        ("/v1/completions", '{"prompt": "\\ud800"}'),
        ("/v1/completions", '{"prompt": ["\\ud800"]}'),
        ("/v1/completions", '{"prompt": "x", "stop": ["\\udfff"]}'),
        ("/v1/completions", '{"prompt": "x", "model": "\\ud800"}'),
        ("/v1/completions", '{"prompt": "x", "mode": "\\ud800"}'),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_400(path, raw) -> None:
    async def main():
        async with edge(codec=SlowCodec()) as e:
            return await request(e.port, path, raw.encode())

    status, got = asyncio.run(main())
    message = got["error"]["message"].lower()
    assert status == 400 and ("surrogate" in message or "unicode" in message), got


def grpc_call(address, method, request_bytes, key=None, stream=False):
    """A raw call (the bytes as given), as a client with its own encoder could send."""

    async def main():
        async with grpc.aio.insecure_channel(address) as ch:
            md = (("authorization", f"Bearer {key}"),) if key else None
            ident = lambda b: b  # noqa: E731
            if stream:
                call = ch.unary_stream(method, request_serializer=ident)
                return [r async for r in call(request_bytes, metadata=md, timeout=WAIT)]
            return await ch.unary_unary(method, request_serializer=ident)(
                request_bytes, metadata=md, timeout=WAIT
            )

    return main()


@pytest.mark.parametrize(
    "method, raw",
    [
        ("Generate", bytes([0x12, 2, 0xFF, 0xFE])),  # text: not UTF-8
        ("Generate", b"\xff\xff\xff"),  # not a message
        ("Tokenize", bytes([0x0A, 1, 0xC0])),
    ],
)
def test_grpc_requests_that_do_not_parse_are_invalid_argument(method, raw) -> None:
    async def main():
        async with edge(with_grpc=True) as e:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await grpc_call(e.grpc, f"/specpipe.v1.Generation/{method}", raw,
                                stream=method == "Generate")  # fmt: skip
            return info.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in err.details()


# -- N13: priority per API key; Describe for the public ------------------------------------------
def test_key_file_attributes(tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text("# ops\nk-ops max_priority=100 operator\nk-plain\nk-low max_priority=-1\n")
    keys = ApiKeys.load(["k-cli"], [f], default_max_priority=3)
    assert keys.caller("Bearer k-ops").max_priority == 100 and keys.caller("Bearer k-ops").operator
    assert keys.caller("Bearer k-plain").max_priority == 3
    assert not keys.caller("Bearer k-plain").operator
    assert keys.caller("Bearer k-low").max_priority == -1
    assert keys.caller("Bearer k-cli").max_priority == 3
    assert keys.caller(None).max_priority == 3 and keys.caller("Bearer nope").max_priority == 3
    # What `specpipe up` writes for its router reads back the same.
    again = tmp_path / "again"
    again.write_text("\n".join(keys.lines))
    assert ApiKeys.load(files=[again]).lines == keys.lines
    f.write_text("k max_priority=high\n")
    with pytest.raises(ApiKeyError, match="unknown key attribute"):
        ApiKeys.load(files=[f])
    f.write_text("k admin\n")
    with pytest.raises(ApiKeyError, match="unknown key attribute"):
        ApiKeys.load(files=[f])


def test_priority_above_the_callers_cap_is_refused(tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text("vip max_priority=50\nplain\n")
    keys = ApiKeys.load(files=[f])
    body = lambda p: {"prompt": [1, 2], "mode": "pp", "priority": p}  # noqa: E731

    async def main():
        async with edge(keys=keys, with_grpc=True) as e:
            http = [
                await request(e.port, "/v1/completions", body(p), key=k)
                for k, p in (("plain", 11), ("plain", 10), ("plain", -5), ("vip", 50), ("vip", 51))
            ]
            req = gen.GenerateRequest(mode="pp", max_new_tokens=2, priority=2**31 - 1)
            req.token_ids.ids.extend([1, 2])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await grpc_call(e.grpc, "/specpipe.v1.Generation/Generate",
                                req.SerializeToString(), key="plain", stream=True)  # fmt: skip
            return http, info.value

    http, err = asyncio.run(main())
    assert [s for s, _ in http] == [403, ADMITTED, ADMITTED, ADMITTED, 403]
    assert (
        "priority 11 is above the highest this client may ask for (10"
        in (http[0][1]["error"]["message"])
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_router_without_keys_caps_priority_too() -> None:
    async def main():
        async with edge() as e:
            return await request(e.port, "/v1/completions",
                                 {"prompt": [1], "mode": "pp", "priority": 2**31 - 1})  # fmt: skip

    status, _ = asyncio.run(main())
    assert status == 403


def test_describe_shows_internal_addresses_to_operators_only(tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text("ops operator\nplain\n")

    async def describe(e, key=None):
        async with grpc.aio.insecure_channel(e.grpc) as ch:
            md = (("authorization", f"Bearer {key}"),) if key else None
            return await generation_pb2_grpc.GenerationStub(ch).Describe(
                gen.DescribeRouterRequest(), metadata=md, timeout=WAIT
            )

    async def main():
        async with edge(keys=ApiKeys.load(files=[f]), with_grpc=True) as e:
            public, ops = await describe(e, "plain"), await describe(e, "ops")
            health = await request(e.port)
            e.router.engine.backends._ready = False
            down = await request(e.port)
        async with edge(with_grpc=True) as e:  # no keys: nobody is an operator...
            anyone = await describe(e)
        async with edge(with_grpc=True, describe_internals=True) as e:  # ...unless told
            local = await describe(e)
        return public, ops, anyone, local, health, down

    public, ops, anyone, local, health, down = asyncio.run(main())
    (b,) = public.backends
    assert b.kind == "stage" and b.address == "" and public.data_address == ""
    assert "127.0.0.1:9" not in str(public) and b.error == "down"
    assert ops.backends[0].address == "127.0.0.1:9" and ops.data_address.startswith("tcp://")
    # Issue 35: a local caller of a router without keys saw the addresses (behind an
    # ingress on the same host, everyone is local).
    assert anyone.backends[0].address == "" and anyone.data_address == ""
    assert local.backends[0].address == "127.0.0.1:9"
    # /health is open to anyone: kinds only.
    assert health[0] == 200
    assert down == (503, {"status": "unavailable", "unhealthy": ["stage"]})


@pytest.mark.parametrize(
    "peer, local",
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.3.0.1:5000", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("unix:/tmp/s", True),
        ("ipv4:10.0.0.5:5000", False),
        ("ipv6:[2001:db8::1]:5000", False),
        ("weird", False),
    ],
)
def test_local_peers(peer, local) -> None:
    assert is_local_peer(peer) == local


# -- N12: the metrics servers ----------------------------------------------------------------------
def connect(port: int, source: str) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def test_metrics_server_caps_connections_per_client(monkeypatch) -> None:
    """300 idle connections gave a stage 311 threads: now one address holds at most
    METRICS_MAX_PER_CLIENT (a thread each), the rest are closed at once, and a scrape
    from elsewhere is answered meanwhile."""
    monkeypatch.setattr(metrics_module, "METRICS_SOCKET_TIMEOUT", 60.0)
    cap = metrics_module.METRICS_MAX_PER_CLIENT
    m = ServiceMetrics()
    port = m.serve("127.0.0.1", 0)
    before = threading.active_count()
    conns = [connect(port, ATTACKER) for _ in range(cap + 30)]
    try:
        deadline = time.monotonic() + WAIT
        while m._server.counts.refused < 30 and time.monotonic() < deadline:
            time.sleep(0.01)
        held = threading.active_count() - before
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT) as r:
            scraped = r.status
        closed = 0
        for s in conns:
            s.settimeout(0.2)
            with contextlib.suppress(TimeoutError):
                closed += s.recv(1) == b""
    finally:
        for s in conns:
            s.close()
        m.close()
    assert m._server is None and scraped == 200
    assert held <= cap and closed == 30


def test_metrics_server_closes_silent_and_slow_connections(monkeypatch) -> None:
    monkeypatch.setattr(metrics_module, "METRICS_SOCKET_TIMEOUT", 0.3)
    monkeypatch.setattr(metrics_module, "METRICS_CONNECTION_SECONDS", 1.0)
    m = ServiceMetrics()
    port = m.serve("127.0.0.1", 0)
    quiet, slow = connect(port, "127.0.0.1"), connect(port, "127.0.0.1")
    try:
        quiet.settimeout(WAIT)
        assert quiet.recv(1) == b""  # silent past the socket timeout
        sent = 0
        slow.settimeout(0.1)
        for byte in b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 1000:  # a byte per 0.1 s
            try:
                if slow.recv(1) == b"":
                    break
            except TimeoutError:
                pass
            with contextlib.suppress(OSError):
                slow.send(bytes([byte]))
                sent += 1
        assert sent < 1000  # ended by the connection deadline, not by the sender
    finally:
        quiet.close()
        slow.close()
        m.close()


def test_a_deeply_nested_body_is_refused_with_a_code() -> None:
    """Issue 35 residue: a schema nested 20,000 deep failed JSON parsing with a 400 whose
    code was null."""
    depth = 20000
    schema = b'{"a":' * depth + b"1" + b"}" * depth
    body = (b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": '
            b'{"schema": ' + schema + b"}}}")  # fmt: skip

    async def main():
        async with edge() as e:
            return await request(e.port, "/v1/completions", body)

    status, answer = asyncio.run(main())
    assert status == 400 and answer["error"]["code"] == "invalid_request_error"
    assert "nested" in answer["error"]["message"]
