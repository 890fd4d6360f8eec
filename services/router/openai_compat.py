"""OpenAI's request shapes and their translation to the Generation API
(`GenerateRequest`). No HTTP here:
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

One module of about 440 lines: every OpenAI request shape, its checks and its
translation to the Generation API, so that what the HTTP API accepts is read in one
file. The responses are openai_responses.py; one choice's events as text, text_run.py.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import grpc
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from specpipe.common.spec.grammar import GrammarError, ResponseFormat
from specpipe.common.spec.options import MAX_LOGPROBS
from specpipe.common.spec.request_options import REQUEST_OPTIONS
from specpipe.common.spec.sampling import SamplingParams
from specpipe.v1 import generation_pb2 as gen

from ..client.common import build_request

# OpenAI's defaults: 16 new tokens for text completions, sampling at temperature 1.
DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string (the stop matcher holds back up to this much text)
# `n`: choices of one request, each a generation of its own (OpenAI allows 128; each
# choice takes a running slot and its KV cache).
MAX_CHOICES = 16

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
