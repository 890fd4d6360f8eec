"""The HTTP API without a deployment: stop strings, OpenAI bodies to GenerateRequests,
events to OpenAI responses, API keys, and the app itself in front of a scripted router
(every error status, through the official client)."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from specpipe.services.auth import ApiKeyError, ApiKeys
from specpipe.services.router.openai_compat import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Generation,
    StopMatcher,
)
from specpipe.services.router.requests import RequestFailed, StopGeneration
from specpipe.v1 import generation_pb2 as gen


# -- stop strings ----------------------------------------------------------------------------
def cut(text: str, stops: list[str], ends: list[int]) -> str:
    """The output of a generation that emits text[:e] for each e in `ends`, in turn, and
    stops as soon as a stop string is in what it has emitted."""
    for e in ends:
        hits = [i for i in (text[:e].find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)]
    return text


def run_matcher(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = [m.push(p) for p in pieces]
    out.append(m.flush())
    return out, m.stopped


def test_stop_matcher_holds_back_what_may_start_a_stop_string() -> None:
    out, stopped = run_matcher(["Hello wo", "r", "ld; END", "ING more"], ["END", "world!"])
    # "wor": maybe "world!"; "ld;": it was not; "END" arrives whole.
    assert out == ["Hello ", "", "world; ", "", ""] and stopped
    assert run_matcher(["ab", "c"], ["abd"]) == (["", "abc", ""], False)
    assert run_matcher(["x", "ab"], ["abd"]) == (["x", "", "ab"], False)  # held to the end
    assert run_matcher(["x</s", "top>y"], ["</stop>"]) == (["x", "", ""], True)
    assert run_matcher(["text"], []) == (["text", ""], False)
    # Piece by piece, a stop string that is complete first wins over one that began
    # earlier but is not complete yet (generation would have stopped there).
    assert run_matcher(["ba", "a"], ["a", "baa"]) == (["b", "", ""], True)


@given(
    text=st.text(alphabet="abc", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=6),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_matcher_equals_cutting_the_whole_text(text, cuts, stops) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, stopped = run_matcher(pieces, stops)
    assert "".join(out) == cut(text, stops, bounds[1:])
    assert stopped == any(s in text for s in stops)


# -- bodies to requests ------------------------------------------------------------------------
def test_chat_body_to_request() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
            ],
            "max_tokens": 9,
            "max_completion_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.8,
            "seed": 3,
            "stop": "END",
            "mode": "specinfer",
            "width": 4,
            "depth": 3,
            "top_k": 7,
            "ignore_eos": True,
            "stop_token_ids": [5],
            "user": "someone",  # OpenAI fields SpecPipe has no use for are ignored
        }
    )  # fmt: skip
    body.check()
    assert body.rendered_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
    ]
    req = body.to_request([1, 2, 3], default_max_tokens=100, default_mode="specpipe")
    assert list(req.token_ids.ids) == [1, 2, 3] and not req.chat
    assert req.model == "m" and req.mode == "specinfer" and req.max_new_tokens == 5
    assert req.sampling.temperature == 0.5 and req.sampling.top_p == 0.8
    assert req.sampling.seed == 3 and req.sampling.top_k == 7
    assert req.width == 4 and req.depth == 3 and not req.HasField("top_k_children")
    assert req.ignore_eos and list(req.stop_token_ids) == [5]
    assert body.stops == ["END"]


def test_tree_settings_and_auto_pass_to_the_router() -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "width": "auto",
         "layers_per_step": 2, "token_source": "auto", "ranking": "beam", "growth": "eager"}
    )  # fmt: skip
    req = body.to_request([1], default_max_tokens=8, default_mode="specpipe")
    assert req.HasField("width") and req.width == 0  # the wire's auto
    assert req.layers_per_step == 2 and req.token_source == "auto" and req.ranking == "beam"
    assert req.growth == "eager"
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "layers_per_step": "many"}
        )


def test_defaults_are_openais() -> None:
    body = CompletionRequest.model_validate({"prompt": "hi"})
    req = body.to_request(body.prompt_value(), default_max_tokens=16, default_mode="pp")
    assert req.text == "hi" and req.max_new_tokens == 16 and req.mode == "pp"
    assert req.sampling.temperature == 1.0 and not req.sampling.HasField("top_p")
    assert not req.HasField("width")
    # Sampling without a seed: a fresh seed per request; greedy needs none.
    seeds = {body.to_request("hi", 16, "pp").sampling.seed for _ in range(8)}
    assert len(seeds) > 1
    greedy = CompletionRequest.model_validate({"prompt": "hi", "temperature": 0})
    assert greedy.to_request("hi", 16, "pp").sampling.seed == 0


@pytest.mark.parametrize(
    "prompt, value",
    [("a", "a"), (["a"], "a"), ([4, 5], [4, 5]), ([[4, 5]], [4, 5]), ([], [])],
)
def test_completion_prompt_shapes(prompt, value) -> None:
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt_value() == value


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"n": 3}, "n must be 1"),
        ({"logprobs": True}, "logprobs is not supported"),
        ({"logprobs": 2}, "logprobs is not supported"),
        ({"echo": True}, "echo is not supported"),
        ({"best_of": 2}, "best_of is not supported"),
        ({"frequency_penalty": 1}, "frequency_penalty is not supported"),
        ({"logit_bias": {"5": 1}}, "logit_bias is not supported"),
        ({"tools": [{"type": "function"}]}, "tools is not supported"),
        ({"response_format": {"type": "xml"}}, "response_format type must be one of"),
        ({"stream_options": {"include_usage": True}}, "stream_options needs stream"),
        ({"stop": ["a", ""]}, "must not be empty"),
        ({"stop": ["x"] * 17}, "at most 16 stop strings"),
        ({"prompt": ["a", "b"]}, "one prompt per request"),
    ],
)
def test_what_specpipe_cannot_do_is_refused(fields, fragment) -> None:
    body = CompletionRequest.model_validate({"prompt": "hi", **fields})
    with pytest.raises(ApiError) as info:
        body.check()
        body.prompt_value()
    assert info.value.status == 400 and fragment in info.value.message


def test_defaults_of_unsupported_fields_pass() -> None:
    fields = {"logprobs": None, "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1,
              "logit_bias": {}, "tools": [], "tool_choice": "none", "echo": False,
              "response_format": {"type": "text"}}  # fmt: skip
    CompletionRequest.model_validate({"prompt": "hi", **fields}).check()


@pytest.mark.parametrize(
    "code, status",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.OUT_OF_RANGE, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
    ],
)
def test_status_codes_map_to_http(code, status) -> None:
    e = ApiError.from_status(code, "why")
    assert e.status == status
    assert e.body()["error"]["message"] == "why" and e.body()["error"]["type"]


# -- events to responses -------------------------------------------------------------------
def events(texts: list[str], reason: str = "length", tail: str = ""):
    """A scripted RouterService.generate: one token per text; StopGeneration honoured."""

    async def gen_events():
        try:
            yield gen.GenerateResponse(started=gen.Started(request_id="r-1", prompt_tokens=3))
            n, stopped = 0, False
            for i, t in enumerate(texts):
                try:
                    yield gen.GenerateResponse(delta=gen.TokenDelta(token_ids=[i], text=t, index=i))
                except StopGeneration:
                    stopped = True
                    break
                finally:
                    n += 1
            yield gen.GenerateResponse(
                finished=gen.Finished(
                    finish_reason="stop" if stopped else reason,
                    usage=gen.Usage(prompt_tokens=3, completion_tokens=n),
                    stats=gen.SpeculationStats(mode="pp", new_tokens=n),
                    text=tail,
                )
            )
        finally:
            log.append("released")  # what RouterService.generate's `finally` does

    log: list[str] = []
    return gen_events(), log


def collect(texts, stops=(), **kw):
    responses, log = events(texts, **kw)
    run = Generation(responses, stops)
    text = asyncio.run(run.text())
    return run, text, log


def test_generation_collects_text_usage_and_stats() -> None:
    run, text, log = collect(["a", "", "bc"], tail="!")
    assert text == "abc!" and run.finish_reason == "length" and run.request_id == "r-1"
    assert run.usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert run.speculation["mode"] == "pp" and run.speculation["new_tokens"] == 3
    assert run.token_ids == [0, 1, 2] and log == ["released"]


def test_a_stop_string_ends_the_request_with_its_stats() -> None:
    run, text, log = collect(["he", "llo ST", "OP and", " more"], stops=["STOP"])
    assert text == "hello " and run.finish_reason == "stop" and log == ["released"]
    assert run.usage["completion_tokens"] == 3  # the 4th token was never generated
    assert run.speculation["new_tokens"] == 3
    # A stop string in the detokenizer's last flush also counts.
    run, text, _ = collect(["a"], stops=["b!"], tail="b!")
    assert text == "a" and run.finish_reason == "stop"


# -- API keys --------------------------------------------------------------------------------
def test_api_keys(tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team A\nkey-a\n\n  key-b  \n")
    keys = ApiKeys.load(["key-c"], [f])
    assert keys.enabled and sorted(keys.keys) == ["key-a", "key-b", "key-c"]
    assert keys.check("Bearer key-b") is None and keys.check("bearer  key-a") is None
    assert "needs an API key" in keys.check(None)
    assert "needs an API key" in keys.check("Basic key-a")
    assert "not valid" in keys.check("Bearer key-d")
    assert not ApiKeys().enabled and ApiKeys().check(None) is None
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ApiKeyError, match="lists no key"):
        ApiKeys.load(files=[empty])
    with pytest.raises(ApiKeyError, match="cannot read"):
        ApiKeys.load(files=[tmp_path / "missing"])


# -- the app in front of a scripted router ---------------------------------------------------
def with_app(script, fn, keys=("k",)):
    """fn(client, router) -> result, against the HTTP API of a RouterService whose
    generate() is `script(request)` (an async generator), served on a free port."""
    from specpipe.services.router.backends import ModelInfo
    from specpipe.services.router.http_api import HttpServer
    from specpipe.services.router.service import RouterService

    async def main():
        router = RouterService(["127.0.0.1:9"], None, api_keys=ApiKeys(keys))
        router.model = ModelInfo("m", "h", num_layers=4, vocab_size=97, max_positions=256,
                                 eos_token_ids=(96,), ranges=[(0, 4)])  # fmt: skip
        router.backends._ready = True
        router.generate = lambda req, deadline=None, caller=None: script(req)
        server = HttpServer(router)
        port = await server.start("127.0.0.1", 0)
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=keys[0] if keys else "x",
            max_retries=0,
        )  # fmt: skip
        try:
            return await fn(client, router)
        finally:
            await client.close()
            await server.stop()
            await router.backends.close()

    return asyncio.run(main())


def failing(code: grpc.StatusCode):
    async def script(req):
        raise RequestFailed(code, f"failed with {code.name}")
        yield

    return script


@pytest.mark.parametrize(
    "code, error",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, openai.BadRequestError),
        (grpc.StatusCode.NOT_FOUND, openai.NotFoundError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, openai.RateLimitError),
        (grpc.StatusCode.UNAVAILABLE, openai.InternalServerError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, openai.InternalServerError),
        (grpc.StatusCode.INTERNAL, openai.InternalServerError),
    ],
)
def test_router_failures_become_openai_errors(code, error) -> None:
    async def fn(client, router):
        for stream in (False, True):
            with pytest.raises(error) as info:
                await client.completions.create(model="m", prompt="hi", stream=stream)
            assert f"failed with {code.name}" in info.value.message
        return info.value.status_code

    status = with_app(failing(code), fn)
    assert status == ApiError.from_status(code, "").status


def test_a_failure_mid_stream_is_an_error_event() -> None:
    async def script(req):
        yield gen.GenerateResponse(started=gen.Started(request_id="r"))
        yield gen.GenerateResponse(delta=gen.TokenDelta(token_ids=[1], text="a"))
        raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "stage 1 went down")

    async def fn(client, router):
        stream = await client.completions.create(model="m", prompt="hi", stream=True)
        got = []
        with pytest.raises(openai.APIError, match="stage 1 went down"):
            async for chunk in stream:
                got.append(chunk.choices[0].text)
        return got

    assert with_app(script, fn) == ["a"]


def test_health_follows_readiness_and_draining() -> None:
    import json
    import urllib.request

    async def fn(client, router):
        url = str(client.base_url).removesuffix("v1/") + "health"

        def get():
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    return r.status, json.loads(r.read())["status"]
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())["status"]

        seen = [await asyncio.to_thread(get)]
        router.backends._ready = False
        seen.append(await asyncio.to_thread(get))
        router.draining = True
        seen.append(await asyncio.to_thread(get))
        return seen

    assert with_app(failing(grpc.StatusCode.INTERNAL), fn) == [
        (200, "ok"),
        (503, "unavailable"),
        (503, "draining"),
    ]
