"""Structured output through the real services (router, two stages, the draft: separate
processes) and the HTTP API with the official `openai` client: outputs follow their
JSON schemas (they parse and validate), the tokens are the in-process engine's (the
last stage draws under the grammar, the router prunes the tree with it), a complete
output ends with finish_reason "stop" and one cut short by max_tokens with "length",
and what cannot be constrained is a 400 naming the problem."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from openai import OpenAI
from specpipe.common.runtime.loader import build_local
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.grammar import Grammar, ResponseFormat, load_grammar_tokenizer
from specpipe.common.spec.options import DecodeOptions
from specpipe.common.spec.sampling import SamplingParams

from specpipe.client import Client, InvalidArgument

from .conftest import EOS, start

VOCAB = EOS + 1
PROMPT = [ord(c) - 31 for c in "Reply in JSON: "]  # the char tokenizer's ids
# Bounded, compact (no free whitespace): a random model's output completes in time.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "admin"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
COLORS = {
    "type": "array",
    "items": {"enum": ["red", "green", "blue"]},
    "minItems": 1,
    "maxItems": 4,
    "x-guidance": {"whitespace_flexible": False},
}
TAGGED = {
    "type": "object",
    "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "maximum": 99},
                   "y": {"type": "integer", "minimum": -9, "maximum": 9}},
    "required": ["kind", "x", "y"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}  # fmt: skip
SCHEMAS = {"person": PERSON, "colors": COLORS, "tagged": TAGGED}


def json_schema(schema: dict) -> dict:
    """OpenAI's response_format for a schema."""
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


@pytest.fixture(scope="module")
def dep(text_model_dir: Path) -> Iterator:
    """2 stages over TCP, the target as its own draft, the HTTP API on."""
    d = start(text_model_dir, "oracle", 2, "tcp", http_port=0)
    try:
        yield d
    finally:
        d.stop()


def openai_client(dep) -> OpenAI:
    url = f"http://{dep.http_address}/v1"
    return OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def engine_tokens(dep, schema: dict, mode: str, sampling: SamplingParams, n: int) -> list[int]:
    """The same request through the in-process engine (the reference)."""
    fmt = ResponseFormat("json_schema", json.dumps(schema))
    tok = load_grammar_tokenizer(str(dep.target), VOCAB, (EOS,))
    local = build_local(dep.target, len(dep.ranges), dep.target, torch.float64)
    opts = DecodeOptions(
        max_new_tokens=n, sampling=sampling, stop_token_ids=(EOS,),
        grammar=Grammar(fmt.grammar_text() or "", tok),
    )  # fmt: skip
    gen = LockstepGeneration(local.pipeline, local.draft, PROMPT, mode, opts)
    return gen.run()


def parsed(text: str, schema: dict):
    doc = json.loads(text)
    jsonschema.validate(doc, schema)
    return doc


@pytest.mark.parametrize("mode", ["specpipe", "pp", "specinfer"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_grpc_outputs_follow_the_schema_and_equal_the_engines(dep, name, mode) -> None:
    schema = SCHEMAS[name]
    with Client(dep.router_address, timeout=120) as client:
        for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=4)):
            got = client.generate(
                prompt_ids=PROMPT, mode=mode, max_new_tokens=64,
                temperature=sampling.temperature, seed=sampling.seed,
                response_format=json_schema(schema), layers_per_step=2 if mode == "specpipe" else None,
            )  # fmt: skip
            assert got.finish_reason == "stop" and got.token_ids[-1] == EOS
            parsed(got.text, schema)
            ref = engine_tokens(dep, schema, mode, sampling, 64)
            assert got.token_ids == ref, (name, mode, sampling)


def test_openai_chat_and_completions_follow_the_schema(dep) -> None:
    with openai_client(dep) as c:
        for name, schema in SCHEMAS.items():
            fmt = json_schema(schema)
            messages = [{"role": "user", "content": f"a {name}, please"}]
            chat = c.chat.completions.create(
                model=dep.target.name, messages=messages, response_format=fmt,
                max_tokens=64, temperature=0,
            )  # fmt: skip
            (choice,) = chat.choices
            assert choice.finish_reason == "stop"
            doc = parsed(choice.message.content, schema)
            stream = c.chat.completions.create(
                model=dep.target.name, messages=messages, response_format=fmt,
                max_tokens=64, temperature=0, stream=True,
            )  # fmt: skip
            text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            assert json.loads(text) == doc
            done = c.completions.create(
                model=dep.target.name, prompt="Reply in JSON: ", max_tokens=64,
                temperature=0.8, seed=11, extra_body={"response_format": fmt},
            )  # fmt: skip
            assert done.choices[0].finish_reason == "stop"
            parsed(done.choices[0].text, schema)


def test_json_object_is_a_json_object_or_cut_short(dep) -> None:
    """Any JSON object (free whitespace, unbounded strings): a random model's output is
    either a complete object (finish_reason "stop") or a prefix of one cut at max_tokens
    ("length")."""
    with openai_client(dep) as c:
        for seed in range(3):
            out = c.chat.completions.create(
                model=dep.target.name, messages=[{"role": "user", "content": "an object"}],
                response_format={"type": "json_object"}, max_tokens=40, temperature=1.0,
                seed=seed,
            )  # fmt: skip
            choice = out.choices[0]
            assert choice.message.content.startswith("{")
            if choice.finish_reason == "stop":
                assert isinstance(json.loads(choice.message.content), dict)
            else:
                assert choice.finish_reason == "length" and out.usage.completion_tokens == 40


def test_max_tokens_cuts_a_structured_output_with_finish_reason_length(dep) -> None:
    with openai_client(dep) as c:
        full = c.completions.create(
            model=dep.target.name, prompt="Reply in JSON: ", max_tokens=64, temperature=0,
            extra_body={"response_format": json_schema(PERSON)},
        )  # fmt: skip
        cut = c.completions.create(
            model=dep.target.name, prompt="Reply in JSON: ", max_tokens=6, temperature=0,
            extra_body={"response_format": json_schema(PERSON)},
        )  # fmt: skip
    assert cut.choices[0].finish_reason == "length"
    assert full.choices[0].text.startswith(cut.choices[0].text) and len(cut.choices[0].text) == 6


def test_what_cannot_be_constrained_is_a_400_naming_the_problem(dep) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with openai_client(dep) as c:
        cases = [
            (json_schema({"type": "objec"}), "Invalid type: objec"),
            (json_schema({"type": "integer", "minimum": 3, "maximum": 1}), "Unsatisfiable"),
            ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs"),
            ({"type": "xml"}, "must be one of text, json_object, json_schema"),
        ]
        for fmt, match in cases:
            with pytest.raises(openai.BadRequestError, match=match):
                c.chat.completions.create(
                    model=dep.target.name, messages=messages, response_format=fmt, max_tokens=4
                )
        # Function calling: "auto" needs a tool-call format the template teaches (this
        # one has none); a tool schema the grammar engine cannot use is a 400 too.
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        with pytest.raises(openai.BadRequestError, match="needs the model's tool-call format"):
            c.chat.completions.create(
                model=dep.target.name, messages=messages, tools=tools, max_tokens=4
            )
        bad = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 5,
                                                   "maximum": 2}}, "required": ["n"]}}}]  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="cannot constrain the output") as e:
            c.chat.completions.create(
                model=dep.target.name, messages=messages, tools=bad, tool_choice="required",
                max_tokens=4,
            )  # fmt: skip
        assert e.value.body["param"] == "tools"
    with Client(dep.router_address, timeout=60) as client, pytest.raises(InvalidArgument) as e:
        client.generate(prompt_ids=PROMPT, response_format=json_schema({"$ref": "#/no"}))
    assert "/no" in e.value.message
