"""Each request option declared once (common/spec/request_options.py) and carried by
every surface: the `GenerateRequest` proto, the SDK's `build_request`, the HTTP API's
body (`services/router/openai_compat.py`), `specpipe client generate`'s flags, and the
engine's `DecodeOptions` / `SamplingParams` with the declared bounds and defaults. Each
option's example goes through each surface's real mapping and must arrive on the wire;
a surface with an option the table does not declare fails too."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap

import pytest
from specpipe.common.spec.options import MAX_NEW_TOKENS, DecodeOptions
from specpipe.common.spec.request_options import (
    AUTO,
    REQUEST_OPTIONS,
    RequestOption,
    RequestOptions,
)
from specpipe.common.spec.sampling import SamplingParams
from specpipe.services.client import AsyncClient, Client
from specpipe.services.client import common as client_common
from specpipe.services.client.common import build_request
from specpipe.services.router.backends import ModelInfo
from specpipe.services.router.openai_compat import NOT_PLAIN, CompletionRequest
from specpipe.services.router.requests import ROUTER_SET, engine_options, plan_request
from specpipe.v1 import generation_pb2 as gen

from specpipe.cli import build_parser
from specpipe.cli import client as cli_client
from specpipe.cli.client import request_kwargs

PROMPT_FIELDS = {"text", "token_ids"}  # the prompt, not an option
# The HTTP body's fields that are OpenAI's and not request options of their own: another
# name of max_tokens, stop strings and streaming (the HTTP layer's), choices (n requests),
# the response's shape (echo: the prompt before the text, with logprobs prompt_logprobs).
HTTP_ONLY = {"max_completion_tokens", "stop", "stream", "stream_options", "n", "return_token_ids",
             "echo"}  # fmt: skip
# The proto's int32 fields (the others are int64).
INT32_FIELDS = {"priority", "logprobs", "prompt_logprobs"}
# `client generate`'s flags that are not request options.
CLI_ONLY = {"--help", "--router", "--timeout", "--api-key", "--tls-ca", "--tls", "--prompt",
            "--prompt-ids", "--json"}  # fmt: skip
OPTIONS = [pytest.param(o, id=o.name) for o in REQUEST_OPTIONS]


def _read(message, path: str):
    for part in path.split("."):
        message = getattr(message, part)
    return message


def _on_wire(o: RequestOption, value):
    """What the wire carries for `value`: "auto" as 0 for integers, sequences as lists,
    a response_format as its message (the schema as JSON text)."""
    if value == AUTO and o.kind is int:
        return 0
    if o.kind is tuple:
        return list(value)
    if o.kind is dict and _is_map(_field(o.wire)):
        return {int(k): v for k, v in value.items()}
    if o.kind is dict:
        schema = value.get("json_schema", {}).get("schema")
        return gen.ResponseFormat(type=value["type"], schema=json.dumps(schema) if schema else "")
    return value


def _is_map(f) -> bool:
    """A proto map field (logit_bias): a repeated message of map entries."""
    return f.message_type is not None and f.message_type.GetOptions().map_entry


def _field(path: str):
    descriptor = gen.GenerateRequest.DESCRIPTOR
    *outer, last = path.split(".")
    for part in outer:
        descriptor = descriptor.fields_by_name[part].message_type
    return descriptor.fields_by_name[last]


def test_every_field_of_the_request_is_declared_once() -> None:
    fields = {f.name for f in gen.GenerateRequest.DESCRIPTOR.fields} - PROMPT_FIELDS
    fields.remove("sampling")
    fields |= {f"sampling.{f.name}" for f in gen.SamplingOptions.DESCRIPTOR.fields}
    wires = [o.wire for o in REQUEST_OPTIONS]
    assert len(wires) == len(set(wires)) and len({o.name for o in REQUEST_OPTIONS}) == len(wires)
    assert set(wires) == fields


@pytest.mark.parametrize("o", OPTIONS)
def test_the_proto_field_has_the_declared_type(o: RequestOption) -> None:
    f = _field(o.wire)
    cpp = {int: f.CPPTYPE_INT64, float: f.CPPTYPE_DOUBLE, str: f.CPPTYPE_STRING,
           bool: f.CPPTYPE_BOOL, tuple: f.CPPTYPE_INT64, dict: f.CPPTYPE_MESSAGE}[o.kind]  # fmt: skip
    if o.wire in INT32_FIELDS:
        cpp = f.CPPTYPE_INT32
    assert f.cpp_type == cpp
    assert f.is_repeated == (o.kind is tuple or _is_map(f))


def test_the_sdk_takes_every_option_and_no_other() -> None:
    """The keywords are the table's (typed by `RequestOptions`), not parameters of their
    own: a parameter named after an option is the SDK written by hand again."""
    keywords = {o.keyword for o in REQUEST_OPTIONS}
    assert set(RequestOptions.__annotations__) == keywords
    typed = {int: ("int",), float: ("float",), str: ("str",), bool: ("bool",),
             tuple: ("Sequence[int]",), dict: ("dict[", "Mapping[")}  # fmt: skip
    for o in REQUEST_OPTIONS:  # the hint names the option's kind
        hint = str(RequestOptions.__annotations__[o.keyword])
        assert any(t in hint for t in typed[o.kind]), o.name
    for func in (build_request, Client.stream, Client.generate, AsyncClient.stream):
        params = inspect.signature(func).parameters
        assert not keywords & set(params), func
        assert any(p.kind is p.VAR_KEYWORD for p in params.values()), func
    with pytest.raises(TypeError, match="no_such_option"):
        build_request("x", no_such_option=1)
    for o in REQUEST_OPTIONS:
        assert f"{o.keyword}: {o.help}" in build_request.__doc__


@pytest.mark.parametrize("o", OPTIONS)
def test_the_sdk_puts_each_option_on_the_wire(o: RequestOption) -> None:
    req = build_request("x", **{o.keyword: o.example})
    assert _read(req, o.wire) == _on_wire(o, o.example)
    if o.auto:
        req = build_request("x", **{o.keyword: AUTO})
        assert _read(req, o.wire) == _on_wire(o, AUTO)


def test_the_http_body_has_every_option_and_no_other() -> None:
    own = set(CompletionRequest.model_fields) - HTTP_ONLY - {"prompt"}
    assert own == {o.http for o in REQUEST_OPTIONS if o.http}


@pytest.mark.parametrize("o", [p for p in OPTIONS if p.values[0].http])
def test_the_http_api_puts_each_option_on_the_wire(o: RequestOption) -> None:
    body = CompletionRequest(prompt="x", **{o.http: o.example})
    req = body.to_requests("x", 16, "specpipe")[0]
    assert _read(req, o.wire) == _on_wire(o, o.example)


def _client_generate() -> object:
    parser = build_parser()
    client = next(
        a for a in parser._actions if getattr(a, "choices", None) and "client" in a.choices
    )
    sub = client.choices["client"]
    commands = next(a for a in sub._actions if getattr(a, "choices", None))
    return commands.choices["generate"]


def test_client_generate_has_a_flag_for_every_option_and_no_other() -> None:
    flags = {s for a in _client_generate()._actions for s in a.option_strings if s.startswith("--")}
    assert flags - CLI_ONLY == {o.cli for o in REQUEST_OPTIONS if o.cli}


def _flag_args(o: RequestOption, value) -> list[str]:
    if o.kind is bool:
        return [o.cli] if value else []
    if o.kind is tuple:
        return [o.cli, ",".join(str(v) for v in value)]
    if o.kind is dict:
        return [o.cli, json.dumps(value)]
    return [o.cli, str(value)]


@pytest.mark.parametrize("o", [p for p in OPTIONS if p.values[0].cli])
def test_client_generate_puts_each_option_on_the_wire(o: RequestOption) -> None:
    parse = build_parser().parse_args
    args = parse(["client", "generate", "--prompt", "x", *_flag_args(o, o.example)])
    req = build_request(args.prompt, **request_kwargs(args))
    assert _read(req, o.wire) == _on_wire(o, o.example)
    if o.auto:
        args = parse(["client", "generate", "--prompt", "x", *_flag_args(o, AUTO)])
        assert _read(build_request("x", **request_kwargs(args)), o.wire) == _on_wire(o, AUTO)


def _engine(o: RequestOption, value):
    """DecodeOptions (with SamplingParams) with the option's engine field at `value`."""
    if o.engine.startswith("sampling."):
        return SamplingParams(**{o.engine.split(".", 1)[1]: value})
    # (the most new tokens: min_tokens' bound is max_new_tokens)
    return DecodeOptions(**{"max_new_tokens": MAX_NEW_TOKENS, o.engine: value})


@pytest.mark.parametrize("o", [p for p in OPTIONS if p.values[0].engine])
def test_the_engine_has_the_declared_default_bounds_and_choices(o: RequestOption) -> None:
    field = o.engine.split(".")[-1]
    if o.engine.startswith("sampling."):
        default = getattr(SamplingParams(), field)
    elif o.name == "max_new_tokens":
        default = o.default  # DecodeOptions requires it; the entry points default it
    else:
        default = getattr(DecodeOptions(max_new_tokens=1), field)
    assert default == (tuple(o.default) if o.kind is tuple else o.default)
    assert getattr(_engine(o, o.example), field) == o.example
    step = 1 if o.kind is int else 0.1
    if o.low is not None:
        _engine(o, o.low)
        with pytest.raises(ValueError):
            _engine(o, o.low - step)
    if o.high is not None:
        _engine(o, o.high)
        with pytest.raises(ValueError):
            _engine(o, o.high + step)
    for choice in o.choices:
        if choice != AUTO:
            _engine(o, choice)
    if o.choices:
        with pytest.raises(ValueError):
            _engine(o, "no-such-choice")


# DecodeOptions fields that are not request options as such: the grammar is compiled
# from the response_format option with the served model's tokenizer; the prefill budget
# (rows x keys per chunk) is the stages', which the router sets (services/router/step_fit.py).
COMPILED = {"grammar", "prefill_cells"}
# Switches to measure a mechanism, not request options: on for every request.
MEASURING = {"forced_tokens"}


def test_every_engine_option_is_declared() -> None:
    """A new DecodeOptions or SamplingParams field is a request option or says why not."""
    engine = {f.name for f in dataclasses.fields(DecodeOptions)} - {"sampling"} - COMPILED
    engine -= MEASURING
    engine |= {f"sampling.{f.name}" for f in dataclasses.fields(SamplingParams)}
    assert engine == {o.engine for o in REQUEST_OPTIONS if o.engine}


# HTTP body fields named by OpenAI's API, not by us
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}


@pytest.mark.parametrize("o", OPTIONS)
def test_an_option_has_one_name_on_every_surface(o: RequestOption) -> None:
    """The proto field, the engine's field, the SDK keyword and the CLI flag carry the
    option's name (issue 25: proto `depth` was the engine's `specinfer_depth`)."""
    names = {o.wire.split(".")[-1], (o.engine or o.name).split(".")[-1], o.keyword}
    if o.cli is not None:
        names.add(o.dest)
    assert names == {o.name}
    if o.http is not None:
        assert o.http == OPENAI_NAMES.get(o.name, o.name)


ENGINE_OPTIONS = [p for p in OPTIONS if p.values[0].engine]
ROUTER_MODEL = ModelInfo("m", "h", num_layers=4, vocab_size=100, max_positions=256,
                         eos_token_ids=(), ranges=[(0, 2), (2, 4)])  # fmt: skip


@pytest.mark.parametrize("o", ENGINE_OPTIONS)
def test_the_router_puts_each_option_in_the_engines_options(o: RequestOption) -> None:
    """The SDK's request, planned by the router: the option's example reaches the
    engine's field (the table's read or the router's own special case)."""
    plan = plan_request(build_request("x", **{o.keyword: o.example}), ROUTER_MODEL,
                        [1, 2, 3], has_draft=True)  # fmt: skip
    *outer, field = o.engine.split(".")
    engine = plan.opts.sampling if outer else plan.opts
    expected = tuple(o.example) if o.kind is tuple else o.example
    assert getattr(engine, field) == expected


# What a surface may still name by hand: the options the code handles as special cases.


def _names_in(func) -> set[str]:
    """Every name a function's code uses: attributes, keywords, parameters, strings."""
    names = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(func)))):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif (isinstance(node, ast.keyword) and node.arg) or isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def _request_reads(func) -> set[str]:
    """The fields a function reads off the request `r` by name (r.x, r.sampling.x,
    r.HasField("x"))."""
    names = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(func)))):
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Attribute) and base.attr == "sampling":
                base = base.value
            if isinstance(base, ast.Name) and base.id == "r":
                names.add(node.attr)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "HasField":
            names |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return names


NAMES = {o.name for o in REQUEST_OPTIONS}


def test_the_sdk_names_no_option_by_hand() -> None:
    """build_request sets the options from the table: its own code names none, and its
    special cases are declared options."""
    assert not _names_in(build_request) & NAMES
    assert set(client_common._SDK_DEFAULTS) | set(client_common._TO_WIRE) <= NAMES


def test_the_router_reads_the_engines_options_through_the_table() -> None:
    """plan_request reads an engine option off the request by hand only where the router
    sets it itself (ROUTER_SET); the others come from `engine_options`."""
    engine = {o.name for o in REQUEST_OPTIONS if o.engine}
    assert engine >= ROUTER_SET
    for func in (plan_request, engine_options):
        assert _request_reads(func) & engine <= ROUTER_SET, func.__name__


def test_client_generate_writes_no_option_flag_by_hand() -> None:
    """The option flags come from the table: client.py's code names none of them."""
    tree = ast.parse(inspect.getsource(cli_client))
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert not strings & {o.cli for o in REQUEST_OPTIONS if o.cli}


def test_the_http_body_maps_only_openais_own_fields_by_hand() -> None:
    """The body's plain options go to the SDK through the table; `_build` names only
    those OpenAI's defaults or the choice decide (NOT_PLAIN)."""
    assert {o.name for o in REQUEST_OPTIONS if o.http} >= NOT_PLAIN
    assert _names_in(CompletionRequest._build) & NAMES <= NOT_PLAIN
