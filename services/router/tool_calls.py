"""Function calling on /v1/chat/completions: `tools`, `tool_choice` and
`parallel_tool_calls` (OpenAI's fields), checked; and each choice's output turned into
`message.tool_calls` (streamed: `delta.tool_calls`) and finish_reason "tool_calls".

The tools always go through the model's chat template (`TextCodec.encode_chat`), so the
model sees them as it was trained to, whatever the choice. Then:
- "none": the output is text.
- "auto": the model decides; its calls are parsed from its own format
  (`common/spec/tool_parsers.py`, chosen from the chat template or by
  `--tool-call-parser`); without a known format "auto" is refused (400).
- a named function: the output is constrained by the grammar engine to the function's
  arguments (its `parameters` JSON schema): one call of that function.
- "required": constrained to a JSON array of at least one {"name": one of the tools,
  "arguments": that tool's schema} (at most one with `parallel_tool_calls: false`).
The constrained forms use the structured-output machinery as a response_format
(`common/spec/grammar.py`): a schema the grammar engine cannot use is a 400 naming it.
Their JSON is written with json.dumps' separators (", " and ": ", no other
whitespace): the layout models see in their training data, and a bound on the output.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from specpipe.common.spec.grammar import JSON_SCHEMA, GrammarError, ResponseFormat
from specpipe.common.spec.tool_parsers import (
    JsonArrayCalls,
    LeadingJsonStream,
    ToolCall,
    ToolCallStream,
    ToolParser,
)
from specpipe.v1 import generation_pb2 as gen

from .openai_compat import ChatMessage, bad_request

NONE, AUTO, REQUIRED, FUNCTION = "none", "auto", "required", "function"
MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's function names (and dots)
# The layout of constrained calls' JSON (llguidance's "x-guidance" options).
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """A chat request's tools and what it lets the model do with them."""

    tools: list[dict[str, Any]]  # OpenAI's tool objects, checked
    mode: str = AUTO  # NONE, AUTO, REQUIRED or FUNCTION
    function: str = ""  # FUNCTION: the one to call
    parallel: bool = True  # several calls in one answer
    parser: ToolParser | None = None  # AUTO: the model's own format
    schemas: dict[str, Any] = field(default_factory=dict)  # name -> parameters

    @classmethod
    def of(
        cls,
        tools: Any,
        tool_choice: Any,
        parallel: bool | None,
        parser: ToolParser | None,
    ) -> ToolChoice | None:
        """The request's function calling (None: no tools and no choice that needs
        them), checked: 400 naming the field otherwise."""
        schemas = _schemas(tools)
        mode, function = _choice(tool_choice, schemas)
        if not schemas:
            if mode in (REQUIRED, FUNCTION):
                raise bad_request(f"tool_choice {mode!r} needs tools", "tool_choice")
            return None
        if mode == AUTO and parser is None:
            raise bad_request(
                'tool_choice "auto" needs the model\'s tool-call format, and its chat template '
                "has none SpecPipe knows (start the router with --tool-call-parser to name "
                'one, or use tool_choice "required" or a named function)',
                "tool_choice",
            )
        choice = cls(list(tools), mode, function, parallel is not False, parser, schemas)
        choice.check_grammar()
        return choice

    @property
    def constrains(self) -> bool:
        return self.mode in (REQUIRED, FUNCTION)

    def response_format(self) -> dict[str, Any] | None:
        """The json_schema response_format the output is constrained by (None: none)."""
        if self.mode == FUNCTION:
            schema = _laid_out(self.schemas[self.function])
        elif self.mode == REQUIRED:
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name, params in self.schemas.items()
            ]
            schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
                      **({} if self.parallel else {"maxItems": 1}), "x-guidance": LAYOUT}  # fmt: skip
        else:
            return None
        return {"type": JSON_SCHEMA, JSON_SCHEMA: {"name": "tool_calls", "schema": schema}}

    def constrain(self, reqs: list[gen.GenerateRequest]) -> None:
        """Put the calls' grammar on each choice's request."""
        fmt = ResponseFormat.from_openai(self.response_format())
        for req in reqs:
            req.response_format.type, req.response_format.schema = fmt.type, fmt.schema

    def check_grammar(self) -> None:
        """A schema the grammar engine cannot use: 400 with its reason."""
        value = self.response_format()
        if value is None:
            return
        try:
            ResponseFormat.from_openai(value).grammar_text()
        except GrammarError as e:
            raise bad_request(f"the tools' parameters cannot constrain the output: {e}",
                              "tools") from None  # fmt: skip

    def answer(self) -> ToolAnswer:
        """What one choice's output becomes."""
        return ToolAnswer(self)


class ToolAnswer:
    """One choice's output as text and calls, whole (`message`) or streamed (`push`,
    `flush`: text to give out and `delta.tool_calls` entries)."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.calls: list[tuple[str, ToolCall]] = []  # (id, call) given out so far
        self._stream: ToolCallStream | LeadingJsonStream | None = None
        if choice.mode == AUTO and choice.parser is not None:
            self._stream = choice.parser.stream()
        self._array = JsonArrayCalls() if choice.mode == REQUIRED else None

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        mode = self.choice.mode
        if mode == FUNCTION:
            return "", self._arguments(text)
        if self._array is not None:
            return "", self._given(self._array.push(text))
        if self._stream is None:
            return text, []
        content, calls = self._stream.push(text)
        return content, self._given(calls)

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        mode = self.choice.mode
        if mode == FUNCTION:
            return "", self._arguments("") if not self.calls else []
        if self._array is not None:  # cut short before a call completed: the text
            return ("", []) if self.calls else ("".join(self._array.text), [])
        if self._stream is None:
            return "", []
        content, calls = self._stream.flush()
        return content, self._given(calls)

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer's `message` for its output `text`."""
        content = self.push(text)[0] + self.flush()[0]
        if not self.calls:
            return {"role": "assistant", "content": content}
        calls = [
            {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in self.calls
        ]
        return {"role": "assistant", "content": content or None, "tool_calls": calls}

    def finish_reason(self, reason: str) -> str:
        """ "tool_calls" for an answer that ended with its calls (not cut short)."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        """FUNCTION: the arguments as they come, in one call of the named function."""
        if self.calls:
            call_id, call = self.calls[0]
            self.calls[0] = (call_id, ToolCall(call.name, call.arguments + text))
            return [{"index": 0, "function": {"arguments": text}}] if text else []
        deltas = self._given([ToolCall(self.choice.function, text)])
        return deltas

    def _given(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """Record `calls` (without parallel calls, only the first of the answer) and
        return their `delta.tool_calls` entries."""
        deltas = []
        for call in calls:
            if self.calls and not self.choice.parallel:
                break
            call_id = f"call_{secrets.token_hex(12)}"
            deltas.append({"index": len(self.calls), "id": call_id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}})  # fmt: skip
            self.calls.append((call_id, call))
        return deltas


def _laid_out(schema: Any) -> Any:
    """`schema` with the calls' JSON layout, unless it sets its own."""
    if isinstance(schema, dict) and "x-guidance" not in schema:
        return {**schema, "x-guidance": LAYOUT}
    return schema


def _schemas(tools: Any) -> dict[str, Any]:
    """name -> parameters schema of OpenAI's `tools` list, checked."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    schemas: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != FUNCTION:
            raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}',
                              "tools")  # fmt: skip
        fn = tool.get(FUNCTION)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}.function needs a name", "tools")
        name = fn["name"]
        if not NAME.match(name):
            raise bad_request(
                f"{where}.function.name {name!r} must be 1-64 letters, digits, '_', '-' or '.'",
                "tools",
            )
        if name in schemas:
            raise bad_request(f"two tools are named {name!r}", "tools")
        params = fn.get("parameters", NO_PARAMETERS)
        if not isinstance(params, dict | bool):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                              "tools")  # fmt: skip
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request(f"{where}.function.description must be text", "tools")
        schemas[name] = params
    return schemas


def _choice(value: Any, schemas: dict[str, Any]) -> tuple[str, str]:
    """(mode, function) of OpenAI's `tool_choice` (default: auto with tools)."""
    if value is None:
        return (AUTO if schemas else NONE), ""
    if value in (NONE, AUTO, REQUIRED):
        return value, ""
    name = None
    if isinstance(value, dict) and value.get("type") == FUNCTION:
        fn = value.get(FUNCTION)
        name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}',
            "tool_choice",
        )
    if schemas and name not in schemas:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools",
                          "tool_choice")  # fmt: skip
    return FUNCTION, name


def rendered_conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages for the chat template, with their function-calling fields."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    return [{**m.rendered(), **conversation_fields(m)} for m in messages]


def conversation_fields(message: Any) -> dict[str, Any]:
    """A chat message's function-calling fields as chat templates read them: an
    assistant's `tool_calls` (their arguments as objects, as templates dump them), a
    tool result's `tool_call_id` and `name`."""
    extra = message.model_extra or {}
    out: dict[str, Any] = {}
    calls = extra.get("tool_calls")
    if calls is not None:
        if message.role != "assistant" or not isinstance(calls, list):
            raise bad_request("tool_calls must be a list, on assistant messages", "messages")
        out["tool_calls"] = [_rendered_call(c) for c in calls]
    for key in ("tool_call_id", "name"):
        value = extra.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise bad_request(f"a message's {key} must be text", "messages")
            out[key] = value
    return out


def _rendered_call(call: Any) -> dict[str, Any]:
    fn = call.get(FUNCTION) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request('a tool call must be {"type": "function", "function": {"name": '
                          '..., "arguments": "..."}}', "messages")  # fmt: skip
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):  # else the template gets the text as it is
            args = json.loads(args)
    rendered = {"type": FUNCTION, FUNCTION: {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        rendered["id"] = call["id"]
    return rendered
