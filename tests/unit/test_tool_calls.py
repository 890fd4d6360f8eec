"""Function calling without a deployment: the Hermes/Qwen tool-call parser on text
(whole and split at every point), the checks of `tools` and `tool_choice`, the grammar
of "required" and named calls, and the answers' shapes."""

from __future__ import annotations

import itertools
import json

import llguidance
import pytest
from hypothesis import given
from hypothesis import strategies as st
from specpipe.common.spec.grammar import ResponseFormat
from specpipe.common.spec.tool_parsers import (
    HERMES,
    ToolCall,
    choose_parser,
    parser_for_template,
)
from specpipe.services.router.openai_compat import ApiError, ChatCompletionRequest
from specpipe.services.router.tool_calls import (
    AUTO,
    FUNCTION,
    NONE,
    REQUIRED,
    ToolChoice,
    rendered_conversation,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
QWEN_TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
PARIS = ToolCall("get_weather", '{"city": "Paris"}')


# -- the parser ---------------------------------------------------------------------------
def test_hermes_parser_finds_every_call_and_the_text() -> None:
    content, calls = HERMES.parse(QWEN_TEXT)
    assert content == "Let me check.\n"
    assert calls == [PARIS, ToolCall("get_time", "{}")]
    assert HERMES.parse("just text") == ("just text", [])
    # Not a call (no JSON, no name): the model's text, markers included.
    assert HERMES.parse("a <tool_call>oops</tool_call> b") == (
        "a <tool_call>oops</tool_call> b",
        [],
    )
    assert HERMES.parse('<tool_call>{"x": 1}</tool_call>')[1] == []
    # Unclosed at the end: a call when its JSON is complete, else text.
    assert HERMES.parse('<tool_call>{"name": "get_time", "arguments": {}}') == (
        "",
        [ToolCall("get_time", "{}")],
    )
    assert HERMES.parse('<tool_call>{"name": "get_ti') == ('<tool_call>{"name": "get_ti', [])
    # Arguments written as JSON text are the same arguments.
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert HERMES.parse(text)[1] == [ToolCall("f", '{"a": 1}')]


@given(cuts=st.lists(st.integers(0, len(QWEN_TEXT)), max_size=8))
def test_streamed_parsing_equals_parsing_the_whole_text(cuts) -> None:
    bounds = sorted({0, len(QWEN_TEXT), *cuts})
    stream = HERMES.stream()
    content, calls = "", []
    for a, b in itertools.pairwise(bounds):
        text, done = stream.push(QWEN_TEXT[a:b])
        assert "<" not in text  # the start of a marker is held back
        content, calls = content + text, calls + done
    tail, more = stream.flush()
    assert (content + tail, calls + more) == HERMES.parse(QWEN_TEXT)


def test_a_piece_that_may_begin_a_call_is_held_until_decided() -> None:
    stream = HERMES.stream()
    assert stream.push("x <tool") == ("x ", [])
    assert stream.push("box> y") == ("<toolbox> y", [])  # it was not one
    assert stream.flush() == ("", [])


def test_the_parser_is_chosen_from_the_template_or_named() -> None:
    from specpipe.common.spec.tool_parsers import QWEN2_5_CODER

    hermes = "{% for t in tools %}<tool_call>{% endfor %}"
    assert parser_for_template(hermes) is HERMES
    assert parser_for_template(hermes, ("Qwen2.5-7B-Instruct", "q7")) is HERMES
    coder = ("served-name", "qwen2.5-coder-1.5b-instruct")  # its id set by --model-id
    assert parser_for_template(hermes, coder) is QWEN2_5_CODER
    assert choose_parser("auto", hermes, coder) is QWEN2_5_CODER
    assert choose_parser("hermes", hermes, coder) is HERMES  # named: as named
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None
    assert choose_parser("hermes", "") is HERMES and choose_parser("none", "<tool_call>") is None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        choose_parser("llama9", "")


# -- tools and tool_choice ------------------------------------------------------------------
def choice(tool_choice=None, tools=(WEATHER, TIME), parallel=None, parser=HERMES):
    return ToolChoice.of(list(tools) if tools is not None else None, tool_choice, parallel, parser)


def test_tool_choice_modes() -> None:
    assert choice().mode == AUTO and choice("none").mode == NONE
    assert choice("required").mode == REQUIRED
    named = choice({"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.function) == (FUNCTION, "get_time")
    assert choice(None, tools=None) is None and choice("auto", tools=None) is None
    assert not choice().constrains and choice("required").constrains


@pytest.mark.parametrize(
    "tools, tool_choice, parser, fragment",
    [
        ("weather", None, None, "needs the model's tool-call format"),
        (None, "required", HERMES, "tool_choice 'required' needs tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, HERMES, "not among"),
        ([WEATHER], "sometimes", HERMES, "tool_choice must be"),
        ([WEATHER], {"type": "function"}, HERMES, "tool_choice must be"),
        ([{"type": "retrieval"}], None, HERMES, '"type": "function"'),
        ([{"type": "function", "function": {}}], None, HERMES, "needs a name"),
        ([{"type": "function", "function": {"name": "a b"}}], None, HERMES, "must be 1-64"),
        ([WEATHER, WEATHER], None, HERMES, "two tools are named"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], None, HERMES,
         "JSON schema object"),
        ([WEATHER] * 129, None, HERMES, "at most 128 tools"),
        ({"tools": 1}, None, HERMES, "must be a list"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(tools, tool_choice, parser, fragment) -> None:
    tools = [WEATHER] if tools == "weather" else tools
    with pytest.raises(ApiError) as info:
        ToolChoice.of(tools, tool_choice, None, parser)
    assert info.value.status == 400 and fragment in info.value.message
    assert info.value.param in ("tools", "tool_choice")


def test_a_schema_the_grammar_engine_cannot_use_is_refused_with_its_reason() -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
           "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}}}  # fmt: skip
    with pytest.raises(ApiError) as info:
        choice("required", tools=[bad])
    assert info.value.status == 400 and info.value.param == "tools"
    assert "cannot constrain the output" in info.value.message


def grammar_accepts(fmt: dict, text: str) -> bool:
    """Whether the response_format's grammar accepts `text` as a whole output."""
    grammar = ResponseFormat.from_openai(fmt).grammar_text()
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    ok = all(m.consume_token(b) for b in text.encode())
    return ok and m.is_accepting()


class _Bytes:
    """A byte-level tokenizer for llguidance: token i is byte i, 256 the end."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([i]) for i in range(256)] + [b"\xff</s>"]

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


def test_required_and_named_grammars_accept_exactly_calls_of_the_tools() -> None:
    required = choice("required").response_format()
    assert grammar_accepts(required, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    two = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "A"}}]'
    assert grammar_accepts(required, two)
    assert not grammar_accepts(required, "[]")  # at least one call
    assert not grammar_accepts(required, '[{"name": "get_weather", "arguments": {}}]')  # city
    assert not grammar_accepts(required, '[{"name": "rm_rf", "arguments": {}}]')
    assert not grammar_accepts(required, '[{"name":"get_time","arguments":{}}]')  # the layout
    single = choice("required", parallel=False).response_format()
    assert not grammar_accepts(single, two)
    named = choice({"type": "function", "function": {"name": "get_weather"}}).response_format()
    assert grammar_accepts(named, '{"city": "Oslo", "days": 3}')
    assert not grammar_accepts(named, '{"days": 3}')


# -- answers ----------------------------------------------------------------------------------
def test_auto_answers_carry_the_calls_and_finish_with_tool_calls() -> None:
    answer = choice().answer()
    message = answer.message(QWEN_TEXT)
    assert message["content"] == "Let me check.\n"
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"]) for c in calls] == [
        ("function", "get_weather"),
        ("function", "get_time"),
    ]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert len({c["id"] for c in calls}) == 2 and calls[0]["id"].startswith("call_")
    assert (
        answer.finish_reason("stop") == "tool_calls" and answer.finish_reason("length") == "length"
    )
    plain = choice().answer()
    assert plain.message("hi") == {"role": "assistant", "content": "hi"}
    assert plain.finish_reason("stop") == "stop"
    # Without parallel calls, the first only.
    assert len(choice(parallel=False).answer().message(QWEN_TEXT)["tool_calls"]) == 1
    # "none": the text as it is.
    assert choice("none").answer().message(QWEN_TEXT)["content"] == QWEN_TEXT


def test_named_and_required_answers() -> None:
    named = choice({"type": "function", "function": {"name": "get_weather"}}).answer()
    first, deltas = named.push('{"city"')
    assert first == "" and deltas[0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert named.push(': "Rome"}')[1] == [{"index": 0, "function": {"arguments": ': "Rome"}'}}]
    assert named.flush() == ("", [])
    assert named.calls[0][1] == ToolCall("get_weather", '{"city": "Rome"}')
    required = choice("required").answer()
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "A"}}]'
    # Each call is given out once its element's closing brace arrives.
    close = text.index("}, {")  # the first element's closing brace
    assert required.push(text[:close]) == ("", [])
    _, deltas = required.push(text[close : close + 6])
    assert [(d["index"], d["function"]["name"]) for d in deltas] == [(0, "get_time")]
    _, deltas = required.push(text[close + 6 :])
    assert [(d["index"], d["function"]["name"]) for d in deltas] == [(1, "get_weather")]
    assert json.loads(deltas[0]["function"]["arguments"]) == {"city": "A"}
    assert required.flush() == ("", [])
    cut = choice("required").answer()  # cut short by max_tokens: the text, no calls
    assert cut.message('[{"name": "get_ti') == {"role": "assistant", "content": '[{"name": "get_ti'}
    half = choice("required").answer()  # after a whole call: that call
    message = half.message('[{"name": "get_time", "arguments": {}}, {"name": "get_w')
    assert message["content"] is None and len(message["tool_calls"]) == 1
    # Braces and quotes inside strings do not end an element.
    tricky = '[{"name": "get_weather", "arguments": {"city": "a}\\"]{"}}]'
    (call,) = choice("required").answer().message(tricky)["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": 'a}"]{'}


def test_tool_messages_and_assistant_calls_reach_the_template() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ]
        }
    )  # fmt: skip
    user, assistant, tool = rendered_conversation(body.messages)
    assert user == {"role": "user", "content": "weather?"}
    assert assistant["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]  # fmt: skip
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    bad = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}
    )
    with pytest.raises(ApiError, match="on assistant messages"):
        rendered_conversation(bad.messages)


# -- through the app and the official client (a scripted router) ------------------------------
@pytest.fixture(scope="module")
def tool_codec(tmp_path_factory):
    """The char tokenizer with a chat template in Qwen's tool-call format."""
    from specpipe.common.text import TextCodec

    from tests.integration.conftest import TOOL_CHAT_TEMPLATE, add_char_tokenizer

    d = add_char_tokenizer(tmp_path_factory.mktemp("tool_tok"), TOOL_CHAT_TEMPLATE)
    return TextCodec.from_dir(d)


def scripted(texts: list[str], seen: list | None = None):
    """A router's generate that emits `texts` (one token each) and stops."""
    from specpipe.v1 import generation_pb2 as gen

    async def script(req):
        if seen is not None:
            seen.append(req)
        yield gen.GenerateResponse(started=gen.Started(request_id="r-1", prompt_tokens=5))
        for i, t in enumerate(texts):
            yield gen.GenerateResponse(delta=gen.TokenDelta(token_ids=[i], text=t, index=i))
        yield gen.GenerateResponse(
            finished=gen.Finished(
                finish_reason="stop",
                usage=gen.Usage(prompt_tokens=5, completion_tokens=len(texts), cached_tokens=2),
            )
        )

    return script


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def test_auto_calls_through_the_client_streamed_and_not(tool_codec) -> None:
    from .test_http_api import with_app

    async def fn(client, router):
        kw = dict(model="m", messages=[{"role": "user", "content": "weather?"}],
                  tools=[WEATHER, TIME])  # fmt: skip
        full = await client.chat.completions.create(**kw)
        stream = await client.chat.completions.create(stream=True, **kw)
        chunks = [c async for c in stream]
        return full, chunks

    full, chunks = with_app(scripted(pieces(QWEN_TEXT, 7)), fn, codec=tool_codec)
    (c,) = full.choices
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check.\n"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]  # fmt: skip
    assert full.usage.prompt_tokens_details.cached_tokens == 2
    content, calls = "", {}
    for chunk in chunks:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            assert "<" not in (ch.delta.content or "")  # the markers never show
            for t in ch.delta.tool_calls or []:
                calls.setdefault(t.index, [t.id, t.function.name, ""])
                calls[t.index][2] += t.function.arguments or ""
    assert content == "Let me check.\n" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]  # fmt: skip


def test_named_and_required_constrain_the_request(tool_codec) -> None:
    from .test_http_api import with_app

    seen: list = []
    named_text = ['{"city": ', '"Oslo"}']

    async def fn(client, router):
        kw = dict(model="m", messages=[{"role": "user", "content": "weather?"}],
                  tools=[WEATHER, TIME])  # fmt: skip
        named = await client.chat.completions.create(
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw
        )
        stream = await client.chat.completions.create(
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
            **kw,
        )  # fmt: skip
        chunks = [c async for c in stream]
        with pytest.raises(openai.BadRequestError, match="response_format cannot be combined"):
            await client.chat.completions.create(
                tool_choice="required", response_format={"type": "json_object"}, **kw
            )
        with pytest.raises(openai.BadRequestError, match="not among the tools"):
            await client.chat.completions.create(
                tool_choice={"type": "function", "function": {"name": "x"}}, **kw
            )
        return named, chunks

    import openai

    named, chunks = with_app(scripted(named_text, seen), fn, codec=tool_codec)
    (c,) = named.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Oslo"}'
    # The request carries the named function's schema as its grammar, the prompt the tools.
    fmt = seen[0].response_format
    assert fmt.type == "json_schema" and json.loads(fmt.schema)["required"] == ["city"]
    assert seen[0].WhichOneof("prompt") == "token_ids"
    streamed = "".join(t.function.arguments or "" for ch in chunks for c in ch.choices
                       for t in c.delta.tool_calls or [])  # fmt: skip
    assert streamed == '{"city": "Oslo"}'
    # continuous_usage_stats: usage on every chunk, counting up.
    assert all(ch.usage is not None for ch in chunks)
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 2


def test_tools_render_through_the_template(tool_codec) -> None:
    ids = tool_codec.encode_chat(
        [{"role": "user", "content": "hi"}], [WEATHER], add_generation_prompt=True
    )
    text = tool_codec.decode(ids)
    assert text == "[tools]get_weather;<tool_call>|[user]hi|[assistant]"


def test_llama3_json_calls_are_the_whole_output() -> None:
    from specpipe.common.spec.tool_parsers import LLAMA3_JSON

    two = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    assert LLAMA3_JSON.parse(two) == ("", [PARIS, ToolCall("get_time", "{}")])
    assert LLAMA3_JSON.parse(" \n" + two)[1] == [PARIS, ToolCall("get_time", "{}")]
    assert LLAMA3_JSON.parse("Sunny, {no}") == ("Sunny, {no}", [])
    assert LLAMA3_JSON.parse('{"city": "Paris"}') == ('{"city": "Paris"}', [])  # no name
    assert LLAMA3_JSON.parse('{"name": "get_ti') == ('{"name": "get_ti', [])  # cut short
    stream = LLAMA3_JSON.stream()
    assert stream.push("  ") == ("", []) and stream.push("Hi") == ("  Hi", [])
    assert stream.push(" there") == (" there", []) and stream.flush() == ("", [])
    stream = LLAMA3_JSON.stream()
    assert stream.push('{"name": "get_time",') == ("", [])
    assert stream.push(' "parameters": {}}') == ("", [])
    assert stream.flush() == ("", [ToolCall("get_time", "{}")])
    template = 'Respond as {"name": function name, "parameters": dictionary of argument name and its value}'
    assert parser_for_template(template) is LLAMA3_JSON
    assert parser_for_template("{{ '<|python_tag|>' }}") is LLAMA3_JSON
    assert choose_parser("llama3_json", "") is LLAMA3_JSON
    answer = choice(parser=LLAMA3_JSON).answer()
    assert [c["function"]["name"] for c in answer.message(two)["tool_calls"]] == [
        "get_weather",
        "get_time",
    ]
    assert answer.finish_reason("stop") == "tool_calls"


CODER_FENCED = (
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
)


def test_qwen2_5_coder_calls_are_bare_or_fenced_json_or_marked() -> None:
    """Qwen2.5-Coder answers a call as bare JSON, mostly fenced (seen on bfcl's cases)."""
    from specpipe.common.spec.tool_parsers import QWEN2_5_CODER

    get_time = ToolCall("get_time", "{}")
    assert QWEN2_5_CODER.parse(CODER_FENCED) == ("", [PARIS])
    assert QWEN2_5_CODER.parse("\n" + CODER_FENCED + "\n") == ("", [PARIS])
    assert QWEN2_5_CODER.parse('```\n{"name": "get_time", "arguments": {}}\n```')[1] == [get_time]
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "get_time", "arguments": {}}'
    assert QWEN2_5_CODER.parse(bare) == ("", [PARIS, get_time])
    array = '```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}]\n```'
    assert QWEN2_5_CODER.parse(array) == ("", [PARIS])
    assert QWEN2_5_CODER.parse(QWEN_TEXT) == HERMES.parse(QWEN_TEXT)  # Hermes' markers too
    # Not calls only: text, as it was written.
    for text in (
        '```json\n{"name": "Bob", "age": 3}\n```',  # JSON without arguments: an answer
        '```python\nprint("hi")\n```',
        '```json\n{"name": "get_time", "arguments": {}}\n```\nDone.',
        '{"name": "get_ti',
        "[1, 2]",
        "``",
        "Sure: ```json\n{}\n```",
    ):
        assert QWEN2_5_CODER.parse(text) == (text, []), text
    assert choose_parser("qwen2_5_coder", "") is QWEN2_5_CODER


@given(cuts=st.lists(st.integers(0, len(CODER_FENCED)), max_size=8))
def test_qwen2_5_coder_streamed_equals_whole(cuts) -> None:
    from specpipe.common.spec.tool_parsers import QWEN2_5_CODER

    for whole in (CODER_FENCED, QWEN_TEXT, "`` not a fence"):
        bounds = sorted({0, len(whole), *(c for c in cuts if c < len(whole))})
        stream = QWEN2_5_CODER.stream()
        content, calls = "", []
        for a, b in itertools.pairwise(bounds):
            text, done = stream.push(whole[a:b])
            assert "`" not in text or not whole.startswith("```")  # a fence is held
            content, calls = content + text, calls + done
        tail, more = stream.flush()
        assert (content + tail, calls + more) == QWEN2_5_CODER.parse(whole)


def test_qwen2_5_coder_auto_answer_carries_the_fenced_call() -> None:
    from specpipe.common.spec.tool_parsers import QWEN2_5_CODER

    answer = choice(parser=QWEN2_5_CODER).answer()
    message = answer.message(CODER_FENCED)
    assert message["content"] is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ] == [("get_weather", {"city": "Paris"})]
    assert answer.finish_reason("stop") == "tool_calls"


def test_qwen2_5_coder_fenced_calls_through_the_client_streamed_and_not(tool_codec) -> None:
    """`--tool-call-parser qwen2_5_coder`: the fenced call Qwen2.5-Coder writes comes back
    as a call, whole and streamed, and no piece of the fence shows as content."""
    from .test_http_api import with_app

    async def fn(client, router):
        kw = dict(model="m", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER])
        full = await client.chat.completions.create(**kw)
        chunks = [c async for c in await client.chat.completions.create(stream=True, **kw)]
        return full, chunks

    full, chunks = with_app(
        scripted(pieces(CODER_FENCED, 3)), fn, codec=tool_codec, tool_call_parser="qwen2_5_coder"
    )
    (c,) = full.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    content = "".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices)
    streamed = [t for chunk in chunks for ch in chunk.choices for t in ch.delta.tool_calls or []]
    assert content == "" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
        ("get_weather", {"city": "Paris"})
    ]
