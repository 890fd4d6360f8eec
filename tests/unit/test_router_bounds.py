"""Oversized client requests are refused before the router builds anything from them
(issue 13: a 47 MB prompt took 1.4 GB and 4.4 s to refuse): the public gRPC port's
message cap and the HTTP API's body cap come from the model's context, a token-id
prompt is measured by its length and a text prompt by its characters first."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.parse

import grpc
import pytest
from specpipe.services.router.bounds import (
    DEFAULT_MAX_REQUEST_BYTES,
    context_of,
    max_prompt_chars,
    max_request_bytes,
)
from specpipe.services.router.service import RequestFailed
from specpipe.v1 import generation_pb2 as gen
from specpipe.v1 import generation_pb2_grpc

from .test_http_api import failing, with_app


def test_caps_follow_the_context(llama_dir, tmp_path) -> None:
    assert context_of(llama_dir) == 256
    assert context_of(tmp_path) is None and context_of(None) is None
    assert max_request_bytes(None) == DEFAULT_MAX_REQUEST_BYTES
    small, large = max_request_bytes(256), max_request_bytes(32768)
    assert small < 2 << 20 and large < 8 << 20  # not 1 GiB
    assert 4 * max_prompt_chars(32768) < large


def test_oversized_grpc_requests_are_refused_before_they_are_read(llama_dir) -> None:
    from specpipe.services.router.backends import ModelInfo

    from ..router_config import router_service

    async def main():
        router = router_service(["127.0.0.1:9"], target=str(llama_dir))
        router.engine.model = ModelInfo("m", "h", num_layers=4, vocab_size=97, max_positions=256,
                                 eos_token_ids=(96,), ranges=[(0, 4)])  # fmt: skip
        port = await router.server.start("127.0.0.1", 0)
        big = [("grpc.max_send_message_length", 1 << 30)]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=big)
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def status(req) -> tuple[grpc.StatusCode, float, str]:
            t0 = time.monotonic()
            try:
                async for _ in stub.Generate(req, timeout=30):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code(), time.monotonic() - t0, e.details()
            return grpc.StatusCode.OK, 0.0, ""

        try:
            huge = gen.GenerateRequest(max_new_tokens=2)
            huge.token_ids.ids.extend([5] * (8 << 20))  # 8 MB on the wire
            code, seconds, _ = await status(huge)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and seconds < 5
            long_text = gen.GenerateRequest(text="a" * 10_000, max_new_tokens=2)  # < cap
            code, _, why = await status(long_text)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "characters" in why
            long_ids = gen.GenerateRequest(max_new_tokens=2)
            long_ids.token_ids.ids.extend([5] * 300)
            code, _, why = await status(long_ids)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "context holds 256" in why
        finally:
            await channel.close()
            await router.server.stop(None)
            await router.engine.backends.close()

    asyncio.run(main())


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_http_bodies_are_refused_413(chunked: bool) -> None:
    async def fn(client, router):
        router.max_request_bytes = 20_000
        url = urllib.parse.urlsplit(str(client.base_url))
        body = b'{"model": "m", "prompt": "' + b"a" * 50_000 + b'"}'

        def post(data, chunked_body: bool) -> tuple[int, dict]:
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
            headers = {"Authorization": "Bearer k", "Content-Type": "application/json"}
            if chunked_body:
                parts = (data[i : i + 4096] for i in range(0, len(data), 4096))
                conn.request("POST", "/v1/completions", parts, headers, encode_chunked=True)
            else:
                conn.request("POST", "/v1/completions", data, headers)
            r = conn.getresponse()
            out = r.status, json.loads(r.read())
            conn.close()
            return out

        status, err = await asyncio.to_thread(post, body, chunked)
        ok, _ = await asyncio.to_thread(post, b'{"model": "m", "prompt": "hi"}', chunked)
        return status, err["error"]["code"], ok

    assert with_app(failing(grpc.StatusCode.INTERNAL), fn) == (413, "request_too_large", 500)


def test_long_chat_messages_are_refused_before_the_template() -> None:
    async def fn(client, router):
        import openai

        rendered = []
        router.codec = type("C", (), {"encode_chat": lambda self, m: rendered.append(m)})()
        with pytest.raises(openai.BadRequestError, match="characters"):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "a" * 9000}]
            )
        return rendered

    assert with_app(failing(grpc.StatusCode.INTERNAL), fn) == []


def test_request_failed_is_raised_for_the_oversized_prompt() -> None:
    """`plan` (used by both APIs) refuses by length before tokenizing."""
    from specpipe.services.client import build_request

    from .test_services_router import _with_router

    def check(router):
        router.codec = type("C", (), {"encode": lambda *a, **k: pytest.fail("tokenized")})()
        with pytest.raises(RequestFailed, match="characters"):
            router.plan(build_request("a" * 9000, max_new_tokens=2))

    _with_router(check)
