"""OpenAI's request and response shapes, and their translation to and from the
Generation API (`GenerateRequest` in, `GenerateResponse` events out). No HTTP here:
`http_api` serves these; everything in this module can be tested without a server.

Requests are pydantic models, so a malformed body is refused field by field (400, never
500): integers must fit the Generation API's fields (int64; `priority` int32) and text
must be valid Unicode (JSON's "\ud800" escape is a lone surrogate, which is not). Fields of
OpenAI's API that SpecPipe cannot honour (best_of > n, ...) are
refused with 400 when set to anything but their default; unknown fields are ignored,
as OpenAI-compatible servers do. `response_format` (json_object, json_schema) constrains
the output with a grammar (common/spec/grammar.py); chat's `tools` (function calling)
are checked and answered by tool_calls.py (on text completions they are refused).

Logprobs (chat: `logprobs` + `top_logprobs`; completions: `logprobs`, with `echo` the
prompt's too) are the target's own: log_softmax of its raw logits at each token's
position, before temperature, top-k and top-p (vLLM's default `raw_logprobs`), computed
by the last stage where it draws the token. The penalties (`frequency_penalty`,
`presence_penalty`, vLLM's `repetition_penalty`), `logit_bias` and vLLM's `min_tokens`
apply where each token is drawn (common/spec/penalties.py). `n` choices are `n` requests, choice i
seeded seed + i (without a seed, each its own random seed); they are started after the
first choice's prefill, so that they find its prompt in every stage's prefix cache. SpecPipe's own options are extra body fields (`mode`,
`width`, `layers_per_step`, `token_source`, `ranking`, `growth`, `top_k_children`,
`depth`, `prefill_chunk`, `top_k`, `ignore_eos`, `priority`, `stop_token_ids`,
`return_token_ids` (the completion's token ids, also in every streamed chunk),
`resume_token_ids` (a resume: the token ids already received; docs/api.md);
vLLM's `repetition_penalty` and `min_tokens`;
`width`, `layers_per_step` and `token_source` take "auto": the router's choice).

One module: every OpenAI request and response shape and its translation, so that the
HTTP API's contract is read in one file.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import grpc
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from specpipe.common.spec.grammar import GrammarError, ResponseFormat
from specpipe.common.spec.options import MAX_LOGPROBS
from specpipe.common.spec.request_options import REQUEST_OPTIONS
from specpipe.common.spec.sampling import SamplingParams
from specpipe.v1 import dataplane_pb2 as pb
from specpipe.v1 import generation_pb2 as gen

from ..client.common import build_request
from .requests import StopGeneration

# OpenAI's defaults: 16 new tokens for text completions, sampling at temperature 1.
DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string (the stop matcher holds back up to this much text)
# `n`: choices of one request, each a generation of its own (OpenAI allows 128; each
# choice takes a running slot and its KV cache).
MAX_CHOICES = 16
# What JSON carries for a logprob of -inf (JSON has no infinities), as OpenAI and vLLM.
MIN_LOGPROB = -9999.0

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    @classmethod
    def from_status(cls, code: grpc.StatusCode, message: str) -> ApiError:
        status = HTTP_STATUS.get(code, 500)
        if code == grpc.StatusCode.NOT_FOUND and "model" in message:
            return cls(status, message, "model_not_found", "model")
        return cls(status, message, code.name.lower())

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "server_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


# -- requests ------------------------------------------------------------------------------
INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1


def _valid_unicode(text: str) -> str:
    """Text a protobuf string field and a tokenizer take: no lone surrogates."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"the text has a lone surrogate ({text[e.start]!r}) at character {e.start}: "
                "it is not valid Unicode"
            ) from None
    return text


# The Generation API's field types: larger values are refused with 400 by the schema.
Int64 = Annotated[int, Field(ge=-(1 << 63), le=INT64_MAX)]
Int32 = Annotated[int, Field(ge=-(1 << 31), le=INT32_MAX)]
Text = Annotated[str, AfterValidator(_valid_unicode)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's: usage (so far) on every chunk (aiperf's --per-chunk-usage)
    continuous_usage_stats: bool = False


# Fields OpenAI defines that SpecPipe does not implement: refused unless at these values.
_UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
    "audio": (None,),
    "prediction": (None,),
}


# What to use instead, where there is something.
_TOOLS_HINT = " on /v1/completions: function calling is on /v1/chat/completions"
_UNSUPPORTED_HINTS = {
    "tools": _TOOLS_HINT,
    "tool_choice": _TOOLS_HINT,
    "functions": " (OpenAI's deprecated field): use tools on /v1/chat/completions",
}


def check_response_format(value: dict[str, Any] | None) -> None:
    """OpenAI's response_format shape (400 naming the problem); the router compiles the
    schema itself and refuses one the grammar library cannot use (400 too)."""
    try:
        ResponseFormat.from_openai(value)
    except GrammarError as e:
        raise bad_request(str(e), "response_format") from None


class _Common(BaseModel):
    """What chat and text completions share (OpenAI's fields, then SpecPipe's)."""

    model_config = ConfigDict(extra="allow")

    model: Text = ""
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    # SpecPipe's own.
    mode: Text | None = None
    width: Int64 | Literal["auto"] | None = None
    layers_per_step: Int64 | Literal["auto"] | None = None
    token_source: Text = ""
    ranking: Text = ""
    growth: Text = ""
    top_k_children: Int64 | None = None
    depth: Int64 | None = None
    prefill_chunk: Int64 | None = None
    top_k: Int64 | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int64] = Field(default_factory=list)
    return_token_ids: bool = False
    # A resume: the completion's token ids already received (`return_token_ids`), one
    # list per choice with n > 1; the output continues exactly after them.
    resume_token_ids: list[Int64] | list[list[Int64]] = Field(default_factory=list)
    priority: Int32 = 0
    # structured output (OpenAI's shape; `check_response_format`)
    response_format: dict[str, Any] | None = None
    # the logits rules (OpenAI's penalties and logit_bias, vLLM's repetition_penalty and
    # min_tokens; common/spec/penalties.py), checked by `check_logits_rules`
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[Int64, float] | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    cache_salt: Text = ""  # vLLM's: the prefix-cache namespace (services/router/cache_scope.py)

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    def top_logprobs_wanted(self) -> int | None:
        """Top alternatives to report with each generated token (None: no logprobs)."""
        return None

    def prompt_logprobs_wanted(self) -> int | None:
        """Top alternatives to report with each prompt token (None: none)."""
        return None

    def check(self) -> None:
        """Refuse what the model validates but SpecPipe cannot do."""
        if not 1 <= self.choices <= MAX_CHOICES:
            raise bad_request(f"n must be in [1, {MAX_CHOICES}], got {self.n}", "n")
        best_of = (self.model_extra or {}).get("best_of")
        if best_of is not None and best_of != self.choices:
            raise bad_request(
                f"best_of must equal n ({self.choices}) or be left out: SpecPipe returns every "
                "choice it generates (rank the n choices by their logprobs instead)",
                "best_of",
            )
        for name, allowed in _UNSUPPORTED_UNLESS.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and value not in allowed:
                hint = _UNSUPPORTED_HINTS.get(name, "")
                raise bad_request(f"{name} is not supported by SpecPipe{hint}", name)
        check_response_format(self.response_format)
        self.check_logits_rules()
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options needs stream: true", "stream_options")
        self.stops  # noqa: B018 (validates)

    def check_logits_rules(self) -> None:
        """The penalties and the bias by the engine's own checks (`SamplingParams`), each
        refused with 400 naming its field; the router checks them again, and the bias'
        token ids against the vocabulary."""
        for name in ("frequency_penalty", "presence_penalty", "logit_bias", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                try:
                    SamplingParams(**{name: value})
                except ValueError as e:
                    raise bad_request(str(e), name) from None
        if self.min_tokens < 0:
            raise bad_request(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")

    @property
    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise bad_request("stop strings must not be empty", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise bad_request(f"a stop string has more than {MAX_STOP_CHARS} characters", "stop")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far on every streamed chunk (vLLM's continuous_usage_stats)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def to_requests(
        self, prompt: str | Sequence[int], default_max_tokens: int, default_mode: str
    ) -> list[gen.GenerateRequest]:
        """One request per choice (`n`): choice i draws with seed + i (without a seed,
        sampled choices each get a random seed of their own; greedy ones are the same).
        Only the first asks for the prompt's logprobs (the prompt is the same)."""
        name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        max_new = getattr(self, name)
        if max_new is not None and max_new <= 0:
            raise bad_request(f"{name} must be positive, got {max_new}", name)
        most = default_max_tokens if max_new is None else max_new
        if self.min_tokens > most:
            raise bad_request(
                f"min_tokens ({self.min_tokens}) must be at most {name} ({most})", "min_tokens"
            )
        temperature = DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        if self.seed is None:  # OpenAI: without a seed, every sampled request differs
            seeds = [
                secrets.randbelow(1 << 31) if temperature > 0 else 0 for _ in range(self.choices)
            ]
        else:
            seeds = [self.seed + i for i in range(self.choices)]
            if seeds[-1] > INT64_MAX:
                raise bad_request(f"seed + n - 1 must be at most {INT64_MAX}", "seed")
        text = isinstance(prompt, str)
        resumes = self.resumes()
        reqs = []
        try:
            for i, seed in enumerate(seeds):
                req = self._build(
                    prompt, text, max_new, default_max_tokens, default_mode, temperature, seed
                )
                req.resume_token_ids.extend(resumes[i])
                top = self.top_logprobs_wanted()
                if top is not None:
                    req.logprobs = top
                prompt_top = self.prompt_logprobs_wanted()
                if prompt_top is not None and i == 0:
                    req.prompt_logprobs = prompt_top
                reqs.append(req)
        except (ValueError, TypeError) as e:  # the schema's bounds should have caught it
            raise bad_request(f"a field is out of range or malformed: {e}") from None
        return reqs

    def resumes(self) -> list[list[int]]:
        """Each choice's token ids already received (`resume_token_ids`: one list, or
        with n > 1 one list per choice)."""
        ids = self.resume_token_ids
        if not ids:
            return [[] for _ in range(self.choices)]
        if all(isinstance(x, list) for x in ids):
            if len(ids) != self.choices:
                raise bad_request(
                    f"resume_token_ids has {len(ids)} lists for {self.choices} choices (n)",
                    "resume_token_ids",
                )
            return [list(x) for x in ids]
        if self.choices != 1:
            raise bad_request(
                "with n > 1, resume_token_ids is one list of token ids per choice",
                "resume_token_ids",
            )
        return [list(ids)]

    def _build(self, prompt, text, max_new, default_max_tokens, default_mode, temperature, seed):
        """The request of one choice: the plain body fields as given (`_PLAIN_FIELDS`),
        and the ones OpenAI's defaults or the choice decide."""
        return build_request(
            prompt if text else None,
            prompt_ids=None if text else prompt,
            mode=self.mode or default_mode,
            max_new_tokens=default_max_tokens if max_new is None else max_new,
            temperature=temperature,
            seed=seed,
            **{o.keyword: getattr(self, o.http) for o in _PLAIN_FIELDS},
        )


# The option table's body fields (`http`) that are not passed on as given: OpenAI's
# max_tokens (or max_completion_tokens) and its temperature default, the seed per
# choice, the deployment's default mode, the logprobs (chat's and completions' differ)
# and each choice's resume_token_ids. Every other body option is plain.
NOT_PLAIN = frozenset(
    {"max_new_tokens", "temperature", "seed", "mode", "logprobs", "resume_token_ids"}
)
_PLAIN_FIELDS = tuple(o for o in REQUEST_OPTIONS if o.http and o.name not in NOT_PLAIN)


TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class CompletionRequest(_Common):
    # A text, or token ids; a list of one of either (OpenAI's batches of one).
    prompt: Text | list[Int64] | list[Text] | list[list[Int64]]
    # Each token's logprob and this many alternatives (OpenAI: 0-5; vLLM and SpecPipe 20).
    logprobs: TopLogprobs | None = None
    # The prompt before the completion (with logprobs: the prompt tokens' too, the first
    # one's null).
    echo: bool = False

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompt_value(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise bad_request(
                    f"one prompt per request (SpecPipe does not batch), got {len(p)}", "prompt"
                )
            return p[0]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None

    def rendered(self) -> dict[str, str]:
        """{role, content} for the model's chat template (developer is OpenAI's newer
        name for system; text parts are joined)."""
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise bad_request("only text content parts are supported", "messages")
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    # function calling (checked by tool_calls.ToolChoice)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")


# -- stop strings --------------------------------------------------------------------------
class StopMatcher:
    """Cuts streamed text at the first stop string. Text that could be the start of a
    stop string is held back until the next piece decides; once a stop string has
    appeared, `stopped` is set and nothing more comes out (the stop string included).

    With `min_tokens`, text pushed before that many tokens are out is not searched
    (vLLM's rule: a stop string is honoured once min_tokens tokens are out): a stop
    string counts only where it ends in text pushed after (one may begin before)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""
        self._early = 0  # characters at the start of _held pushed before min_tokens

    def push(self, text: str, honoured: bool = True) -> str:
        """The text that is safe to emit after this piece; `honoured`: whether a stop
        string may end in it (False: the output has fewer than min_tokens tokens)."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buf = self._held + text
        early = self._early if honoured else len(buf)  # where no stop string may end
        if honoured:
            found = (buf.find(s, max(0, early - len(s) + 1)) for s in self.stops)
            hits = [i for i in found if i >= 0]
            if hits:
                self.stopped, self._held = True, ""
                return buf[: min(hits)]
        cut = len(buf) - self._partial(buf)
        self._held, self._early = buf[cut:], max(0, early - cut)
        return buf[:cut]

    def flush(self) -> str:
        """At the end of the output: what was held back (no stop string came)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial(self, buf: str) -> int:
        """Length of the longest end of `buf` that begins some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


# -- one request's events ------------------------------------------------------------------
@dataclass
class Piece:
    """Text left after stop strings, and the tokens generated since the previous piece
    (with their logprobs, for a request that asked for them): the text of a token may
    come later than the token (an incomplete character, a possible stop string)."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)


class TextRun:
    """The `GenerateResponse` events of one request (from `RouterEngine.generate`) as
    OpenAI text: `next()` gives the pieces of text left after stop strings; at the end,
    the finish reason, usage and speculation stats. A stop string ends the request at
    once (StopGeneration thrown in: the stages free it, the stats come back), but not
    before `min_tokens` tokens are out (the request's: its stop tokens wait as long;
    the engine starts a delta where the output reaches it). Raises what the events
    raise (RequestFailed)."""

    def __init__(
        self,
        responses: AsyncGenerator[gen.GenerateResponse, None],
        stops: Sequence[str] = (),
        min_tokens: int = 0,
    ) -> None:
        self._responses = responses
        self.matcher = StopMatcher(stops)
        self.min_tokens = min_tokens
        self._out = 0  # output tokens so far (a resume's included)
        self.request_id = ""
        self.model = ""
        self.weight_hash = ""
        self.prompt_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[pb.TokenLogprobs] = []  # one per token, when asked for
        # The first delta's, when the request asked for prompt logprobs.
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list[pb.TokenLogprobs] = []
        self.output = ""  # the text given out so far
        self.finished: gen.Finished | None = None
        self.finish_reason = ""
        self._ids: list[int] = []  # tokens since the last piece
        self._lps: list[pb.TokenLogprobs] = []
        self._pieces = self._run()

    async def next(self) -> Piece | None:
        """The next piece; None once the request has finished."""
        piece = await anext(self._pieces, None)
        if piece is not None:
            self.output += piece.text
        return piece

    async def text(self) -> str:
        """All of the (rest of the) text."""
        parts = []
        while (piece := await self.next()) is not None:
            parts.append(piece.text)
        return "".join(parts)

    async def close(self) -> None:
        """Stop early (the client went away): the router releases the request."""
        await self._pieces.aclose()

    async def _run(self) -> AsyncIterator[Piece]:
        async with contextlib.aclosing(self._responses) as responses:
            async for resp in responses:
                kind = resp.WhichOneof("event")
                if kind == "started":
                    self.request_id = resp.started.request_id
                    self.model, self.weight_hash = resp.started.model, resp.started.weight_hash
                    self.prompt_tokens = resp.started.prompt_tokens
                    continue
                if kind == "delta":
                    d = resp.delta
                    if d.prompt_token_ids:
                        self.prompt_token_ids = list(d.prompt_token_ids)
                        self.prompt_logprobs = list(d.prompt_logprobs)
                    self.token_ids.extend(d.token_ids)
                    self.logprobs.extend(d.logprobs)
                    self._ids.extend(d.token_ids)
                    self._lps.extend(d.logprobs)
                    self._out = d.index + len(d.token_ids)
                    text = self.matcher.push(d.text, self._out >= self.min_tokens)
                    if self.matcher.stopped:
                        final = await responses.athrow(StopGeneration())
                        self._finish(final.finished)
                elif kind == "finished":
                    honoured = self._out >= self.min_tokens
                    text = self.matcher.push(resp.finished.text, honoured) + self.matcher.flush()
                    self._finish(resp.finished)
                # At the end, tokens whose text never came out still bring their logprobs.
                if text or (self.finished is not None and self._lps):
                    yield Piece(text, self._ids, self._lps)
                    self._ids, self._lps = [], []
                if self.finished is not None:
                    return

    @property
    def unsent_token_ids(self) -> list[int]:
        """Tokens no piece carried (their text never came out: an end-of-sequence
        token, text a stop string cut); the finishing chunk carries them."""
        return list(self._ids)

    def _finish(self, finished: gen.Finished) -> None:
        self.finished = finished
        self.finish_reason = "stop" if self.matcher.stopped else finished.finish_reason

    @property
    def completion_tokens(self) -> int:
        f = self.finished
        return f.usage.completion_tokens if f else len(self.token_ids)

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the path had in its prefix cache (None: not finished yet)."""
        return self.finished.usage.cached_tokens if self.finished else None

    @property
    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    @property
    def speculation(self) -> dict[str, Any] | None:
        """The stats, with `resumed_tokens` for a resumed request (`resume_token_ids`)."""
        f = self.finished
        if f is None:
            return None
        out = speculation(f.stats)
        if f.resumed_tokens:
            out["resumed_tokens"] = f.resumed_tokens
        return out


# -- responses -----------------------------------------------------------------------------
def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: the prompt tokens served from the prefix cache
    (known when the request has finished; None: left out)."""
    answer: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        answer["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return answer


def speculation(stats: gen.SpeculationStats) -> dict[str, Any]:
    """`Finished.stats` as JSON (numbers stay numbers, unlike protobuf's JSON mapping of
    64-bit integers)."""
    return {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}


class TokenNames:
    """A token id as logprobs name it: its own text (the tokenizer's string of that one
    token, as vLLM's `convert_tokens_to_string`: "\\ufffd" for a piece of a character),
    or "token_id:N" without a tokenizer (vLLM's `return_tokens_as_token_ids`). Kept per
    id: at most the vocabulary."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self._names: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self._name(token_id)
            self._names[token_id] = name
        return name

    def _name(self, token_id: int) -> str:
        tok = self.tokenizer
        if tok is None:
            return f"token_id:{token_id}"
        piece = tok.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return f"token_id:{token_id}"
        return tok.convert_tokens_to_string([piece])


# One token of a logprobs answer: its id, and its logprobs (None: the prompt's first).
Entry = tuple[int, pb.TokenLogprobs | None]


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def chat_logprobs(entries: Sequence[Entry], names: TokenNames) -> dict[str, Any]:
    """A chat choice's `logprobs`: per token its text, logprob, UTF-8 bytes and the top
    alternatives (OpenAI's ChatCompletionTokenLogprob)."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        name = names(token_id)
        return {"token": name, "logprob": _lp(logprob), "bytes": list(name.encode())}

    content = []
    for token_id, lp in entries:
        assert lp is not None
        top = [one(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        content.append({**one(token_id, lp.logprob), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[Entry], names: TokenNames, offset: int = 0
) -> tuple[dict[str, Any], int]:
    """A text completion choice's `logprobs` (OpenAI's legacy shape: tokens, their
    logprobs, a {token: logprob} of the token and its alternatives each, and where each
    token's text starts, from `offset`) and the offset after the last token."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for token_id, lp in entries:
        name = names(token_id)
        tokens.append(name)
        offsets.append(offset)
        offset += len(name)
        if lp is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(_lp(lp.logprob))
        top = {name: _lp(lp.logprob)}  # the token first, then its alternatives (vLLM's)
        for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
            top.setdefault(names(i), _lp(v))
        tops.append(top)
    answer = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
              "text_offset": offsets}  # fmt: skip
    return answer, offset


def prompt_entries(run: TextRun) -> list[Entry]:
    """The prompt's tokens with their logprobs (the first has none)."""
    ids, lps = run.prompt_token_ids, run.prompt_logprobs
    return [(t, None if i == 0 else lps[i - 1]) for i, t in enumerate(ids)]


class ResponseShape:
    """Builds the JSON objects of one chat or text completion (ids, times, model), and
    its choices' logprobs (`names`: the tokens' texts) when the request asked for them."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        weight_hash: str = "",
        names: TokenNames | None = None,
        logprobs: bool = False,
    ) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        # OpenAI's "backend configuration" fingerprint: the model version (weight hash).
        self.fingerprint = weight_hash
        self.created = int(time.time())
        self.names = names or TokenNames()
        self.logprobs = logprobs
        self._offsets: dict[int, int] = {}  # text completions streamed: text_offset so far

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict[str, Any]:
        envelope = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.fingerprint:
            envelope["system_fingerprint"] = self.fingerprint
        return {**envelope, **extra}

    def _logprobs(self, index: int, entries: Sequence[Entry]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(entries, self.names)
        answer, self._offsets[index] = completion_logprobs(
            entries, self.names, self._offsets.get(index, 0)
        )
        return answer

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str,
        entries: Sequence[Entry] = (),
        token_ids: list[int] | None = None,
        message: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One choice of a whole (not streamed) answer; `entries`: its tokens;
        `message`: a chat answer's own (function calls), instead of the text's."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason,
                                  "logprobs": self._logprobs(index, entries)}  # fmt: skip
        if self.chat:
            choice["message"] = message or {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    def completion(
        self, choices: list[dict[str, Any]], usage: dict[str, int], stats: Any
    ) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices, usage=usage, speculation=stats)

    def chunk(
        self,
        text: str | None = None,
        finish_reason: str | None = None,
        first: bool = False,
        index: int = 0,
        entries: Sequence[Entry] = (),
        token_ids: list[int] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        **extra,
    ) -> dict[str, Any]:
        """A streamed piece of choice `index`: `text` (and the logprobs of `entries`,
        the tokens since the previous piece; `token_ids`, those tokens, for a request
        with `return_token_ids`; a chat's `delta.tool_calls`), or the choice's last
        piece (`finish_reason`)."""
        lps = self._logprobs(index, entries) if entries else None
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": lps}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if token_ids is not None:
            choice["token_ids"] = token_ids
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [choice], **extra)

    def usage_chunk(self, usage: dict[str, int], stats: Any) -> dict[str, Any]:
        """`stream_options.include_usage`: the extra last chunk, with no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], usage=usage, speculation=stats)


def model_card(model_id: str, created: int, max_context: int, **specpipe: Any) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "specpipe",
        "max_model_len": max_context,
        "specpipe": specpipe,
    }
