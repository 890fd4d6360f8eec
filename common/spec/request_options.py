"""Every option of a generation request, declared once: its name, type, bounds, default
and help, and where each surface carries it (the `GenerateRequest` field, the HTTP API's
body field, the `specpipe client generate` flag, the SDK keyword, the engine's
`DecodeOptions` or `SamplingParams` field).

The surfaces are derived from this table: the SDK's `build_request` sets each option's
proto field with `set_on_wire`, the router's `plan_request` reads the engine's fields
with `read_wire`, `specpipe client generate` adds a flag per `cli` entry, and the HTTP
body maps its plain fields by `http`. What a surface still names by hand is its special
cases, each listed where it is handled. tests/unit/test_request_options.py sends each
option's `example` through every surface and fails when an option is missing from a
surface, a surface has an option not declared here or names one by hand outside its
special cases, or the engine's bounds differ from the declared ones. Adding an option is
one entry here (and its key in `RequestOptions`), its behaviour, and what that test then
asks for.

"auto" (the router chooses) travels as 0 for the integer options and as the string
"auto" for `token_source`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from .options import (
    DEFAULT_LAYERS_PER_STEP,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_SPECINFER_DEPTH,
    DEFAULT_TOP_K_CHILDREN,
    DEFAULT_WIDTH,
    MAX_LAYERS_PER_STEP,
    MAX_LOGPROBS,
    MAX_NEW_TOKENS,
    MAX_PREFILL_CHUNK,
    MAX_SPECINFER_DEPTH,
    MAX_TOP_K_CHILDREN,
    MAX_WIDTH,
    Growth,
    Mode,
    TokenSource,
)
from .ranking import Ranking
from .sampling import (
    MAX_FREQUENCY_PENALTY,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_REPETITION_PENALTY,
)

AUTO = "auto"


@dataclass(frozen=True)
class RequestOption:
    name: str  # the wire's name: the field of GenerateRequest (or of its SamplingOptions)
    kind: type  # int, float, str, bool, tuple (of token ids), or dict (a JSON object)
    default: object  # what the request gets when it leaves the option unset
    help: str
    example: object  # a valid value other than the default (the tests send it through)
    low: float | None = None  # bounds the engine enforces (inclusive; None: none)
    high: float | None = None
    choices: tuple[str, ...] = ()
    auto: bool = False  # "auto" leaves the choice to the router
    proto: str = ""  # path in GenerateRequest; "" : `name`
    engine: str | None = None  # DecodeOptions field, or "sampling.<SamplingParams field>"
    http: str | None = None  # field of the HTTP API's body; None: not a body field
    cli: str | None = None  # flag of `specpipe client generate`
    sdk: str = ""  # keyword of `build_request` and `Client.stream`; "": `name`

    @property
    def wire(self) -> str:
        return self.proto or self.name

    @property
    def keyword(self) -> str:
        return self.sdk or self.name

    @property
    def dest(self) -> str | None:
        """The command line's attribute for the flag."""
        return None if self.cli is None else self.cli.lstrip("-").replace("-", "_")


def _tree(name: str, default: int, high: int, example: int, help: str, **kw) -> RequestOption:
    """A positive tree or chunk size."""
    return RequestOption(
        name, int, default, help, example, low=1, high=high, engine=kw.pop("engine", name),
        http=name, cli=f"--{name.replace('_', '-')}", **kw,
    )  # fmt: skip


REQUEST_OPTIONS: tuple[RequestOption, ...] = (
    RequestOption("model", str, "", "model id (empty: the deployment's)", "m", http="model",
                  cli="--model"),
    RequestOption("chat", bool, False, "apply the model's chat template to the text prompt",
                  True, cli="--chat"),  # HTTP: the /v1/chat/completions endpoint itself
    RequestOption("mode", str, Mode.SPECPIPE.value, "how the request decodes", "pp",
                  choices=tuple(Mode), http="mode", cli="--mode"),
    RequestOption("max_new_tokens", int, DEFAULT_MAX_NEW_TOKENS, "tokens to generate", 7,
                  low=1, high=MAX_NEW_TOKENS, engine="max_new_tokens", http="max_tokens",
                  cli="--max-new-tokens"),
    RequestOption("temperature", float, 0.0, "0: greedy", 0.5, low=0.0,
                  proto="sampling.temperature", engine="sampling.temperature",
                  http="temperature", cli="--temperature"),
    RequestOption("top_k", int, 0, "keep the k most likely tokens (0: no limit)", 5, low=0,
                  proto="sampling.top_k", engine="sampling.top_k", http="top_k",
                  cli="--top-k"),
    RequestOption("top_p", float, 1.0, "nucleus mass in (0, 1]", 0.5, high=1.0,
                  proto="sampling.top_p", engine="sampling.top_p", http="top_p",
                  cli="--top-p"),
    RequestOption("seed", int, 0, "random draws depend only on (seed, position)", 3, low=0,
                  proto="sampling.seed", engine="sampling.seed", http="seed", cli="--seed"),
    _tree("width", DEFAULT_WIDTH, MAX_WIDTH, 4, "tree nodes kept per layer", auto=True),
    _tree("top_k_children", DEFAULT_TOP_K_CHILDREN, MAX_TOP_K_CHILDREN, 3,
          "draft candidates per node, capped by the width"),
    _tree("depth", DEFAULT_SPECINFER_DEPTH, MAX_SPECINFER_DEPTH, 5, "SpecInfer tree depth"),
    _tree("prefill_chunk", DEFAULT_PREFILL_CHUNK, MAX_PREFILL_CHUNK, 16,
          "prompt rows per prefill forward"),
    _tree("layers_per_step", DEFAULT_LAYERS_PER_STEP, MAX_LAYERS_PER_STEP, 2,
          "specpipe tree layers entering stage 1 per step", auto=True),
    RequestOption("token_source", str, TokenSource.DRAFT.value, "what proposes tree tokens",
                  TokenSource.NGRAM.value, choices=(*TokenSource, AUTO), auto=True,
                  engine="token_source", http="token_source", cli="--token-source"),
    RequestOption("ranking", str, Ranking.TARGET.value, "how tree nodes are ranked for the "
                  "width", Ranking.BEAM.value, choices=tuple(Ranking), engine="ranking",
                  http="ranking", cli="--ranking"),
    RequestOption("growth", str, Growth.VERIFIED.value, "when a tree layer grows",
                  Growth.EAGER.value, choices=tuple(Growth), engine="growth", http="growth",
                  cli="--growth"),
    RequestOption("ignore_eos", bool, False, "do not stop at the end-of-sequence tokens",
                  True, http="ignore_eos", cli="--ignore-eos"),
    RequestOption("stop_token_ids", tuple, (), "more tokens that end generation", (5, 9),
                  engine="stop_token_ids", http="stop_token_ids", cli="--stop-token-ids"),
    RequestOption("priority", int, 0, "higher runs first when the router is busy", 2,
                  http="priority", cli="--priority"),
    # HTTP: completions' `logprobs`; chat's is `logprobs: true` with `top_logprobs`.
    RequestOption("logprobs", int, None, "report each token's logprob and this many top "
                  "alternatives", 3, low=0, high=MAX_LOGPROBS, engine="logprobs",
                  http="logprobs"),
    # HTTP: completions' `echo` with `logprobs`.
    RequestOption("prompt_logprobs", int, None, "the same for every prompt token after the "
                  "first (the prefill is then computed whole)", 2, low=0, high=MAX_LOGPROBS,
                  engine="prompt_logprobs"),
    # OpenAI's shape; on the wire a `ResponseFormat` message; the engine gets the grammar
    # compiled from it with the tokenizer (`DecodeOptions.grammar`, common/spec/grammar.py)
    RequestOption("response_format", dict, None, 'structured output, OpenAI\'s shape: '
                  '{"type": "json_object"} or {"type": "json_schema", "json_schema": '
                  '{"schema": {...}}} (JSON text on the command line)',
                  {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
                  http="response_format", cli="--response-format"),
    # The logits rules (common/spec/penalties.py; vLLM's definitions, applied before
    # temperature, top-k and top-p where each token is drawn).
    RequestOption("repetition_penalty", float, 1.0, "over the prompt's and the output's "
                  "tokens: a positive logit divided by it, a negative one multiplied "
                  "(1: none)", 1.2, high=MAX_REPETITION_PENALTY,
                  proto="sampling.repetition_penalty", engine="sampling.repetition_penalty",
                  http="repetition_penalty", cli="--repetition-penalty"),
    RequestOption("frequency_penalty", float, 0.0, "over the output's tokens: each logit "
                  "less this times the token's count", 0.5, low=-MAX_FREQUENCY_PENALTY,
                  high=MAX_FREQUENCY_PENALTY, proto="sampling.frequency_penalty",
                  engine="sampling.frequency_penalty", http="frequency_penalty",
                  cli="--frequency-penalty"),
    RequestOption("presence_penalty", float, 0.0, "over the output's tokens: each logit "
                  "less this once the token is out", -0.5, low=-MAX_FREQUENCY_PENALTY,
                  high=MAX_FREQUENCY_PENALTY, proto="sampling.presence_penalty",
                  engine="sampling.presence_penalty", http="presence_penalty",
                  cli="--presence-penalty"),
    # OpenAI's shape: {token id: bias}; JSON text on the command line
    RequestOption("logit_bias", dict, {}, "token id -> added to its logit (clamped to "
                  f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]; at most "
                  f"{MAX_LOGIT_BIAS_ENTRIES})", {5: 2.5, 9: -100.0},
                  proto="sampling.logit_bias", engine="sampling.logit_bias",
                  http="logit_bias", cli="--logit-bias"),
    RequestOption("min_tokens", int, 0, "the end-of-sequence and stop tokens cannot come "
                  "before this many tokens are out (at most max_new_tokens)", 3, low=0,
                  high=MAX_NEW_TOKENS, engine="min_tokens", http="min_tokens",
                  cli="--min-tokens"),
    # vLLM's `cache_salt`: the router derives the stages' salt from it, the API key (or
    # client address) and a deployment secret (services/router/cache_scope.py).
    RequestOption("cache_salt", str, "", "prefix-cache namespace: requests of your API key "
                  "with the same salt share cached prompt prefixes (empty: the key's own)",
                  "team-7", http="cache_salt", cli="--cache-salt"),
    # A resume (Controller.resume): the output tokens the client already holds; the SDK
    # sends them itself when a router dies mid-stream. HTTP: one list per choice with n.
    RequestOption("resume_token_ids", tuple, (), "output tokens already received: the "
                  "router continues the output after them (exactly, as from (seed, position))",
                  (5, 9), http="resume_token_ids", cli="--resume-token-ids"),
)  # fmt: skip

BY_NAME = {o.name: o for o in REQUEST_OPTIONS}


class RequestOptions(TypedDict, total=False):
    """The SDK's keywords (`build_request`, `Client.stream`), typed for IDEs and type
    checkers (`**options: Unpack[RequestOptions]`); the test checks its keys are the
    table's. None (or leaving one out) leaves the option to the router."""

    model: str
    chat: bool
    mode: str
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float | None
    seed: int
    width: int | str | None
    top_k_children: int | None
    depth: int | None
    prefill_chunk: int | None
    layers_per_step: int | str | None
    token_source: str
    ranking: str
    growth: str
    ignore_eos: bool
    stop_token_ids: Sequence[int]
    priority: int
    logprobs: int | None
    prompt_logprobs: int | None
    response_format: dict[str, Any] | str | None
    repetition_penalty: float | None
    frequency_penalty: float | None
    presence_penalty: float | None
    logit_bias: Mapping[int, float] | None
    min_tokens: int
    cache_salt: str
    resume_token_ids: Sequence[int]


def options_doc() -> str:
    """Each option's keyword and help, for the SDK's docstrings."""
    lines = []
    for o in REQUEST_OPTIONS:
        auto = ", or 'auto': the router's choice" if o.auto else ""
        choices = f" ({', '.join(c for c in o.choices if c != AUTO)})" if o.choices else ""
        lines.append(f"    {o.keyword}: {o.help}{choices}{auto}")
    return "\n".join(lines)


def _parent_and_field(message, o: RequestOption):
    """The message holding the option's proto field, and the field's descriptor."""
    *outer, last = o.wire.split(".")
    for part in outer:
        message = getattr(message, part)
    return message, message.DESCRIPTOR.fields_by_name[last]


def _is_map(f) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


def set_on_wire(message, o: RequestOption, value: object) -> None:
    """Put `value` in the option's field of a `GenerateRequest`: "auto" as 0 for the
    integers, a sequence's items, a map's entries; None leaves the field unset."""
    if value is None:
        return
    parent, f = _parent_and_field(message, o)
    if value == AUTO and o.auto and o.kind is int:
        value = 0
    if _is_map(f):
        getattr(parent, f.name).update(value)
    elif f.is_repeated:
        getattr(parent, f.name).extend(value)
    elif f.message_type is not None:
        getattr(parent, f.name).CopyFrom(value)
    else:
        setattr(parent, f.name, value)


def read_wire(message, o: RequestOption) -> object:
    """The option's value in a `GenerateRequest`, or None where the request leaves it
    unset (a field with presence not set, an empty string or list): the engine's
    default then applies."""
    parent, f = _parent_and_field(message, o)
    if f.has_presence and not parent.HasField(f.name):
        return None
    value = getattr(parent, f.name)
    if _is_map(f):
        return dict(value)
    if f.is_repeated:
        return tuple(value) or None
    if value == "":
        return None
    return value
