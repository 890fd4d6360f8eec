"""No request is lost when a router dies (issue 35, point 6): real router processes over
the same stages and draft; one is SIGKILLed mid-stream, and the SDK (sync and asyncio)
resumes the request on the other from the tokens it has, so the caller sees one exact
stream (greedy and seeded sampling, as the in-process reference). The HTTP API's resume
field (`resume_token_ids`) continues a completion exactly through the official `openai`
client, streamed and not.

Every forward is paced (a flat emulated cost), so a request of a few hundred tokens
takes seconds and the kill lands mid-stream on any machine."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from specpipe.common.text import TextCodec
from specpipe.services.launcher import free_port

from specpipe.client import AsyncClient, Client, InvalidArgument, ResumePolicy, Unavailable

from .conftest import EOS, reference, start

PROMPT = [5, 17, 33, 8, 21, 40, 2, 11]
TEXT = "Resume this:"
NEW = 96
STAGE_SECONDS = 0.008  # each stage forward (the tokens do not depend on it)
SAMPLINGS = [
    pytest.param({}, id="greedy"),
    pytest.param({"temperature": 0.9, "seed": 11, "top_p": 0.95}, id="seeded"),
]


@pytest.fixture(scope="module")
def dep(text_model_dir: Path, tmp_path_factory) -> Iterator:
    """2 stages and the target as its own draft, paced, the HTTP API on."""
    costs = tmp_path_factory.mktemp("costs") / "flat.json"
    costs.write_text(json.dumps({"flat": {"stage": STAGE_SECONDS}}))
    d = start(text_model_dir, "oracle", 2, "tcp", http_port=0, emulate_costs=costs)
    try:
        yield d
    finally:
        d.stop()


def _expected(dep, prompt, n=NEW, **sampling) -> list[int]:
    s = {"temperature": 0.0, "seed": 0, "top_p": 1.0, **sampling}
    return reference(dep.target, "oracle", 2, prompt, "specpipe", n, s["temperature"],
                     s["seed"], s["top_p"], stop_token_ids=(EOS,))  # fmt: skip


KILLED = 6  # the tests that kill a router, one each


@pytest.fixture(scope="module")
def spare(dep) -> list[str]:
    """Router replicas for the tests to kill (started together: a router takes seconds
    to start on a busy machine)."""
    return [c.name for c in dep.add_routers(KILLED)]


def _routers(dep, spare) -> tuple[str, str]:
    """A router the test kills and the deployment's own, which stays: their names."""
    return spare.pop(), "router"


def _kill_when_active(dep, name: str, after: float) -> threading.Thread:
    """Kill router `name` once it holds a request, `after` seconds later (a background
    thread: the caller is blocked in a non-streamed call)."""

    def run() -> None:
        with Client(dep.children[name].info["grpc"], timeout=5) as c:
            while c.describe().active_requests == 0:
                time.sleep(0.01)
        time.sleep(after)
        dep.kill(name)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_the_sdk_resumes_a_stream_on_another_router_exactly(dep, spare, sampling) -> None:
    want = _expected(dep, PROMPT, **sampling)
    first, second = _routers(dep, spare)
    addresses = [dep.children[n].info["grpc"] for n in (first, second)]
    with Client(addresses, timeout=60) as c:
        stream = c.stream(prompt_ids=PROMPT, max_new_tokens=NEW, **sampling)
        got, indices = [], []
        for chunk in stream:
            assert chunk.index == len(got)  # one uninterrupted stream
            indices.append(chunk.index)
            got += chunk.token_ids
            if len(got) >= 5 and stream.resumes == 0 and dep.children[first].proc.poll() is None:
                dep.kill(first)
        done = stream.result()
    assert got == done.token_ids == want
    assert done.resumes == 1 and done.completion_tokens == len(want)
    assert 0 < done.stats["new_tokens"] < len(want)  # the second router drew the rest


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_the_async_sdk_resumes_a_whole_completion_exactly(dep, spare, sampling) -> None:
    """Not streamed: `generate` returns the exact completion though its router died."""
    want = _expected(dep, PROMPT, **sampling)
    first, second = _routers(dep, spare)
    addresses = [dep.children[n].info["grpc"] for n in (first, second)]

    async def main():
        async with AsyncClient(addresses, timeout=60) as c:
            return await c.generate(prompt_ids=PROMPT, max_new_tokens=NEW, **sampling)

    killer = _kill_when_active(dep, first, 0.3)
    done = asyncio.run(main())
    killer.join(10)
    assert done.token_ids == want and done.resumes == 1


def test_text_continues_exactly_after_a_resume(dep, spare) -> None:
    """The resumed router's detokenizer is primed with the tokens the client has."""
    codec = TextCodec.from_dir(dep.target)
    want = _expected(dep, codec.encode(TEXT))
    first, second = _routers(dep, spare)
    addresses = [dep.children[n].info["grpc"] for n in (first, second)]
    with Client(addresses, timeout=60) as c:
        stream = c.stream(TEXT, max_new_tokens=NEW)
        text = []
        for chunk in stream:
            text.append(chunk.text)
            if chunk.index >= 3 and dep.children[first].proc.poll() is None:
                dep.kill(first)
        done = stream.result()
    assert done.token_ids == want and done.resumes == 1
    assert "".join(text) == done.text == codec.decode(want)


def test_the_sdk_resumes_on_the_same_address_once_its_router_restarted(dep, spare) -> None:
    """One address: the router there is killed and started again (as a pod's container
    restarts); the SDK retries with backoff until it answers, and resumes there."""
    want = _expected(dep, PROMPT)
    name = spare.pop()
    policy = ResumePolicy(attempts=60, backoff=0.1, max_backoff=0.5)
    with Client(dep.children[name].info["grpc"], timeout=90, resume=policy) as c:
        stream = c.stream(prompt_ids=PROMPT, max_new_tokens=NEW)
        got: list[int] = []
        restarted = False
        for chunk in stream:
            got += chunk.token_ids
            if len(got) >= 5 and not restarted:
                dep.restart(name)
                restarted = True
        done = stream.result()
    assert got == done.token_ids == want and done.resumes >= 1
    dep.kill(name)


def test_a_request_fails_clearly_when_no_router_answers(dep) -> None:
    """Every address dead: a bounded number of attempts, then one clear error."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    policy = ResumePolicy(attempts=3, backoff=0.01)
    with (
        Client(addresses, timeout=30, resume=policy) as c,
        pytest.raises(Unavailable, match="could not be resumed") as info,
    ):
        c.generate(prompt_ids=PROMPT, max_new_tokens=8)
    message = info.value.message
    assert "every attempt failed; 3 resumes tried" in message
    assert all(a in message for a in addresses)


def _openai(dep) -> OpenAI:
    return OpenAI(base_url=f"http://{dep.http_address}/v1", api_key="-", max_retries=0,
                  timeout=60)  # fmt: skip


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_http_resume_continues_a_completion_exactly(dep, sampling) -> None:
    """`resume_token_ids` (extra_body) with the first tokens of a completion: the
    answer is the rest of the same completion, whole and streamed; `return_token_ids`
    gives the token ids a resume needs, in every streamed chunk too."""
    codec = TextCodec.from_dir(dep.target)
    n = 24
    want = _expected(dep, codec.encode(TEXT), n, **sampling)
    c = _openai(dep)
    opts = dict(model="", prompt=TEXT, max_tokens=n, temperature=sampling.get("temperature", 0),
                seed=sampling.get("seed", 0), top_p=sampling.get("top_p", 1.0))  # fmt: skip
    full = c.completions.create(**opts, extra_body={"return_token_ids": True})
    assert full.choices[0].model_extra["token_ids"] == want
    for at in (1, 9):
        extra = {"return_token_ids": True, "resume_token_ids": want[:at]}
        rest = c.completions.create(**opts, extra_body=extra)
        assert rest.choices[0].model_extra["token_ids"] == want[at:]
        assert rest.model_extra["speculation"]["resumed_tokens"] == at
        assert full.choices[0].text == codec.decode(want[:at]) + rest.choices[0].text
        assert rest.usage.completion_tokens == len(want)
        chunks = list(c.completions.create(**opts, stream=True, extra_body=extra))
        ids = [t for ch in chunks for t in (ch.choices[0].model_extra or {}).get("token_ids", [])]
        assert ids == want[at:]
        assert codec.decode(want[:at]) + "".join(ch.choices[0].text for ch in chunks) == (
            full.choices[0].text
        )


def test_http_refuses_resume_tokens_the_request_cannot_have(dep) -> None:
    import openai

    c = _openai(dep)
    opts = dict(model="", prompt=TEXT, max_tokens=4)
    for extra, match in [
        ({"resume_token_ids": [1, 2, 3, 4, 5]}, "more than max_new_tokens"),
        ({"resume_token_ids": [1000]}, "outside the vocabulary"),
        ({"resume_token_ids": [EOS, 3]}, "stop token"),
        ({"resume_token_ids": [1], "n": 2}, "one list of token ids per choice"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match):
            c.completions.create(**opts, extra_body=extra)


def test_a_resume_continues_structured_output_and_logprobs(dep) -> None:
    """With a response_format the grammar consumes the resumed tokens first (the rest is
    the same schema-valid output); the logprobs are the new tokens' own."""
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a", "b"]}}}  # fmt: skip
    with Client(dep.router_address, timeout=60) as c:
        kw = dict(prompt_ids=PROMPT, max_new_tokens=48, response_format=fmt, logprobs=2)
        full = c.generate(**kw)
        assert full.text.startswith("{")  # the grammar's (a random model rambles on)
        for at in (1, 6):
            rest = c.generate(**kw, resume_token_ids=full.token_ids[:at])
            assert rest.token_ids == full.token_ids[at:]
            assert rest.logprobs == full.logprobs[at:]
        with pytest.raises(InvalidArgument, match="do not follow the request's response_format"):
            c.generate(**kw, resume_token_ids=[full.token_ids[0] + 1])
