"""Function calling through the real services (router, two stages, the draft: separate
processes) and the official `openai` client: a named function and "required" give
calls of the tools whose arguments follow their schemas (the grammar engine), streamed
as not; "auto" renders the tools through a chat template in Qwen's format (a random
model writes no call: its text comes back as text); conversations with calls and tool
results are accepted; usage reports the prompt tokens found in the prefix cache, and
/metrics on the HTTP port the router's vllm: series."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from openai import OpenAI

from .conftest import TOOL_CHAT_TEMPLATE, add_char_tokenizer, start

KEY = "sk-tools"
# Bounded, so that a random model's arguments complete within max_tokens.
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 5},
                   "days": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}  # fmt: skip
TIME_ARGS = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
             "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_ARGS}},
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def dep(text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The tiny model with a Qwen-style tool template; 2 stages, the target as its own
    draft, the HTTP API with a key, metrics."""
    d = tmp_path_factory.mktemp("llama_tools")
    for f in text_model_dir.iterdir():
        shutil.copy(f, d / f.name)
    add_char_tokenizer(d, TOOL_CHAT_TEMPLATE)
    deployment = start(d, "oracle", 2, "tcp", http_port=0, api_keys=[KEY], metrics=True)
    try:
        yield deployment
    finally:
        deployment.stop()


def client(dep) -> OpenAI:
    return OpenAI(base_url=f"http://{dep.http_address}/v1", api_key=KEY, max_retries=0,
                  timeout=120)  # fmt: skip


def streamed_calls(chunks) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a streamed chat answer."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                entry = calls.setdefault(t.index, ["", ""])
                entry[0] += (t.function.name or "") if t.id else ""
                entry[1] += t.function.arguments or ""
            reason = ch.finish_reason or reason
    return content, [tuple(v) for v in calls.values()], reason


@pytest.mark.parametrize("mode", ["specpipe", "pp"])
def test_named_and_required_calls_follow_the_tools_schemas(dep, mode) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    with client(dep) as c:
        for choice, parallel in ((named, True), ("required", False), ("required", True)):
            kw = dict(model=dep.target.name, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                      parallel_tool_calls=parallel, max_tokens=120, temperature=0,
                      extra_body={"mode": mode})  # fmt: skip
            full = c.chat.completions.create(**kw)
            (answer,) = full.choices
            if answer.finish_reason == "length":  # "required" with parallel calls may run on
                assert choice == "required" and parallel
                continue
            assert answer.finish_reason == "tool_calls" and answer.message.content is None
            calls = answer.message.tool_calls
            assert calls and (len(calls) == 1 or parallel)
            for call in calls:
                assert call.type == "function" and call.id.startswith("call_")
                jsonschema.validate(
                    json.loads(call.function.arguments), SCHEMAS[call.function.name]
                )
            if choice is named:
                assert [x.function.name for x in calls] == ["get_weather"]
            content, got, reason = streamed_calls(c.chat.completions.create(stream=True, **kw))
            assert content == "" and reason == "tool_calls"
            assert got == [(x.function.name, x.function.arguments) for x in calls]


def test_auto_renders_the_tools_and_gives_text_back_as_text(dep) -> None:
    with client(dep) as c:
        kw = dict(model=dep.target.name, messages=MESSAGES, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
        plain = c.chat.completions.create(**kw)
        auto = c.chat.completions.create(tools=TOOLS, **kw)
        none = c.chat.completions.create(tools=TOOLS, tool_choice="none", **kw)
    # The template shows the tools: the prompt is longer by their rendering.
    rendered = "[tools]get_weather;get_time;<tool_call>|"
    assert auto.usage.prompt_tokens == plain.usage.prompt_tokens + len(rendered)
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens
    for answer in (auto, none):
        (choice,) = answer.choices
        assert choice.finish_reason == "length" and choice.message.tool_calls is None
        assert choice.message.content is not None


def test_a_conversation_with_calls_and_results_is_accepted(dep) -> None:
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    with client(dep) as c:
        answer = c.chat.completions.create(model=dep.target.name, messages=messages, tools=TOOLS,
                                           max_tokens=4, temperature=0)  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="tool call must be"):
            c.chat.completions.create(
                model=dep.target.name, max_tokens=4,
                messages=[{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}],
            )  # fmt: skip
    status, tokens = post(dep, "/tokenize", {"messages": messages, "tools": TOOLS})
    assert status == 200 and answer.usage.prompt_tokens == tokens["count"]
    status, text = post(dep, "/detokenize", {"tokens": tokens["tokens"]})
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"' in text["prompt"]
    assert "[tool]sunny, 21 C|" in text["prompt"]


def test_cached_prompt_tokens_in_usage_and_metrics(dep) -> None:
    long = [{"role": "user", "content": "Tell me about pipelines and trees. " * 4}]
    with client(dep) as c:
        kw = dict(model=dep.target.name, messages=long, max_tokens=2, temperature=0)
        first = c.chat.completions.create(**kw)
        again = c.chat.completions.create(**kw)
        chunks = list(
            c.chat.completions.create(
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
                **kw,
            )
        )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    # Streamed with continuous_usage_stats: usage on every chunk, the last with the
    # cached tokens (known when the request ends).
    assert all(ch.usage is not None for ch in chunks)
    assert [ch.usage.completion_tokens for ch in chunks][-1] == 2
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    # Whole 16-token blocks of the prompt (the last token is always computed).
    assert cached > 0 and cached % 16 == 0 and cached < again.usage.prompt_tokens
    status, text = get(dep, "/metrics")
    assert status == 200
    hits = metric(text, "vllm:prefix_cache_hits_total")
    assert hits >= cached and metric(text, "vllm:prefix_cache_queries_total") > hits
    assert metric(text, "vllm:generation_tokens_total") > 0
    assert get(dep, "/metrics", key=None)[0] == 401  # behind the key by default


def metric(text: str, name: str) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith(name + "{") or x.startswith(name + " ")]
    return float(line.rsplit(" ", 1)[1])


def post(dep, path: str, body: dict):
    req = urllib.request.Request(f"http://{dep.http_address}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  "Authorization": f"Bearer {KEY}"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, json.loads(r.read())


def get(dep, path: str, key: str | None = KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(f"http://{dep.http_address}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
