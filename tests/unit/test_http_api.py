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
    DEFAULT_COMPLETION_TOKENS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
)
from specpipe.services.router.requests import RequestFailed, StopGeneration
from specpipe.services.router.text_run import StopMatcher, TextRun
from specpipe.services.router.tool_calls import rendered_conversation
from specpipe.v1 import dataplane_pb2 as pb
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
    assert rendered_conversation(body.messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
    ]
    req = body.to_requests([1, 2, 3], default_max_tokens=100, default_mode="specpipe")[0]
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
    req = body.to_requests([1], default_max_tokens=8, default_mode="specpipe")[0]
    assert req.HasField("width") and req.width == 0  # the wire's auto
    assert req.layers_per_step == 2 and req.token_source == "auto" and req.ranking == "beam"
    assert req.growth == "eager"
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "layers_per_step": "many"}
        )


def test_defaults_are_openais() -> None:
    body = CompletionRequest.model_validate({"prompt": "hi"})
    req = body.to_requests(body.prompt_value(), default_max_tokens=16, default_mode="pp")[0]
    assert req.text == "hi" and req.max_new_tokens == 16 and req.mode == "pp"
    assert req.sampling.temperature == 1.0 and not req.sampling.HasField("top_p")
    assert not req.HasField("width")
    # Sampling without a seed: a fresh seed per request; greedy needs none.
    seeds = {body.to_requests("hi", 16, "pp")[0].sampling.seed for _ in range(8)}
    assert len(seeds) > 1
    greedy = CompletionRequest.model_validate({"prompt": "hi", "temperature": 0})
    assert greedy.to_requests("hi", 16, "pp")[0].sampling.seed == 0


@pytest.mark.parametrize(
    "prompt, value",
    [("a", "a"), (["a"], "a"), ([4, 5], [4, 5]), ([[4, 5]], [4, 5]), ([], [])],
)
def test_completion_prompt_shapes(prompt, value) -> None:
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt_value() == value


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"n": 17}, "n must be in [1, 16]"),
        ({"n": 0}, "n must be in [1, 16]"),
        ({"best_of": 2}, "best_of must equal n (1)"),
        ({"n": 3, "best_of": 4}, "best_of must equal n (3)"),
        ({"suffix": "}"}, "suffix is not supported"),
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


@pytest.mark.parametrize(
    "fields, param, fragment",
    [
        ({"repetition_penalty": 0}, "repetition_penalty", "must be in (0, 2.0]"),
        ({"repetition_penalty": 2.5}, "repetition_penalty", "must be in (0, 2.0]"),
        ({"frequency_penalty": 2.1}, "frequency_penalty", "must be in [-2.0, 2.0]"),
        ({"presence_penalty": -3}, "presence_penalty", "must be in [-2.0, 2.0]"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "token ids (>= 0)"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
        ({"min_tokens": -1}, "min_tokens", "must be >= 0"),
        ({"min_tokens": 17}, "min_tokens", "at most max_tokens (16)"),
        ({"min_tokens": 9, "max_completion_tokens": 8}, "min_tokens", "max_completion_tokens"),
    ],
)
def test_logits_rules_out_of_range_are_refused_naming_the_field(fields, param, fragment) -> None:
    body = CompletionRequest.model_validate({"prompt": "hi", **fields})
    with pytest.raises(ApiError) as info:
        body.check()
        body.to_requests("hi", DEFAULT_COMPLETION_TOKENS, "specpipe")[0]
    e = info.value
    assert e.status == 400 and e.param == param and fragment in e.message, e.message
    assert param in e.message


def test_logits_rules_reach_the_request() -> None:
    body = CompletionRequest.model_validate(
        {"prompt": "hi", "frequency_penalty": 0.5, "presence_penalty": -0.25,
         "repetition_penalty": 1.1, "logit_bias": {"7": 150, "9": -2}, "min_tokens": 4}
    )  # fmt: skip
    body.check()
    req = body.to_requests("hi", 16, "specpipe")[0]
    s = req.sampling
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (0.5, -0.25, 1.1)
    assert dict(s.logit_bias) == {7: 150.0, 9: -2.0} and req.min_tokens == 4


def test_defaults_of_unsupported_fields_pass() -> None:
    fields = {"logprobs": None, "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1,
              "logit_bias": {}, "tools": [], "tool_choice": "none", "echo": False,
              "response_format": {"type": "text"}, "best_of": 1}  # fmt: skip
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
    """A scripted RouterEngine.generate: one token per text; StopGeneration honoured."""

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
            log.append("released")  # what RouterEngine.generate's `finally` does

    log: list[str] = []
    return gen_events(), log


def collect(texts, stops=(), min_tokens=0, **kw):
    responses, log = events(texts, **kw)
    run = TextRun(responses, stops, min_tokens)
    text = asyncio.run(run.text())
    return run, text, log


def test_generation_collects_text_usage_and_stats() -> None:
    run, text, log = collect(["a", "", "bc"], tail="!")
    assert text == "abc!" and run.finish_reason == "length" and run.request_id == "r-1"
    assert run.usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                         "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
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


def test_a_stop_string_waits_for_min_tokens() -> None:
    """vLLM's rule: a stop string is honoured once min_tokens tokens are out; one that
    ends in the text of an earlier token does not end the output (nor count later)."""
    texts = ["he", "llo ST", "OP and", " STOP x", " more"]
    run, text, _ = collect(texts, stops=["STOP"], min_tokens=4)
    assert text == "hello STOP and " and run.finish_reason == "stop"
    assert run.usage["completion_tokens"] == 4
    # One that begins before and ends with the min_tokens-th token counts.
    run, text, _ = collect(texts, stops=["STOP"], min_tokens=3)
    assert text == "hello " and run.usage["completion_tokens"] == 3
    # None after min_tokens: the whole output.
    run, text, _ = collect(texts, stops=["STOP"], min_tokens=5)
    assert text == "hello STOP and STOP x more" and run.finish_reason == "length"
    # A shorter stop string inside a held-back prefix of a longer one is early too.
    run, text, _ = collect(["x", "ab", "y", "z", "ab"], stops=["ab", "xaby!"], min_tokens=3)
    assert text == "xabyz" and run.usage["completion_tokens"] == 5


def test_the_engine_starts_a_delta_where_the_output_reaches_min_tokens() -> None:
    from specpipe.services.router.engine import split_at_min_tokens

    assert split_at_min_tokens([1, 2, 3, 4], 0, 3) == [[1, 2], [3, 4]]  # positions 2.. honour
    assert split_at_min_tokens([1, 2, 3, 4], 2, 3) == [[1, 2, 3, 4]]
    assert split_at_min_tokens([1, 2], 0, 0) == [[1, 2]]
    assert split_at_min_tokens([1, 2], 0, 9) == [[1, 2]]


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
def with_app(script, fn, keys=("k",), codec=None, metrics=None, **settings):
    """fn(client, engine) -> result, against the HTTP API of a RouterEngine whose
    generate() is `script(request)` (an async generator), served on a free port (with
    `codec` as its tokenizer, `metrics` as its registry, RouterConfig's `settings`)."""
    from specpipe.services.router.backends import ModelInfo
    from specpipe.services.router.http_api import HttpServer

    from ..router_config import router_engine

    async def main():
        router = router_engine(["127.0.0.1:9"], api_keys=ApiKeys(keys), metrics=metrics,
                               **settings)  # fmt: skip
        router.model = ModelInfo("m", "h", num_layers=4, vocab_size=97, max_positions=256,
                                 eos_token_ids=(96,), ranges=[(0, 4)])  # fmt: skip
        router.backends._ready = True
        router.generate = lambda req, deadline=None, caller=None, model=None: script(req)
        router.codec = codec
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


# -- logprobs, echo and n: bodies to requests -------------------------------------------------
def test_logprobs_echo_and_n_to_requests() -> None:
    body = CompletionRequest.model_validate(
        {"prompt": "hi", "n": 3, "seed": 5, "temperature": 0.7, "logprobs": 2, "echo": True}
    )
    body.check()
    reqs = body.to_requests("hi", 16, "pp")
    assert [r.sampling.seed for r in reqs] == [5, 6, 7]  # choice i: seed + i
    assert all(r.logprobs == 2 and r.text == "hi" for r in reqs)
    # The prompt's logprobs: asked of the first choice only (the prompt is the same).
    assert [r.HasField("prompt_logprobs") for r in reqs] == [True, False, False]
    assert reqs[0].prompt_logprobs == 2
    plain = CompletionRequest.model_validate({"prompt": "hi", "logprobs": 0})
    (req,) = plain.to_requests("hi", 16, "pp")
    assert req.logprobs == 0 and not req.HasField("prompt_logprobs")
    assert (
        not CompletionRequest.model_validate({"prompt": "hi"})
        .to_requests("hi", 16, "pp")[0]
        .HasField("logprobs")
    )
    # Without a seed, sampled choices draw independently; greedy ones are the same.
    free = CompletionRequest.model_validate({"prompt": "hi", "n": 4})
    assert len({r.sampling.seed for r in free.to_requests("hi", 16, "pp")}) > 1
    greedy = CompletionRequest.model_validate({"prompt": "hi", "n": 4, "temperature": 0})
    assert {r.sampling.seed for r in greedy.to_requests("hi", 16, "pp")} == {0}
    big = CompletionRequest.model_validate({"prompt": "hi", "n": 2, "seed": (1 << 63) - 1})
    with pytest.raises(ApiError, match="seed \\+ n - 1"):
        big.to_requests("hi", 16, "pp")


def test_chat_logprobs_to_requests() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    body = ChatCompletionRequest.model_validate(
        {"messages": msgs, "logprobs": True, "top_logprobs": 20}
    )
    body.check()
    req = body.to_requests([1, 2], 8, "pp")[0]
    assert req.logprobs == 20 and not req.HasField("prompt_logprobs")
    assert (
        ChatCompletionRequest.model_validate({"messages": msgs, "logprobs": True})
        .to_requests([1], 8, "pp")[0]
        .logprobs
        == 0
    )
    off = ChatCompletionRequest.model_validate({"messages": msgs, "logprobs": False})
    assert not off.to_requests([1], 8, "pp")[0].HasField("logprobs")
    with pytest.raises(ApiError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest.model_validate({"messages": msgs, "top_logprobs": 2}).check()
    for bad in ({"top_logprobs": 21, "logprobs": True}, {"top_logprobs": -1, "logprobs": True}):
        with pytest.raises(ValueError, match="top_logprobs"):
            ChatCompletionRequest.model_validate({"messages": msgs, **bad})
    with pytest.raises(ValueError, match="logprobs"):
        CompletionRequest.model_validate({"prompt": "hi", "logprobs": 21})


# -- logprobs, echo and n: responses, in front of a scripted router ---------------------------
PROMPT_IDS = [7, 8, 9]


def logprobs_script(texts: list[str], seen: list):
    """A scripted generate(): token i + 1 per text, with logprob -(i + 1) / 10 and, as
    alternatives, ids 50, 51, ... at -1, -2, ... when asked; the prompt's logprobs (-2,
    -3) in the first delta when asked. `seen` records (seed, event) in order."""

    async def script(req):
        seed = req.sampling.seed
        seen.append((seed, "start"))
        yield gen.GenerateResponse(
            started=gen.Started(request_id=f"r{seed}", prompt_tokens=len(PROMPT_IDS))
        )
        for i, t in enumerate(texts):
            d = gen.TokenDelta(token_ids=[i + 1], text=t, index=i)
            if req.HasField("logprobs"):
                k = req.logprobs
                d.logprobs.append(pb.TokenLogprobs(logprob=-(i + 1) / 10, top_ids=range(50, 50 + k),
                                                   top_logprobs=[-j - 1.0 for j in range(k)]))  # fmt: skip
            if i == 0 and req.HasField("prompt_logprobs"):
                d.prompt_token_ids.extend(PROMPT_IDS)
                for lp in (-2.0, -3.0):
                    d.prompt_logprobs.append(pb.TokenLogprobs(logprob=lp, top_ids=[60],
                                                              top_logprobs=[-0.5]))  # fmt: skip
            seen.append((seed, "token"))
            yield gen.GenerateResponse(delta=d)
        yield gen.GenerateResponse(
            finished=gen.Finished(
                finish_reason="length",
                usage=gen.Usage(prompt_tokens=len(PROMPT_IDS), completion_tokens=len(texts)),
                stats=gen.SpeculationStats(mode="pp", new_tokens=len(texts)),
            )
        )

    return script


def test_completion_logprobs_and_echo_in_openais_shape() -> None:
    seen: list = []

    async def fn(client, router):
        kw = dict(model="m", prompt="abc", temperature=0, logprobs=1)
        whole = await client.completions.create(echo=True, **kw)
        chunks = [c async for c in await client.completions.create(stream=True, echo=True, **kw)]
        plain = await client.completions.create(**kw)
        return whole, chunks, plain

    whole, chunks, plain = with_app(logprobs_script(["x", "", "yz"], seen), fn)
    (choice,) = whole.choices
    assert choice.text == "abcxyz"  # the prompt echoed, then the completion
    lp = choice.logprobs
    names = [f"token_id:{t}" for t in (*PROMPT_IDS, 1, 2, 3)]  # no tokenizer: ids
    assert lp.tokens == names
    assert lp.token_logprobs == [None, -2.0, -3.0, -0.1, -0.2, -0.3]  # the first prompt token: null
    assert lp.top_logprobs[0] is None
    assert lp.top_logprobs[1] == {"token_id:8": -2.0, "token_id:60": -0.5}
    assert lp.top_logprobs[3] == {"token_id:1": -0.1, "token_id:50": -1.0}  # token, then top 1
    assert lp.text_offset == [sum(len(n) for n in names[:i]) for i in range(len(names))]
    # Streamed: the echo first (with the prompt's logprobs), then each piece with the
    # logprobs of the tokens since the previous one (the empty-text token rides along).
    got = [(c.choices[0].text, c.choices[0].logprobs) for c in chunks if c.choices]
    assert [t for t, _ in got] == ["abc", "x", "yz", ""]
    streamed = [x for _, lp in got if lp for x in lp.token_logprobs]
    assert streamed == lp.token_logprobs
    offsets = [x for _, lp in got if lp for x in lp.text_offset]
    assert offsets == lp.text_offset
    assert plain.choices[0].text == "xyz" and plain.choices[0].logprobs.tokens == names[3:]
    assert plain.choices[0].logprobs.text_offset[0] == 0
    assert [s for s, e in seen if e == "start"] == [0, 0, 0]


def test_chat_logprobs_in_openais_shape() -> None:
    async def fn(client, router):
        kw = dict(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0,
                  logprobs=True, top_logprobs=2)  # fmt: skip
        whole = await client.chat.completions.create(**kw)
        chunks = [c async for c in await client.chat.completions.create(stream=True, **kw)]
        none = await client.chat.completions.create(
            **{**kw, "logprobs": False, "top_logprobs": None}
        )
        return whole, chunks, none

    async def run(client, router):
        router.codec = FakeCodec()
        return await fn(client, router)

    whole, chunks, none = with_app(logprobs_script(["é", "b"], []), run)
    content = whole.choices[0].logprobs.content
    assert [c.token for c in content] == ["token_id:1", "token_id:2"]
    assert content[0].logprob == -0.1 and content[0].bytes == list(b"token_id:1")
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [
        ("token_id:50", -1.0),
        ("token_id:51", -2.0),
    ]
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.content]  # fmt: skip
    assert streamed == content
    assert none.choices[0].logprobs is None


class FakeCodec:
    """A router's codec whose tokenizer names no token (`TokenNames` falls back to ids)."""

    class tokenizer:
        @staticmethod
        def convert_ids_to_tokens(i):
            return None

    def encode_chat(self, messages, tools=None, add_generation_prompt=True):
        return list(PROMPT_IDS)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_seeded_and_started_after_the_first_ones_prefill(stream) -> None:
    seen: list = []

    async def fn(client, router):
        kw = dict(model="m", prompt="abc", n=3, seed=11, temperature=0.5, logprobs=0)
        if not stream:
            return await client.completions.create(**kw)
        return [c async for c in await client.completions.create(stream=True, **kw)]

    got = with_app(logprobs_script(["x", "y"], seen), fn)
    # The second and third choice start once the first has its first token (its prefill
    # done: they find the prompt in the prefix cache); choice i draws with seed + i.
    assert seen[:2] == [(11, "start"), (11, "token")]
    assert sorted(s for s, e in seen if e == "start") == [11, 12, 13]
    if stream:
        by_index: dict[int, str] = {}
        for c in got:
            for ch in c.choices:
                by_index[ch.index] = by_index.get(ch.index, "") + ch.text
        assert by_index == {0: "xy", 1: "xy", 2: "xy"}
        finishing = [c for c in got if c.choices and c.choices[0].finish_reason]
        assert sorted(c.choices[0].index for c in finishing) == [0, 1, 2]
        usage = finishing[-1].usage  # the last finishing chunk carries it
    else:
        assert [c.index for c in got.choices] == [0, 1, 2]
        assert all(c.text == "xy" and c.logprobs.token_logprobs == [-0.1, -0.2]
                   for c in got.choices)  # fmt: skip
        assert len(got.model_extra["speculation"]) == 3
        usage = got.usage
    # The prompt once, every choice's tokens.
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 6, 9)


# -- vLLM's metric names -----------------------------------------------------------------------
def test_vllms_waiting_requests_count_the_queue_too() -> None:
    """`vllm:num_requests_waiting` is every request not running yet (vLLM's meaning): the
    ones queued for a running slot and the ones opening their path; `specpipe:`'s too
    (the chart autoscales on it). vLLM's carries the served model's name as its label."""
    from types import SimpleNamespace as NS

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from specpipe.services.metrics import RouterMetrics

    router = NS(
        transport=None,
        drivers={"a": NS(waiting=True), "b": NS(waiting=False), "c": NS(waiting=False)},
        backends=NS(by_key={}, versions={}, model=None),
        model=NS(model_id="tiny"),
        scheduler=NS(waiting=["q1", "q2"]),
    )
    metrics = RouterMetrics()
    metrics.watch(router)
    text = generate_latest(metrics.registry).decode()
    samples = {(s.name, s.labels.get("model_name")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
    assert samples[("vllm:num_requests_waiting", "tiny")] == 3
    assert samples[("vllm:num_requests_running", "tiny")] == 2
    assert samples[("specpipe:num_requests_waiting", None)] == 3
    assert samples[("specpipe:num_requests_running", None)] == 2


def test_prompt_logprobs_are_bounded_by_what_one_answer_carries() -> None:
    """F4: `echo` with `logprobs: 20` on an 8,000-character prompt turned an 8 KB
    request into a 5.16 MB response. A request's prompt logprobs are at most 2^15
    entries (prompt tokens x (alternatives + 1), about 1 MB of JSON), refused before the
    request starts."""
    from specpipe.services.router.requests import InvalidRequest, check_prompt_logprobs

    check_prompt_logprobs(1560, 20)
    check_prompt_logprobs(16384, 1)
    check_prompt_logprobs(32768, 0)
    with pytest.raises(InvalidRequest, match="at most 1560 tokens with 20"):
        check_prompt_logprobs(1561, 20)
    with pytest.raises(InvalidRequest, match="16384 tokens with 1"):
        check_prompt_logprobs(16385, 1)
    with pytest.raises(InvalidRequest, match="with 20"):
        check_prompt_logprobs(8000, 20)  # F4's request
