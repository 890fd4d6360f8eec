"""The logits rules (repetition, frequency and presence penalties, logit bias, min_tokens)
through the real services (router, stages and the draft in separate processes) and the
HTTP API with the official `openai` client: every mode emits exactly the plain reference
loop's tokens (`tests/penalty_reference.py`, transformers in fp64), greedy and seeded;
values out of range are a 400 naming the field; and a request whose verifying stage is
killed mid-stream is replayed on the other replica and still emits exactly those tokens
(the new last stage counts the prompt and output from its Open)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import OpenAI
from specpipe.common.spec.grammar import Grammar, ResponseFormat, load_grammar_tokenizer
from specpipe.common.spec.sampling import SamplingParams

from specpipe.client import Client
from tests.penalty_reference import plain_decode

from .conftest import EOS, start
from .test_elastic import on_path, wait_backends

PROMPT = [ord(c) - 31 for c in "Hello, Hel"]  # the char tokenizer's ids
RULES = dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3,
             logit_bias={10: 3.0, 77: -2.5})  # fmt: skip


@pytest.fixture(scope="module")
def dep(text_model_dir: Path) -> Iterator:
    """2 stages over TCP, the last one with two replicas (a killed one's requests are
    replayed on the other), the target as its own draft, the HTTP API on."""
    d = start(text_model_dir, "oracle", 2, "tcp", http_port=0, replay_seconds=20.0,
              stage_replicas=[1, 2])  # fmt: skip
    try:
        wait_backends(d, stages=3)
        yield d
    finally:
        d.stop()


def openai_client(dep) -> OpenAI:
    return OpenAI(base_url=f"http://{dep.http_address}/v1", api_key="unused", max_retries=0,
                  timeout=120)  # fmt: skip


@functools.cache
def expected(target: Path, sampling: SamplingParams, n: int, stops=(EOS,), min_tokens=0):
    return plain_decode(target, PROMPT, sampling, n, stops, min_tokens)


@pytest.mark.parametrize("mode", ["specpipe", "pp", "specinfer"])
def test_openai_completions_emit_the_plain_loop_in_every_mode(dep, mode) -> None:
    extra = {"mode": mode, "repetition_penalty": RULES["repetition_penalty"],
             "return_token_ids": True, "layers_per_step": 2 if mode == "specpipe" else None}  # fmt: skip
    with openai_client(dep) as c:
        for temperature, seed in ((0.0, 0), (0.9, 5)):
            sampling = SamplingParams(temperature=temperature, seed=seed, **RULES)
            got = c.completions.create(
                model="", prompt=PROMPT, max_tokens=32, temperature=temperature, seed=seed,
                frequency_penalty=RULES["frequency_penalty"],
                presence_penalty=RULES["presence_penalty"],
                logit_bias={str(t): b for t, b in RULES["logit_bias"].items()},
                extra_body=extra,
            )  # fmt: skip
            want = expected(dep.target, sampling, 32)
            assert got.choices[0].model_extra["token_ids"] == want, (mode, temperature)
            assert want != expected(dep.target, SamplingParams(temperature, seed=seed), 32)


def test_min_tokens_and_chat_through_the_openai_client(dep) -> None:
    """min_tokens holds a stop token the plain output takes early back (streamed and not);
    the chat endpoint takes the rules as well (its prompt: the chat template's ids)."""
    sampling = SamplingParams(temperature=0.7, seed=2)
    stop = expected(dep.target, sampling, 32, ())[3]
    want = expected(dep.target, sampling, 32, (EOS, stop), 12)
    assert len(want) >= 12 and stop not in want[:11]
    kw = dict(model="", prompt=PROMPT, max_tokens=32, temperature=0.7, seed=2,
              extra_body={"min_tokens": 12, "stop_token_ids": [stop], "return_token_ids": True})  # fmt: skip
    with openai_client(dep) as c:
        got = c.completions.create(**kw)
        assert got.choices[0].model_extra["token_ids"] == want
        text = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw))
        assert text == got.choices[0].text
        messages = [{"role": "user", "content": "Hello, Hello"}]
        chat = c.chat.completions.create(
            model="", messages=messages, max_tokens=20, temperature=0, frequency_penalty=1.5,
            logit_bias={"10": 2.0}, extra_body={"return_token_ids": True},
        )  # fmt: skip
    with Client(dep.router_address, timeout=60) as g:
        prompt = g.tokenize("Hello, Hello", chat=True)
    rules = SamplingParams(frequency_penalty=1.5, logit_bias={10: 2.0})
    want = plain_decode(dep.target, prompt, rules, 20, (EOS,))
    assert chat.choices[0].model_extra["token_ids"] == want


def test_a_stop_string_waits_for_min_tokens_through_the_openai_client(dep) -> None:
    """vLLM's rule: a stop string is honoured once min_tokens tokens are out; one that
    ends earlier is output as text, streamed and not (a token is a character here)."""
    kw = dict(model="", prompt=PROMPT, max_tokens=24, temperature=0)
    with openai_client(dep) as c:
        whole = c.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
        assert len(whole) == 24
        stop = whole[1:3]  # ends with the 3rd token
        first = whole.find(stop)
        late = next((i for i in range(len(whole)) if whole.startswith(stop, i) and i + 2 >= 12),
                    len(whole))  # fmt: skip
        for min_tokens, want in ((0, whole[:first]), (12, whole[:late])):
            extra = {"ignore_eos": True, "min_tokens": min_tokens}
            got = c.completions.create(**kw, stop=[stop], extra_body=extra).choices[0]
            assert got.text == want, min_tokens
            assert got.finish_reason == ("stop" if len(want) < 24 else "length")
            chunks = c.completions.create(**kw, stop=[stop], extra_body=extra, stream=True)
            assert "".join(ch.choices[0].text for ch in chunks) == want, min_tokens


def test_the_rules_under_a_response_format(dep) -> None:
    """With a grammar the last stage masks first, then the rules apply to the allowed
    tokens (a bias on "," fills the array); min_tokens (40) holds the end-of-sequence
    token back only while the grammar allows another, so the complete array still ends
    (at 31 tokens). The same tokens as the plain loop under the grammar library's mask."""
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue", "cyan"]},
              "minItems": 1, "maxItems": 4, "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
    fmt = ResponseFormat("json_schema", json.dumps(schema))
    grammar = Grammar(fmt.grammar_text() or "", load_grammar_tokenizer(str(dep.target), 97, (EOS,)))
    comma = ord(",") - 31
    want, without = (
        plain_decode(dep.target, PROMPT, sampling, 48, (EOS,), 40,
                     lambda out: grammar.state(out).allowed(97))
        for sampling in (SamplingParams(temperature=0.9, seed=4, repetition_penalty=1.5,
                                        logit_bias={comma: 30.0}),
                         SamplingParams(temperature=0.9, seed=4))
    )  # fmt: skip
    assert want != without and want[-1] == EOS and len(want) < 40
    with openai_client(dep) as c:
        got = c.completions.create(
            model="", prompt=PROMPT, max_tokens=48, temperature=0.9, seed=4,
            logit_bias={str(comma): 30.0},
            extra_body={"repetition_penalty": 1.5, "min_tokens": 40, "return_token_ids": True,
                        "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": schema}}},
        )  # fmt: skip
    assert got.choices[0].model_extra["token_ids"] == want
    assert json.loads(got.choices[0].text) and got.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"logit_bias": {"5": 1.0, "x": 2.0}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"repetition_penalty": 3}}, "repetition_penalty"),
        ({"extra_body": {"min_tokens": 40}}, "min_tokens"),
        ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
        ({"logit_bias": {"500": 1.0}}, None),  # outside the vocabulary: the router's check
    ],
)
def test_values_out_of_range_are_a_400_naming_the_field(dep, fields, param) -> None:
    with openai_client(dep) as c, pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="", prompt=PROMPT, max_tokens=32, **fields)
    e = info.value
    name = param or "logit_bias"
    assert name in e.message and (param is None or e.param == param), e.message


def test_a_replay_after_the_last_stage_dies_stays_exact(dep) -> None:
    """The verifying stage of the request's path is killed mid-stream: the router reopens
    the request on the other replica (its Open brings prompt + output, from which that
    stage counts the tokens again) and the output is the plain loop's. Runs last: the
    deployment keeps one replica of its last stage."""
    sampling = SamplingParams(temperature=0.8, seed=9, **RULES)
    n = 120
    want = plain_decode(dep.target, PROMPT, sampling, n)
    tokens: list[int] = []
    with Client(dep.router_address, timeout=180) as g:
        stream = g.stream(prompt_ids=PROMPT, max_new_tokens=n, ignore_eos=True,
                          temperature=0.8, seed=9, layers_per_step=2, **RULES)  # fmt: skip
        killed = False
        for chunk in stream:
            tokens.extend(chunk.token_ids)
            if not killed and len(tokens) >= 4:
                dep.kill(on_path(dep, "stage1"))
                killed = True
        done = stream.result()
    assert tokens == done.token_ids == want
    assert done.stats["replays"] >= 1
