"""vLLM's endpoints beside the API on the HTTP port, without a deployment: /version,
/tokenize, /detokenize and /metrics in vLLM's shapes, behind the API key (/metrics as
--http-metrics says), bad values refused with 400."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from specpipe.services.metrics import RouterMetrics

from .test_http_api import with_app
from .test_tool_calls import WEATHER, scripted


def call(client, path: str, body: dict | None = None, key: str | None = "k"):
    """(status, body: JSON or text) of a plain request to the app."""
    url = str(client.base_url).removesuffix("v1/") + path.lstrip("/")
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def in_thread(fn):
    """`fn(client)` run off the app's loop (urllib blocks)."""

    async def run(client, router):
        import asyncio

        return await asyncio.to_thread(fn, client)

    return run


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    from specpipe.common.text import TextCodec

    from tests.integration.conftest import TOOL_CHAT_TEMPLATE, add_char_tokenizer

    return TextCodec.from_dir(
        add_char_tokenizer(tmp_path_factory.mktemp("tok"), TOOL_CHAT_TEMPLATE)
    )


def test_tokenize_detokenize_and_version_in_vllms_shapes(codec) -> None:
    def fn(client):
        return {
            "prompt": call(client, "/tokenize", {"model": "m", "prompt": "Hi!"}),
            "strs": call(
                client,
                "/tokenize",
                {"prompt": "ab", "add_special_tokens": False, "return_token_strs": True},
            ),
            "chat": call(
                client,
                "/tokenize",
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": "x"}],
                    "add_generation_prompt": False,
                },
            ),
            "tools": call(
                client,
                "/tokenize",
                {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]},
            ),
            "detok": call(client, "/detokenize", {"model": "m", "tokens": [41, 74, 2]}),
            "version": call(client, "/version"),
            "no key": call(client, "/tokenize", {"prompt": "x"}, key=None),
            "both": call(client, "/tokenize", {"prompt": "x", "messages": []}),
            "neither": call(client, "/tokenize", {"model": "m"}),
            "vocab": call(client, "/detokenize", {"tokens": [5, 97]}),
            "model": call(client, "/detokenize", {"model": "gpt", "tokens": [5]}),
            "shape": call(client, "/detokenize", {"tokens": "abc"}),
        }

    got = with_app(scripted([]), in_thread(fn), codec=codec)
    assert got["prompt"] == (200, {"count": 3, "max_model_len": 256,
                                   "tokens": [41, 74, 2], "token_strs": None})  # fmt: skip
    assert got["strs"][1]["tokens"] == [66, 67] and got["strs"][1]["token_strs"] == ["a", "b"]
    chat = got["chat"][1]
    assert chat["tokens"] == codec.encode_chat([{"role": "user", "content": "x"}],
                                               add_generation_prompt=False)  # fmt: skip
    assert chat["count"] == len(chat["tokens"]) and codec.decode(chat["tokens"]) == "[user]x|"
    assert "get_weather;" in codec.decode(got["tools"][1]["tokens"])
    assert got["detok"] == (200, {"prompt": "Hi!"})
    assert got["version"][0] == 200 and got["version"][1]["version"]
    assert got["no key"][0] == 401
    for name in ("both", "neither", "vocab", "shape"):
        assert got[name][0] == 400 and got[name][1]["error"]["message"], name
    assert "outside the vocabulary" in got["vocab"][1]["error"]["message"]
    assert got["model"][0] == 404


@pytest.mark.parametrize("access", ["key", "open", "off"])
def test_metrics_on_the_http_port_as_the_operator_chooses(access) -> None:
    metrics = RouterMetrics()
    metrics.prompt_tokens.inc(7)

    def fn(client):
        return call(client, "/metrics"), call(client, "/metrics", key=None)

    (with_key, without) = with_app(
        scripted([]), in_thread(fn), metrics=metrics, http_metrics=access
    )
    if access == "off":
        assert with_key[0] == without[0] == 404
        return
    assert with_key[0] == 200 and "vllm:prompt_tokens_total" in with_key[1]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):  # fmt: skip
        assert name in with_key[1], name
    assert (
        "vllm:prompt_tokens_total" in with_key[1]
        and "specpipe:prompt_tokens_total 7.0" in with_key[1]
    )
    assert without[0] == (200 if access == "open" else 401)


def test_request_success_is_served_at_zero_before_any_request() -> None:
    """A scraper that reports the change over a run (aiperf's server metrics) must see the
    series at 0 before the first request finishes, as vLLM serves it."""
    from prometheus_client import generate_latest
    from specpipe.services.metrics import VllmNames

    metrics = RouterMetrics()
    text = generate_latest(metrics.registry).decode()
    for reason in ("stop", "length"):
        assert f'specpipe:request_success_total{{finished_reason="{reason}"}} 0.0' in text
    (family,) = [f for f in VllmNames(metrics).collect() if f.name == "vllm:request_success"]
    assert {
        (s.labels["finished_reason"], s.value) for s in family.samples if s.name.endswith("_total")
    } == {
        ("stop", 0.0),
        ("length", 0.0),
    }
