"""Tool calls in a model's own output format, for function calling with `tool_choice`
"auto": the model decides whether to call a tool, and writes the call the way its chat
template taught it. One parser per format (a model family), chosen from the model's
chat template (`parser_for_template`) or named by the operator (`--tool-call-parser`).

A format here is a pair of markers around one call's JSON ({"name", "arguments"}):
Hermes' and Qwen2.5's `<tool_call>{...}</tool_call>` (also Qwen3, Qwen2.5-Coder and
the Hermes models). Everything outside the markers is the answer's text. Llama 3.x's
JSON calls (the whole output is the calls) are `LeadingJsonFormat`; Qwen2.5-Coder's
(Hermes' markers taught, bare or fenced JSON written) are `BareJsonFormat`. The markers
must survive detokenization: the router decodes without special tokens, and Qwen's
`<tool_call>` is an ordinary added token, so it does.

Streamed (`ToolCallStream`), text that may be the start of a marker is held back until
the next piece decides, a call is given out whole once its closing marker arrives (its
arguments are then known to be JSON), and at the end an unclosed call whose JSON is
complete is a call (a model may stop right after it), anything else is text.

`JsonArrayCalls` reads the other shape calls come in: the JSON array that
tool_choice "required" constrains the output to (services/router/tool_calls.py), a
call given out as its element closes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# The most text one call may hold before it is given up as text (a bound on what a
# stream holds back; a real call is a few hundred characters).
MAX_CALL_CHARS = 1 << 20


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallFormat:
    """Calls written as `open` + {"name": ..., "arguments": {...}} + `close`."""

    name: str
    open: str
    close: str

    def call_of(self, body: str) -> ToolCall | None:
        """The call a marked body holds (`call_of_json`)."""
        return call_of_json(body)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output: (its text outside the calls, the calls in order)."""
        return parse_whole(self.stream(), text)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def parse_whole(
    stream: ToolCallStream | LeadingJsonStream | BareJsonStream, text: str
) -> tuple[str, list[ToolCall]]:
    """A whole output through a format's stream: (its text, its calls): one reading
    for whole and streamed answers."""
    content, calls = stream.push(text)
    tail, more = stream.flush()
    return content + tail, calls + more


def call_of_json(body: str, need_arguments: bool = False) -> ToolCall | None:
    """The call a JSON object {"name", "arguments"} (or "parameters") holds (None: not
    one: no JSON object with a string name; `need_arguments`: or without arguments)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if need_arguments and not ({"arguments", "parameters"} & obj.keys()):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class JsonArrayCalls:
    """A JSON array of calls ([{"name", "arguments"}, ...], tool_choice "required"'s
    output) split into its calls as each element completes: a scan of the JSON's
    nesting and strings, so each call is given out once its closing brace arrives."""

    def __init__(self) -> None:
        self.text: list[str] = []  # everything pushed
        self._element: list[str] = []  # the element being read (depth 2 and below)
        self._depth = 0
        self._in_string = self._escaped = False

    def push(self, text: str) -> list[ToolCall]:
        calls = []
        self.text.append(text)
        for ch in text:
            if self._depth >= 2:
                self._element.append(ch)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
                if self._depth == 2:
                    self._element = [ch]
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 1:
                    call = call_of_json("".join(self._element))
                    if call is not None:
                        calls.append(call)
                    self._element = []
        return calls


@dataclass(frozen=True)
class LeadingJsonFormat:
    """Calls written as the whole output: JSON objects {"name", "parameters"} separated
    by ";" (Llama 3.1-3.3's JSON tool calling; the `<|python_tag|>` some write before
    them is a special token, which the router's decoding drops). An output that does
    not start with "{" is text; one that does is held to the end, then its calls, or
    text if it is not calls only."""

    name: str
    # what a chat template that teaches this format says
    template_marks: tuple[str, ...] = ()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_whole(self.stream(), text)

    def stream(self) -> LeadingJsonStream:
        return LeadingJsonStream()


class LeadingJsonStream:
    """`LeadingJsonFormat` streamed: text given out as it comes unless the output
    starts with "{" (leading whitespace is held until that is known)."""

    def __init__(self) -> None:
        self._held: list[str] = []
        self._json: bool | None = None  # None: not known yet

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._json is False:
            return text, []
        self._held.append(text)
        if self._json is None:
            head = "".join(self._held).lstrip()
            if not head:
                return "", []
            self._json = head.startswith("{")
            if not self._json:
                out, self._held = "".join(self._held), []
                return out, []
        return "", []

    def flush(self) -> tuple[str, list[ToolCall]]:
        text, self._held = "".join(self._held), []
        calls = _json_calls(text) if self._json else None
        return ("", calls) if calls else (text, [])


def _json_calls(text: str, need_arguments: bool = False) -> list[ToolCall] | None:
    """The calls of JSON objects separated by whitespace or ";" (None: not calls only)."""
    decoder, at, calls = json.JSONDecoder(), 0, []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return calls or None
        try:
            _, end = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = call_of_json(text[at:end], need_arguments)
        if call is None:
            return None
        calls.append(call)
        at = end


@dataclass(frozen=True)
class BareJsonFormat:
    """Calls written as bare JSON, beside a marked format: Qwen2.5-Coder's. Its chat
    template teaches Hermes' `<tool_call>` markers (the same template as Qwen2.5's), but
    the Coder models answer a call with the JSON object {"name", "arguments"} alone,
    most often in one ```json fence (measured: benchmarks/README.md, "Function calling
    with the Berkeley Function Calling Leaderboard"; vLLM issue 32926). Marked calls are
    read as `marked` reads them; an output that starts with "{", "[" or "```" is held to
    its end, then its calls if it is calls only (objects, an array of them, or either in
    one fence; each with its arguments), else read as `marked` reads it."""

    name: str
    marked: ToolCallFormat

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_whole(self.stream(), text)

    def stream(self) -> BareJsonStream:
        return BareJsonStream(self.marked)


FENCE = "```"


class BareJsonStream:
    """`BareJsonFormat` streamed: the marked format's stream unless the output starts
    like JSON or a fence (held until that is known, then to the end)."""

    def __init__(self, marked: ToolCallFormat) -> None:
        self._marked = marked.stream()
        self._held: list[str] = []
        self._json: bool | None = None  # None: not known yet

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._json is False:
            return self._marked.push(text)
        self._held.append(text)
        if self._json is None:
            head = "".join(self._held).lstrip()
            if not head or (len(head) < len(FENCE) and FENCE.startswith(head)):
                return "", []
            self._json = head.startswith(("{", "[", FENCE))
            if not self._json:
                held, self._held = "".join(self._held), []
                return self._marked.push(held)
        return "", []

    def flush(self) -> tuple[str, list[ToolCall]]:
        if self._json:
            text, self._held = "".join(self._held), []
            calls = _bare_calls(text)
            if calls:
                return "", calls
            content, calls = self._marked.push(text)
        else:
            held, self._held = "".join(self._held), []
            content, calls = self._marked.push(held)
        tail, more = self._marked.flush()
        return content + tail, calls + more


def _bare_calls(text: str) -> list[ToolCall] | None:
    """The calls of an output that is calls only: JSON objects with a name and
    arguments, or an array of them, bare or in one fence (None: it is not)."""
    body = text.strip()
    if body.startswith(FENCE):
        first_line_end = body.find("\n")
        if first_line_end < 0 or not body.endswith(FENCE) or len(body) < 2 * len(FENCE):
            return None
        body = body[first_line_end + 1 : -len(FENCE)].strip()
    if body.startswith("["):
        try:
            items = json.loads(body)
        except ValueError:
            return None
        if not isinstance(items, list) or not items:
            return None
        calls = [call_of_json(json.dumps(item), need_arguments=True) for item in items]
        return None if None in calls else calls  # type: ignore[return-value]
    return _json_calls(body, need_arguments=True)


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>")
LLAMA3_JSON = LeadingJsonFormat(
    "llama3_json", ('"parameters": dictionary of argument name', "<|python_tag|>")
)
QWEN2_5_CODER = BareJsonFormat("qwen2_5_coder", HERMES)
PARSERS: dict[str, ToolCallFormat | LeadingJsonFormat | BareJsonFormat] = {
    HERMES.name: HERMES,
    LLAMA3_JSON.name: LLAMA3_JSON,
    QWEN2_5_CODER.name: QWEN2_5_CODER,
}
AUTO = "auto"  # --tool-call-parser: choose from the chat template
NONE = "none"  # --tool-call-parser: no format (tool_choice "auto" refused)
PARSER_CHOICES = (AUTO, *PARSERS, NONE)


ToolParser = ToolCallFormat | LeadingJsonFormat | BareJsonFormat


def parser_for_template(
    template: str | None, model_names: tuple[str, ...] = ()
) -> ToolParser | None:
    """The format a chat template teaches its model (None: none SpecPipe knows).
    Qwen2.5-Coder shares Qwen2.5's template but often writes its calls as bare or fenced
    JSON without the markers (vLLM issue 32926), so a model named so (`model_names`: its
    served id, its directory) gets the parser that reads both."""
    if not template:
        return None
    if HERMES.open in template:
        coder = any("qwen2.5-coder" in n.lower() for n in model_names)
        return QWEN2_5_CODER if coder else HERMES
    if any(mark in template for mark in LLAMA3_JSON.template_marks):
        return LLAMA3_JSON
    return None


def choose_parser(
    flag: str, template: str | None, model_names: tuple[str, ...] = ()
) -> ToolParser | None:
    """`--tool-call-parser` (`PARSER_CHOICES`) applied to a model's chat template."""
    if flag == AUTO:
        return parser_for_template(template, model_names)
    if flag == NONE:
        return None
    try:
        return PARSERS[flag]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {flag!r}: one of {', '.join(PARSER_CHOICES)}"
        ) from None


class ToolCallStream:
    """Splits streamed output into text and calls (see the module's docstring)."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self._held = ""  # text that may begin an opening marker
        self._call: str | None = None  # inside a call: its text since the marker
        self._after_call = False  # whitespace after a call separates it: dropped

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """(text safe to give out now, calls completed by this piece)."""
        out: list[str] = []
        calls: list[ToolCall] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self._call is None:
                at = buf.find(self.fmt.open)
                if at < 0:
                    keep = _partial(buf, self.fmt.open)
                    out.append(self._text(buf[: len(buf) - keep]))
                    self._held = buf[len(buf) - keep :]
                    break
                out.append(self._text(buf[:at]))
                self._call, buf = "", buf[at + len(self.fmt.open) :]
                continue
            body = self._call + buf
            end = body.find(self.fmt.close)
            if end < 0:
                if len(body) > MAX_CALL_CHARS:  # not a call: give it out as text
                    out.append(self._text(self.fmt.open + body))
                    self._call = None
                else:
                    self._call = body
                break
            call = self.fmt.call_of(body[:end])
            if call is None:  # marked, but no call: the model's text
                out.append(self._text(self.fmt.open + body[: end + len(self.fmt.close)]))
            else:
                calls.append(call)
                self._after_call = True
            self._call, buf = None, body[end + len(self.fmt.close) :]
        return "".join(out), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: what was held back, as text or a last call."""
        held, call, self._held, self._call = self._held, self._call, "", None
        if call is None:
            return self._text(held), []
        parsed = self.fmt.call_of(call)
        if parsed is not None:
            return "", [parsed]
        return self._text(self.fmt.open + call), []

    def _text(self, text: str) -> str:
        """Text given out, in order, less the whitespace right after a call."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text


def _partial(buf: str, marker: str) -> int:
    """Length of the longest end of `buf` that begins `marker`."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0
