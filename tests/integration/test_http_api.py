"""The router's OpenAI-compatible HTTP API, through the official `openai` client, on a
local multi-process deployment with API keys: chat and text completions, streamed and
not, the same tokens as the gRPC API, usage and speculation stats, stop strings, every
error status, and cancellation when the client goes away."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from specpipe.client import Client, Unauthenticated

from .conftest import service_stub, start, wait_idle

KEY = "sk-specpipe-test"
OTHER_KEY = "sk-second"
ENTRY = "import sys; from specpipe.cli import main; sys.exit(main(sys.argv[1:]))"
SPECULATION = {
    "mode", "stages", "width", "prefill_steps", "decode_steps", "new_tokens",
    "tokens_per_step", "hit_rate", "verifications", "time_to_first_token_ms",
    "mean_time_between_tokens_ms", "regrowths", "steady_tokens_per_step",
}  # fmt: skip


@pytest.fixture(scope="module")
def dep(text_model_dir: Path) -> Iterator:
    """2 stages, the target as its own draft, the HTTP API on, two API keys, metrics."""
    d = start(text_model_dir, "oracle", 2, "tcp", http_port=0, api_keys=[KEY, OTHER_KEY],
              metrics=True)  # fmt: skip
    try:
        yield d
    finally:
        d.stop()


def client(dep, key: str = KEY, timeout: float = 60) -> OpenAI:
    """The official client (it always sends a key; a deployment without keys ignores it)."""
    url = f"http://{dep.http_address}/v1"
    return OpenAI(base_url=url, api_key=key, max_retries=0, timeout=timeout)


def http(dep, path: str, body: dict | None = None, key: str | None = KEY, raw: bytes = b""):
    """(status, JSON body) of a plain request, for what the openai client cannot send."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = raw or (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(f"http://{dep.http_address}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def streamed(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    text = ""
    for c in chunks:
        for ch in c.choices:
            text += (ch.delta.content or "") if hasattr(ch, "delta") else ch.text
    return text, chunks


def test_models_and_health(dep) -> None:
    with client(dep) as c:
        (card,) = c.models.list().data
        assert card.id == dep.target.name and card.owned_by == "specpipe"
        assert card.model_extra["max_model_len"] == 256  # the model's context (vLLM's field)
        assert c.models.retrieve(card.id).id == card.id
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("gpt-17")
    assert http(dep, "/health", key=None) == (200, {"status": "ok", "model": dep.target.name})


def test_chat_streamed_equals_not_streamed_equals_grpc(dep) -> None:
    msg = "Hello, pipeline!"
    kw = dict(model=dep.target.name, temperature=0, max_tokens=24)
    extra = {"ignore_eos": True, "return_token_ids": True}
    with client(dep) as c:
        full = c.chat.completions.create(
            messages=[{"role": "user", "content": msg}], extra_body=extra, **kw
        )
        text, chunks = streamed(
            c.chat.completions.create(
                messages=[{"role": "user", "content": [{"type": "text", "text": msg}]}],
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
                **kw,
            )
        )
    with Client(dep.router_address, timeout=60, api_key=KEY) as g:
        ref = g.generate(msg, chat=True, max_new_tokens=24, ignore_eos=True)
        prompt_ids = g.tokenize(msg, chat=True)
    (choice,) = full.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == text == ref.text
    assert choice.model_extra["token_ids"] == ref.token_ids
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    # The model version that served it (OpenAI's backend fingerprint): the weight hash.
    assert full.system_fingerprint == ref.weight_hash and len(ref.weight_hash) == 16
    assert {c.system_fingerprint for c in chunks} == {ref.weight_hash}
    assert full.usage.prompt_tokens == len(prompt_ids) == ref.prompt_tokens
    assert full.usage.completion_tokens == 24 and full.usage.total_tokens == len(prompt_ids) + 24
    spec = full.model_extra["speculation"]
    assert set(spec) >= SPECULATION and spec["mode"] == "specpipe" and spec["new_tokens"] == 24
    # Streamed: role first, one finish reason, then the usage chunk without choices.
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 24
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert set(last.model_extra["speculation"]) >= SPECULATION
    assert all(c.usage is None for c in chunks[:-1])


def test_text_completion_sampled_with_specpipe_options_equals_grpc(dep) -> None:
    prompt = "def fib(n):"
    opts = dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=20)
    extra = {"mode": "specinfer", "width": 4, "top_k": 20, "ignore_eos": True}
    with client(dep) as c:
        full = c.completions.create(model="", prompt=prompt, extra_body=extra, **opts)
        text, chunks = streamed(
            c.completions.create(model="", prompt=prompt, stream=True, extra_body=extra, **opts)
        )
        # Token ids as the prompt give the same (a list of one prompt too).
        ids = [ord(ch) - 31 for ch in prompt]
        by_ids = c.completions.create(model="", prompt=[ids], extra_body=extra, **opts)
    with Client(dep.router_address, timeout=60, api_key=KEY) as g:
        ref = g.generate(
            prompt, mode="specinfer", width=4, max_new_tokens=20, temperature=0.8,
            top_p=0.9, seed=7, top_k=20, ignore_eos=True,
        )  # fmt: skip
    assert full.choices[0].text == text == by_ids.choices[0].text == ref.text
    assert full.object == "text_completion" and full.usage.completion_tokens == 20
    assert full.model_extra["speculation"]["mode"] == "specinfer"
    assert full.model_extra["speculation"]["width"] == 4
    # Without include_usage the finishing chunk carries usage and the stats.
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].model_extra["speculation"]["new_tokens"] == 20


def test_stop_strings_cut_the_text_and_end_the_request(dep) -> None:
    kw = dict(model="", prompt="Stop here:", temperature=0, extra_body={"ignore_eos": True})
    with client(dep) as c:
        whole = c.completions.create(max_tokens=40, **kw).choices[0].text
        stop = whole[12:14]
        expected = whole[: whole.find(stop)]
        cut = c.completions.create(max_tokens=40, stop=[stop, "~never~"], **kw)
        text, chunks = streamed(c.completions.create(max_tokens=40, stop=stop, stream=True, **kw))
    assert cut.choices[0].text == text == expected
    assert cut.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
    # The request ended at the stop string, not after 40 tokens, and was freed everywhere.
    assert len(expected) <= cut.usage.completion_tokens < 40
    assert cut.model_extra["speculation"]["new_tokens"] == cut.usage.completion_tokens
    counts = wait_idle(dep)
    assert not any(counts.values()), counts


BAD = [
    (dict(n=17), "n must be in [1, 16]"),
    (dict(n=2, extra_body={"best_of": 3}), "best_of must equal n (2)"),
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(max_tokens=0), "max_tokens must be positive"),
    (dict(max_completion_tokens=10**9), "too large"),
    (dict(top_p=0), "top_p must be in (0, 1]"),
    (dict(seed=-2), "seed"),
    (dict(top_logprobs=2), "top_logprobs needs logprobs: true"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2.0, 2.0]"),
    (dict(extra_body={"min_tokens": 5}), "min_tokens (5) must be at most max_tokens (4)"),
    (dict(messages=[]), "messages must not be empty"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (dict(messages=[{"role": "user", "content": "x" * 300}]), "context holds 256"),
    (dict(extra_body={"mode": "beam"}), "unknown mode 'beam'"),
    (dict(extra_body={"width": -1}), "width must be in"),
    (dict(stop=""), "stop strings must not be empty"),
]


def test_errors_have_openais_shape_and_status(dep) -> None:
    base = dict(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with client(dep) as c:
        for kwargs, fragment in BAD:
            with pytest.raises(openai.BadRequestError) as info:
                c.chat.completions.create(**{**base, **kwargs})
            assert fragment in info.value.message, (kwargs, info.value.message)
            assert info.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError, match="one prompt per request"):
            c.completions.create(model="", prompt=["a", "b"], max_tokens=2)
        with pytest.raises(openai.NotFoundError) as info:
            c.chat.completions.create(**{**base, "model": "gpt-17"})
        assert info.value.body["code"] == "model_not_found"
        ok = c.chat.completions.create(**base)  # still serving
        assert ok.usage.completion_tokens >= 1
    with client(dep, key="sk-wrong") as c:
        with pytest.raises(openai.AuthenticationError) as info:
            c.chat.completions.create(**base)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    for path, body in (("/v1/chat/completions", base), ("/v1/models", None)):
        status, answer = http(dep, path, body, key=None)  # no Authorization header at all
        assert status == 401 and answer["error"]["code"] == "missing_api_key", answer
    with client(dep, key=OTHER_KEY) as c:  # any of the keys
        assert c.models.list().data
    status, body = http(dep, "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = http(dep, "/v1/nothing")
    assert status == 404 and body["error"]["code"] == "not_found"


def test_grpc_needs_the_key_too_and_the_cli_sends_it(dep) -> None:
    with Client(dep.router_address, timeout=10) as g, pytest.raises(Unauthenticated):
        g.generate("hi", max_new_tokens=2)
    with (
        Client(dep.router_address, timeout=10, api_key="wrong") as g,
        pytest.raises(Unauthenticated, match="not valid"),
    ):
        g.list_models()
    cmd = [sys.executable, "-c", ENTRY, "client", "models", "--router", dep.router_address]
    env = {**os.environ, "SPECPIPE_API_KEY": KEY}  # --api-key's default
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert ok.returncode == 0 and json.loads(ok.stdout)[0]["id"] == dep.target.name, ok.stderr


def test_a_client_that_goes_away_cancels_its_request_everywhere(dep) -> None:
    n = 230
    kw = dict(model="", prompt="x", max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    with client(dep) as c:
        stream = c.completions.create(stream=True, **kw)
        times = []
        for _ in stream:
            times.append(time.monotonic())
            if len(times) == 6:
                break
        stream.close()
        gone = time.monotonic()
    counts = wait_idle(dep)
    idle = time.monotonic() - gone
    assert not any(counts.values()), counts
    # Freed well before the rest of the tokens could have been generated.
    rest = (n - len(times)) * (times[-1] - times[0]) / (len(times) - 1)
    assert idle < rest, (idle, rest)  # freed before it could have finished on its own
    with client(dep, timeout=0.5) as c, pytest.raises(openai.APITimeoutError):
        c.completions.create(**kw)  # not streamed: the client gives up mid-way
    gone = time.monotonic()
    counts = wait_idle(dep)
    idle = time.monotonic() - gone
    assert not any(counts.values()), counts
    assert idle < rest, (idle, rest)  # freed before it could have finished on its own


# -- overload and draining, on a deployment of its own ------------------------------------
# One request runs and none may wait: a second one while the first streams is refused.
# (Stages admit by the KV blocks a request holds, not by what it may reach, so a tight
# cache budget no longer refuses the second request up front.)
OVERLOAD = dict(max_running=1, max_waiting=0)


def test_overload_is_429_and_draining_is_503(text_model_dir: Path) -> None:
    dep = start(text_model_dir, None, 1, "tcp", http_port=0, scheduling=OVERLOAD)
    try:
        with client(dep, key="unused") as c:
            long = c.completions.create(
                model="", prompt="abc", max_tokens=230, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            chunks = iter(long)
            next(chunks)
            with pytest.raises(openai.RateLimitError) as info:  # the router's queue
                c.completions.create(model="", prompt="abc", max_tokens=100, temperature=0)
            assert "retry later" in info.value.message
            assert info.value.response.headers["retry-after"]
            os.kill(dep.children["router"].proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while http(dep, "/health", key=None)[0] != 503:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert http(dep, "/health", key=None)[1]["status"] == "draining"
            with pytest.raises(openai.InternalServerError) as info:
                c.completions.create(model="", prompt="abc", max_tokens=2)
            assert info.value.status_code == 503 and "shutting down" in info.value.message
            rest = list(chunks)  # the open stream still finishes
            assert rest[-1].choices[0].finish_reason == "length"
            assert rest[-1].usage.completion_tokens == 230
    finally:
        dep.stop()


# -- logprobs, echo and n ------------------------------------------------------------------
# Long enough for a whole KV cache block (16 rows) of prompt before its last token.
SCORED = "def fibonacci(n): return n if n < 2 else fib(n - 1)"
FP64 = 1e-9  # the deployment and the reference both compute in fp64 (~1e-13 apart)


def plain_forward(dep, ids: list[int]):
    """log_softmax of transformers' own fp64 forward of `ids` (row p scores token p + 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(dep.target, dtype=torch.float64).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)


def name(token_id: int) -> str:
    """The char tokenizer's text of a token (conftest.add_char_tokenizer)."""
    return {0: "<s>", 96: "</s>"}.get(token_id, chr(token_id + 31))


def test_completion_logprobs_with_echo_are_a_plain_forwards(dep) -> None:
    """echo + logprobs: every prompt token after the first and every generated token get
    log_softmax of the target's raw logits at its position (not the sampling
    distribution) and the top 3, streamed and not; the prompt's are right although the
    prefix cache holds the prompt (such a request computes its prefill whole)."""
    kw = dict(model="", prompt=SCORED, max_tokens=12, temperature=0.8, seed=3, logprobs=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    with client(dep) as c:
        c.completions.create(**{**kw, "logprobs": None})  # the prompt now in the prefix cache
        whole = c.completions.create(echo=True, **kw)
        chunks = list(c.completions.create(echo=True, stream=True, **kw))
        plain = c.completions.create(**kw)
    with Client(dep.router_address, timeout=60, api_key=KEY) as g:
        prompt = g.tokenize(SCORED)
        grpc_answer = g.generate(SCORED, max_new_tokens=1, prompt_logprobs=3)  # the SDK's
    (choice,) = whole.choices
    out = choice.model_extra["token_ids"]
    assert choice.text == SCORED + plain.choices[0].text and len(out) == 12
    want = plain_forward(dep, prompt + out)
    lp = choice.logprobs
    ids = prompt + out
    assert lp.tokens == [name(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        row = want[i - 1]
        assert lp.token_logprobs[i] == pytest.approx(float(row[ids[i]]), abs=FP64)
        top = row.topk(3)
        expected = {name(ids[i]): float(row[ids[i]])}
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            expected.setdefault(name(t), v)
        assert lp.top_logprobs[i] == pytest.approx(expected, abs=FP64)
    assert lp.text_offset == list(range(len(ids)))  # one character per token
    assert grpc_answer.prompt_token_ids == prompt
    assert [x for x, _ in grpc_answer.prompt_logprobs] == pytest.approx(
        lp.token_logprobs[1 : len(prompt)], abs=FP64
    )
    # Streamed: the same figures, the echo (and the prompt's logprobs) first.
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert pieces[0].text == SCORED and pieces[0].logprobs.tokens == lp.tokens[: len(prompt)]
    streamed = [x for p in pieces if p.logprobs for x in p.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=FP64)
    # Without echo, the completion's tokens only, offsets from its own text.
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(
        lp.token_logprobs[len(prompt) :], abs=FP64
    )
    assert plain.choices[0].logprobs.text_offset == list(range(12))


def test_chat_logprobs_are_a_plain_forwards(dep) -> None:
    msg = "Score me"
    kw = dict(model="", messages=[{"role": "user", "content": msg}], max_tokens=10,
              temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    with client(dep) as c:
        whole = c.chat.completions.create(**kw)
        chunks = list(c.chat.completions.create(stream=True, **kw))
    with Client(dep.router_address, timeout=60, api_key=KEY) as g:
        prompt = g.tokenize(msg, chat=True)
    out = whole.choices[0].model_extra["token_ids"]
    want = plain_forward(dep, prompt + out)
    content = whole.choices[0].logprobs.content
    assert [t.token for t in content] == [name(t) for t in out]
    for j, (t, token) in enumerate(zip(content, out, strict=True)):
        row = want[len(prompt) - 1 + j]
        assert t.logprob == pytest.approx(float(row[token]), abs=FP64)
        assert t.bytes == list(name(token).encode())
        top = row.topk(2)
        assert [x.token for x in t.top_logprobs] == [name(i) for i in top.indices.tolist()]
        assert [x.logprob for x in t.top_logprobs] == pytest.approx(top.values.tolist(), abs=FP64)
        assert token == top.indices[0]  # greedy: the most likely token
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.content]  # fmt: skip
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in content]


def stage_prefix_hits(dep) -> list[int]:
    """prefix_cache_hits of every stage (prompt tokens Open found cached)."""
    from specpipe.v1 import dataplane_pb2

    hits = []
    for child in dep.children.values():
        if child.kind != "stage":
            continue
        ch, stub = service_stub(child.info["grpc"], "stage", dep.security)
        with ch:
            hits.append(stub.Describe(dataplane_pb2.DescribeRequest(), timeout=5).prefix_cache_hits)
    return hits


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_the_seeded_requests_and_share_the_prefill(dep, stream) -> None:
    """n = 3: choice i is the request with seed + i, streamed or not; the later choices
    start after the first's prefill and find its prompt in every stage's prefix cache;
    usage counts the prompt once and every choice's tokens."""
    prompt = f"{'streamed' if stream else 'whole'} choices share one prompt's prefill"
    kw = dict(model="", prompt=prompt, max_tokens=8, temperature=0.9,
              extra_body={"ignore_eos": True})  # fmt: skip
    with client(dep) as c:
        before = stage_prefix_hits(dep)
        if stream:
            texts = ["", "", ""]
            chunks = list(c.completions.create(n=3, seed=5, stream=True, **kw))
            for ch in chunks:
                for choice in ch.choices:
                    texts[choice.index] += choice.text
            usage = [ch.usage for ch in chunks if ch.usage][-1]
        else:
            many = c.completions.create(n=3, seed=5, **kw)
            assert [ch.index for ch in many.choices] == [0, 1, 2]
            texts = [ch.text for ch in many.choices]
            usage = many.usage
        after = stage_prefix_hits(dep)
        one_by_one = [c.completions.create(seed=5 + i, **kw).choices[0].text for i in range(3)]
    assert texts == one_by_one and len(set(texts)) > 1  # independent draws
    # Choices 1 and 2 each found the prompt's first block (16 tokens) on every stage.
    assert all(b - a >= 2 * 16 for a, b in zip(before, after, strict=True)), (before, after)
    assert (usage.completion_tokens, usage.prompt_tokens) == (24, len(prompt))


def test_the_router_serves_vllms_metric_names_beside_its_own(dep) -> None:
    """/metrics of the router, parsed by prometheus-client: the series vLLM's dashboards
    read, under vLLM's names with its `model_name` label, equal to the `specpipe:` ones."""
    from prometheus_client.parser import text_string_to_metric_families

    with client(dep) as c:
        c.completions.create(model="", prompt="count me", max_tokens=5, temperature=0)
    address = dep.metrics_addresses()["router"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    pairs = {
        "num_requests_running": "gauge",
        "num_requests_waiting": "gauge",
        "time_to_first_token_seconds": "histogram",
        "time_per_output_token_seconds": "histogram",
        "inter_token_latency_seconds": "histogram",
        "e2e_request_latency_seconds": "histogram",
        "prompt_tokens": "counter",
        "generation_tokens": "counter",
        "request_success": "counter",
    }
    for name_, kind in pairs.items():
        family = families[f"vllm:{name_}"]
        assert family.type == kind, name_
        assert {s.labels["model_name"] for s in family.samples} == {dep.target.name}

    def value(family: str, sample: str, **labels) -> float:
        found = [s.value for s in families[family].samples if s.name == sample
                 and all(s.labels.get(k) == v for k, v in labels.items())]  # fmt: skip
        assert len(found) == 1, (family, sample, labels)
        return found[0]

    for ours, theirs, sample in (
        ("prompt_tokens", "prompt_tokens", "_total"),
        ("generation_tokens", "generation_tokens", "_total"),
        ("time_to_first_token_seconds", "time_to_first_token_seconds", "_count"),
        ("inter_token_latency_seconds", "time_per_output_token_seconds", "_sum"),
        ("e2e_request_latency_seconds", "e2e_request_latency_seconds", "_count"),
    ):
        mine = value(f"specpipe:{ours}", f"specpipe:{ours}{sample}")
        assert value(f"vllm:{theirs}", f"vllm:{theirs}{sample}") == mine, theirs
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") >= 5
    done = value("specpipe:request_success", "specpipe:request_success_total",
                 finished_reason="length")  # fmt: skip
    assert value("vllm:request_success", "vllm:request_success_total",
                 finished_reason="length") == done >= 1  # fmt: skip
