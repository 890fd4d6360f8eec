"""What a client request becomes before it runs: validated against the deployment
(`plan_request`, the same DecodeOptions/SamplingParams checks as every entry point),
with an id that names it on every stage; and how a refused or failed request is told."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc
from specpipe.common.perf.tuning import TuningSpace
from specpipe.common.spec.grammar import TEXT, Grammar, GrammarError, ResponseFormat
from specpipe.common.spec.options import (
    DEFAULT_LAYERS_PER_STEP,
    DEFAULT_WIDTH,
    MAX_STOP_TOKEN_IDS,
    DecodeOptions,
    Mode,
    TokenSource,
    check_context,
    check_logit_bias,
    check_prompt_ids,
    check_resume_ids,
)
from specpipe.common.spec.request_options import REQUEST_OPTIONS, read_wire
from specpipe.common.spec.sampling import SamplingParams
from specpipe.v1 import generation_pb2 as gen

from ..client.errors import FINAL_METADATA
from .backends import ModelInfo
from .bounds import max_prompt_chars


@dataclass(frozen=True)
class Plan:
    """A validated request."""

    prompt: list[int]
    mode: Mode
    opts: DecodeOptions
    # Which of width, layers per step, token source and growth are the router's to
    # choose (opts holds the engine's defaults for those until then).
    space: TuningSpace | None = None
    # a resume: the output tokens the client already holds (Controller.resume)
    resume: tuple[int, ...] = ()


AUTO = "auto"


@dataclass(frozen=True)
class RequestDefaults:
    """The router's defaults (`--width`, `--layers-per-step`, `--token-source`) for what
    a request leaves unset: a value, "auto", or None: "auto" for a specpipe request on a
    deployment with a draft (so that the draft is used only where it pays, "Defaults
    that never lose"), else the engine's default."""

    width: int | str | None = None
    layers_per_step: int | str | None = None
    token_source: str | None = None

    @classmethod
    def fixed(cls) -> RequestDefaults:
        """The engine's defaults, nothing tuned (the old default of every deployment)."""
        return cls(DEFAULT_WIDTH, DEFAULT_LAYERS_PER_STEP, TokenSource.DRAFT)

    def __post_init__(self) -> None:
        for name in ("width", "layers_per_step"):
            v = getattr(self, name)
            if v is not None and v != AUTO and (not str(v).isdigit() or int(v) < 1):
                raise ValueError(f"the default {name} must be a positive integer or 'auto'")
        if self.token_source not in (None, AUTO, *TokenSource):
            choices = ", ".join([*TokenSource, AUTO])
            raise ValueError(f"unknown token source {self.token_source!r} (choose from {choices})")


class RequestFailed(Exception):
    """A request refused or failed: the gRPC status a client receives and why. What
    `RouterEngine.generate` raises; the gRPC handler aborts with it, the HTTP API turns
    it into an OpenAI-shaped error."""

    def __init__(self, code: grpc.StatusCode, message: str, final: bool = False) -> None:
        """`final`: the request ran and the router gave up on it after its own replays
        (no path left within the replay time): an UNAVAILABLE a client should not resume
        against (`FINAL_METADATA`). Not final: refused before it ran (the router still
        starting, draining, no complete path yet), where another try may be served."""
        super().__init__(message)
        self.code, self.message, self.final = code, message, final

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        final = self.final and self.code == grpc.StatusCode.UNAVAILABLE
        return (FINAL_METADATA,) if final else ()


class InvalidRequest(RequestFailed):
    """Refused before it starts (validation)."""


class StopGeneration(Exception):
    """Thrown into `RouterEngine.generate` at a delta (`athrow`): end the request now,
    as finished with reason "stop" (the HTTP API's stop strings)."""


def invalid(message: str) -> InvalidRequest:
    return InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, message)


class RequestIds:
    """Request ids that are capabilities (docs/architecture.md, "9. Security"): 128
    random bits each, no counter, so no client can predict another's id from its own
    `Started.request_id`, and routers sharing stages never collide."""

    BITS = 128

    def next(self) -> str:
        return secrets.token_urlsafe(self.BITS // 8)


def load_codec(model_dir: str | None):
    """The target's tokenizer, when its directory has one (random test models do not)."""
    if not model_dir:
        return None
    d = Path(model_dir)
    if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from specpipe.common.text import TextCodec

    return TextCodec.from_dir(d)


def check_model(model: ModelInfo | None, name: str) -> ModelInfo:
    """The served model, if `name` (empty: any) names it."""
    if model is None:
        # Not this router's last word: a client retries (or resumes) once it serves.
        raise InvalidRequest(grpc.StatusCode.UNAVAILABLE, "the router is still starting")
    if name and name != model.model_id:
        raise InvalidRequest(
            grpc.StatusCode.NOT_FOUND,
            f"model {name!r} is not served here (this deployment serves {model.model_id!r})",
        )
    return model


def tokenize(codec, text: str, chat: bool) -> list[int]:
    if codec is None:
        raise InvalidRequest(
            grpc.StatusCode.FAILED_PRECONDITION,
            "the served model has no tokenizer: send prompt token ids instead of text",
        )
    from specpipe.common.text import TokenizerError

    try:
        return codec.encode(text, chat=chat)
    except TokenizerError as e:
        raise invalid(str(e)) from None


def check_priority(priority: int, caller) -> None:
    """A request may ask for at most its caller's priority (`auth.Caller`: its API
    key's `max_priority`, else the router's `--max-priority`); PERMISSION_DENIED above."""
    if priority > caller.max_priority:
        raise InvalidRequest(
            grpc.StatusCode.PERMISSION_DENIED,
            f"priority {priority} is above the highest this client may ask for "
            f"({caller.max_priority}; an API key's max_priority raises it)",
        )


def check_size(r: gen.GenerateRequest, model: ModelInfo) -> None:
    """Refuse a prompt that cannot fit the context from its length alone, before it is
    copied or tokenized."""
    which = r.WhichOneof("prompt")
    if which == "text" and len(r.text) > max_prompt_chars(model.max_positions):
        raise invalid(
            f"the prompt has {len(r.text)} characters: more than any prompt that fits "
            f"the model's context of {model.max_positions} tokens"
        )
    if which == "token_ids" and len(r.token_ids.ids) >= model.max_positions:
        try:
            check_context(len(r.token_ids.ids), 1, model.max_positions)
        except ValueError as e:
            raise invalid(str(e)) from None


def prompt_of(r: gen.GenerateRequest, codec) -> list[int]:
    """The request's prompt as token ids (text tokenized, with the chat template)."""
    which = r.WhichOneof("prompt")
    if which == "text":
        if not r.text:
            raise invalid("the prompt is empty")
        return tokenize(codec, r.text, r.chat)
    if which == "token_ids":
        if r.chat:
            raise invalid("chat needs a text prompt")
        return list(r.token_ids.ids)
    return []


# Prompt logprobs are capped, not weighed in admission (issue 35, F4: `echo` with
# `logprobs: 20` on an 8,000-character prompt made an 8 KB request a 5.16 MB response): a
# request gets at most this many entries, prompt tokens x (alternatives + 1), about 1 MB
# of JSON (~31 bytes an entry). The size is known before the request starts, so a cap
# refuses it with a clear 400 at no cost, bounds every response (and the stages' rows of
# logits behind it) whatever the load, and leaves the slots to count requests; the fair
# shares per API key (common/spec/scheduler.py) then bound what one client has in flight.
# Scoring a prompt (0 or 1 alternatives) still covers 16-32k tokens. The entries also
# travel in the first Verification's header (at most 4 MiB: the data plane's cap), at
# 16 + 12 bytes per token and alternative: 2^15 entries take well under half of it.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 15


def check_prompt_logprobs(prompt_tokens: int, top: int) -> None:
    """Refuse prompt logprobs over MAX_PROMPT_LOGPROB_ENTRIES."""
    if prompt_tokens * (top + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
        most = MAX_PROMPT_LOGPROB_ENTRIES // (top + 1)
        raise invalid(
            f"prompt logprobs of {prompt_tokens} prompt tokens with {top} alternatives each "
            f"are more than one response carries (at most {most} tokens with {top}): "
            "ask for fewer alternatives or a shorter prompt"
        )


def response_format_of(r: gen.GenerateRequest) -> ResponseFormat:
    """The request's response_format, checked (INVALID_ARGUMENT naming the problem)."""
    if not r.HasField("response_format"):
        return ResponseFormat()
    try:
        return ResponseFormat(r.response_format.type or TEXT, r.response_format.schema)
    except GrammarError as e:
        raise invalid(str(e)) from None


def grammar_of(r: gen.GenerateRequest, tokenizer) -> Grammar | None:
    """The grammar of a request's response_format, compiled and checked (None: text);
    `tokenizer`: the served model's as the grammar library reads it (None: the router
    has none)."""
    fmt = response_format_of(r)
    if not fmt.constrains:
        return None
    if r.ignore_eos:
        raise invalid(
            "ignore_eos cannot be combined with response_format: structured output ends "
            "with an end-of-sequence token once the output is complete"
        )
    if tokenizer is None:
        raise InvalidRequest(
            grpc.StatusCode.FAILED_PRECONDITION,
            "response_format needs the served model's tokenizer, and this router has none",
        )
    try:
        return Grammar(fmt.grammar_text() or "", tokenizer)
    except GrammarError as e:
        raise invalid(f"response_format: {e}") from None


# The engine options `plan_request` sets itself rather than as the request gives them:
# the router's defaults and tuning ("auto"), and the stop tokens with the model's
# end-of-sequence ones. (Growth is read from the table; only its "auto" is the router's.)
ROUTER_SET = frozenset({"width", "layers_per_step", "token_source", "stop_token_ids"})
_SAMPLING = "sampling."


def engine_options(r: gen.GenerateRequest) -> tuple[dict[str, object], dict[str, object]]:
    """The `DecodeOptions` and the `SamplingParams` fields a request sets, by the option
    table's engine paths (those in ROUTER_SET apart): unset ones take the engine's
    defaults."""
    decode: dict[str, object] = {}
    sampling: dict[str, object] = {}
    for o in REQUEST_OPTIONS:
        if o.engine is None or o.name in ROUTER_SET:
            continue
        value = read_wire(r, o)
        if value is None:
            continue
        if o.engine.startswith(_SAMPLING):
            sampling[o.engine.removeprefix(_SAMPLING)] = value
        else:
            decode[o.engine] = value
    return decode, sampling


def plan_request(
    r: gen.GenerateRequest,
    model: ModelInfo,
    prompt: list[int],
    has_draft: bool,
    defaults: RequestDefaults | None = None,
    grammar_tokenizer=None,
    grammar: Grammar | None = None,
) -> Plan:
    """Validate a request (its prompt already as token ids) against the deployment;
    every problem is a clear status. `defaults`: the router's for what the request
    leaves unset; `grammar_tokenizer`: the model's tokenizer as the grammar library
    reads it (for response_format; `grammar.load_grammar_tokenizer`); `grammar`: the
    request's already compiled by `grammar_of` (off the event loop), else it is
    compiled here."""
    try:
        check_prompt_ids(prompt, model.vocab_size)
    except ValueError as e:
        raise invalid(str(e)) from None
    defaults = defaults or RequestDefaults()
    mode, source = mode_and_source(r, defaults, has_draft)
    # With a draft the router tunes what neither the request nor its flags set.
    tuned_by_default = mode == Mode.SPECPIPE and has_draft
    stops = stop_tokens(r, model)
    # The same checks as every other entry point (DecodeOptions, SamplingParams): what
    # the request sets of the table's engine fields; the rest takes their defaults.
    auto: set[str] = set()  # what the router chooses
    given, sampled = engine_options(r)
    if "growth" not in given and mode == Mode.SPECPIPE:
        auto.add("growth")  # chosen from the published costs (`growth_choice.py`)
    if grammar is None:
        grammar = grammar_of(r, grammar_tokenizer)
    if grammar is not None:
        given["grammar"] = grammar
    # Width, layers per step and token source: the request's, else the router's default;
    # 0 or "auto" leaves them to the router's tuning.
    for name in ("width", "layers_per_step"):
        value = getattr(r, name) if r.HasField(name) else getattr(defaults, name)
        if value in (0, AUTO) or (value is None and tuned_by_default):
            auto.add(name)
        elif value is not None:
            given[name] = int(value)
    if source == AUTO:
        auto.add("token_source")
    elif source:
        given["token_source"] = source
    try:
        sampling = SamplingParams(**sampled)
        check_logit_bias(sampling, model.vocab_size)
        opts = DecodeOptions(
            sampling=sampling,
            stop_token_ids=tuple(dict.fromkeys(stops)),
            **given,
        )
        check_context(len(prompt), opts.max_new_tokens, model.max_positions)
    except ValueError as e:
        raise invalid(str(e)) from None
    if opts.prompt_logprobs is not None:
        check_prompt_logprobs(len(prompt), opts.prompt_logprobs)
    resume = tuple(r.resume_token_ids)
    check_resume(resume, model, opts)
    stages = len(model.ranges)  # 0: not known yet
    space = None
    if auto:
        space = TuningSpace(
            width=None if "width" in auto else opts.width,
            layers_per_step=None if "layers_per_step" in auto else opts.layers_per_step,
            token_source=None if "token_source" in auto else opts.token_source,
            has_draft=has_draft,
            stages=stages,
            growth=None if "growth" in auto else opts.growth,
        )
    return Plan(prompt=prompt, mode=mode, opts=opts, space=space, resume=resume)


def mode_and_source(
    r: gen.GenerateRequest, defaults: RequestDefaults, has_draft: bool
) -> tuple[Mode, str]:
    """The request's mode and token source ("": the engine's; "auto": the router's
    choice, the default of a specpipe request with a draft), refused where they need a
    draft this deployment lacks."""
    try:
        mode = Mode(r.mode or Mode.SPECPIPE)
    except ValueError:
        modes = ", ".join(m.value for m in Mode)
        raise invalid(f"unknown mode {r.mode!r} (choose from {modes})") from None
    tuned_by_default = mode == Mode.SPECPIPE and has_draft
    source = r.token_source or defaults.token_source or (AUTO if tuned_by_default else "")
    # "auto" may choose the n-gram source only where the router tunes (specpipe).
    model_free = source == "ngram" or (source == AUTO and mode == Mode.SPECPIPE)
    if mode.uses_draft and not model_free and not has_draft:
        raise InvalidRequest(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"mode {mode} needs a draft and this deployment has none (use pp)",
        )
    return mode, source


def stop_tokens(r: gen.GenerateRequest, model: ModelInfo) -> list[int]:
    """The request's stop token ids, checked, after the model's end-of-sequence tokens
    (unless it ignores them)."""
    if len(r.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(r.stop_token_ids)}")
    stops = list(r.stop_token_ids)
    bad = [t for t in stops if not 0 <= t < model.vocab_size]
    if bad:
        raise invalid(f"stop token ids {bad[:4]} are outside the vocabulary")
    return stops if r.ignore_eos else [*model.eos_token_ids, *stops]


def check_resume(resume: tuple[int, ...], model: ModelInfo, opts: DecodeOptions) -> None:
    """Refuse resume token ids the request cannot have produced: outside the vocabulary,
    more than max_new_tokens, a stop token before the last, or (with a response_format)
    tokens its grammar does not allow."""
    if not resume:
        return
    try:
        check_resume_ids(resume, model.vocab_size, opts.max_new_tokens, opts.stop_token_ids)
    except ValueError as e:
        raise invalid(str(e)) from None
    if opts.grammar is not None and not opts.grammar.state().follows(resume):
        raise invalid("resume_token_ids do not follow the request's response_format")
