"""What a request asks for: the decoding mode and its options, and the checks every
entry point (the command line, the in-process engine, the router) runs on a prompt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from .grammar import Grammar
from .ranking import Ranking
from .sampling import SamplingParams

# Defaults of `DecodeOptions`, also the command line's (`specpipe generate`, `client generate`).
DEFAULT_MAX_NEW_TOKENS = 64  # the command line's; `DecodeOptions` requires a value
DEFAULT_WIDTH = 8  # tree nodes kept per layer
# draft candidates per node (capped by width; top-w of every leaf contains the global top-w)
DEFAULT_TOP_K_CHILDREN = 64
DEFAULT_SPECINFER_DEPTH = 8  # layers of a SpecInfer tree
DEFAULT_PREFILL_CHUNK = 128
DEFAULT_LAYERS_PER_STEP = 1  # tree layers entering stage 1 per step (1: the paper's SpecPipe)
# At S = 1 a step of one layer verifies one token, as plain decoding does without the
# draft's cost: there the default is classic speculative decoding, several levels a step.
DEFAULT_LAYERS_PER_STEP_ONE_STAGE = 3

# Sanity bounds, checked by `DecodeOptions` for every entry point.
MAX_WIDTH = 256
MAX_TOP_K_CHILDREN = 1024
MAX_SPECINFER_DEPTH = 64
MAX_PREFILL_CHUNK = 1 << 14  # rows per forward; a stage takes no more in one activation
# Prefill chunks of one prompt, at most: the router sends them at once, and a stage holds
# at most `ordering.MAX_PENDING` (4096) waiting activations of one request, so chunks
# priced by rows x keys (`growth.chunk_spans`) never get smaller than prompt / this.
MAX_PREFILL_CHUNKS = 2048
MAX_NEW_TOKENS = 1 << 20
MAX_LAYERS_PER_STEP = 16
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's bound)
MAX_STOP_TOKEN_IDS = 1024  # a client's (every emitted token is checked against them)


class Mode(StrEnum):
    """How a request decodes (docs/architecture.md, "4. Modes and baselines")."""

    SPECPIPE = "specpipe"
    PP = "pp"
    SPECINFER = "specinfer"
    AUTOREGRESSIVE = "autoregressive"

    @property
    def uses_draft(self) -> bool:
        return self in (Mode.SPECPIPE, Mode.SPECINFER)


class TokenSource(StrEnum):
    """What proposes the tree's tokens (docs/architecture.md, "2. Token tree", "Token
    sources")."""

    DRAFT = "draft"  # the draft model (a draft service)
    NGRAM = "ngram"  # n-gram lookup over prompt and output: no model, no draft service
    HYBRID = "hybrid"  # both, merged into one tree layer

    @property
    def uses_model(self) -> bool:
        return self != TokenSource.NGRAM

    @property
    def uses_ngram(self) -> bool:
        return self != TokenSource.DRAFT


class Growth(StrEnum):
    """When a layer grows from the token source's answer, relative to the verification
    of the same step (docs/architecture.md, "3. The pipeline step", "When a layer grows")."""

    # after it: the layer grows from the nodes the verification kept, so the whole width
    # goes where the target can still go (lockstep's rule); in the services the
    # verification's round trip (logits to the router, the feed back to stage 1) lies
    # between the last stage's step and stage 1's next one
    VERIFIED = "verified"
    # before it, as soon as the source answers: stage 1's next input is ready when it
    # finishes a step, and the verification then prunes what it rules out, at the price
    # of the width spent on nodes it drops
    EAGER = "eager"


@dataclass(frozen=True)
class DecodeOptions:
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    width: int = DEFAULT_WIDTH
    top_k_children: int = DEFAULT_TOP_K_CHILDREN
    depth: int = DEFAULT_SPECINFER_DEPTH  # specinfer: tree layers (one name on every surface)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    # at most this many rows x keys per prefill chunk (`growth.chunk_spans`; None: rows
    # only): the router sets its stages' bound, so a chunk deep in a long prompt costs a
    # step no more than one near its start and decodes beside it keep their pace
    prefill_cells: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # specpipe: tree layers entering stage 1 per step (K); the last stage verifies down
    # the tree as far as logits are there, so a step may emit up to K tokens
    layers_per_step: int = DEFAULT_LAYERS_PER_STEP
    token_source: TokenSource = TokenSource.DRAFT
    ranking: Ranking = Ranking.TARGET
    growth: Growth = Growth.VERIFIED
    # report each token's logprob and this many top alternatives (0-20; None: none):
    # log_softmax of the target's raw logits, as vLLM's default (`verify.rows_logprobs`)
    logprobs: int | None = None
    # the same for the prompt's tokens (each given the ones before it), reported once:
    # the prefill is then computed whole (cached rows have no logits)
    prompt_logprobs: int | None = None
    # structured output: the grammar every token is drawn under and the tree grows
    # under (`grammar.py`; compiled from the request's response_format with the
    # tokenizer); None: unconstrained
    grammar: Grammar | None = None
    # the stop tokens (`stop_token_ids`: the end-of-sequence tokens and the request's)
    # cannot be drawn before this many tokens are out (`penalties.py`)
    min_tokens: int = 0
    # with a grammar: where it allows exactly one token, the tree gets that token as a
    # child without the draft (forced tokens: a sure hit); False only to measure it
    forced_tokens: bool = True

    def __post_init__(self) -> None:
        # Plain strings are accepted (and checked) where the enums are expected.
        object.__setattr__(self, "token_source", TokenSource(self.token_source))
        object.__setattr__(self, "ranking", Ranking(self.ranking))
        object.__setattr__(self, "growth", Growth(self.growth))
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.max_new_tokens > MAX_NEW_TOKENS:
            raise ValueError(
                f"max_new_tokens {self.max_new_tokens} is too large (at most {MAX_NEW_TOKENS})"
            )
        for name, high in (
            ("width", MAX_WIDTH),
            ("top_k_children", MAX_TOP_K_CHILDREN),
            ("depth", MAX_SPECINFER_DEPTH),
            ("prefill_chunk", MAX_PREFILL_CHUNK),
            ("layers_per_step", MAX_LAYERS_PER_STEP),
        ):
            value = getattr(self, name)
            if not 1 <= value <= high:
                raise ValueError(f"{name} must be in [1, {high}], got {value}")
        if self.prefill_cells is not None and self.prefill_cells < 1:
            raise ValueError(f"prefill_cells must be positive, got {self.prefill_cells}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_new_tokens = {self.max_new_tokens}], "
                f"got {self.min_tokens}"
            )
        if self.grammar is not None:
            # A complete output allows only the grammar's end-of-sequence tokens: they end
            # the request (finish reason "stop").
            eos = sorted(self.grammar.tokenizer.eos_tokens)
            stops = tuple(dict.fromkeys([*self.stop_token_ids, *eos]))
            object.__setattr__(self, "stop_token_ids", stops)


def default_layers_per_step(stages: int) -> int:
    """Tree layers per step where nothing sets them, with `stages` pipeline stages."""
    return DEFAULT_LAYERS_PER_STEP_ONE_STAGE if stages == 1 else DEFAULT_LAYERS_PER_STEP


def tree_capacity(mode: Mode, stages: int, opts: DecodeOptions) -> int:
    """Upper bound on tree rows a stage or the draft caches at once for this mode."""
    if mode == Mode.SPECPIPE:
        k = opts.layers_per_step
        return (stages * k + k + 2) * opts.width + 2
    if mode == Mode.SPECINFER:
        return opts.depth * opts.width + 2
    return 2


def step_rows(mode: Mode, opts: DecodeOptions) -> int:
    """The most tree rows one activation of a request carries (a SpecInfer tree fed
    whole, K SpecPipe layers with their root), prefill chunks aside."""
    if mode == Mode.SPECPIPE:
        return opts.layers_per_step * opts.width + 1
    if mode == Mode.SPECINFER:
        return opts.depth * opts.width + 1
    return 1


def check_step_rows(mode: Mode, opts: DecodeOptions, max_rows: int) -> None:
    """Reject a request that would send a stage or the draft more than `max_rows` rows
    in one step (the deployment's cap, which the stages and the draft enforce)."""
    if opts.prefill_chunk > max_rows:
        raise ValueError(
            f"prefill_chunk {opts.prefill_chunk} is above the {max_rows} rows one step may "
            "take on this deployment's stages and draft: use a smaller prefill_chunk"
        )
    rows = step_rows(mode, opts)
    if rows > max_rows:
        shape = (
            f"{opts.depth} layers of width {opts.width}"
            if mode == Mode.SPECINFER
            else f"{opts.layers_per_step} layers per step of width {opts.width}"
        )
        raise ValueError(
            f"a {mode} tree of {rows} rows in one step ({shape}) is above the {max_rows} "
            "rows one step may take on this deployment's stages and draft: use a smaller "
            "width or depth"
        )


def check_prompt_ids(prompt_ids: Sequence[int], vocab_size: int) -> None:
    """Reject a prompt no mode can serve (the CLI, the engine and the router share this)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:4]} are outside the vocabulary [0, {vocab_size})")


def check_logit_bias(sampling: SamplingParams, vocab_size: int) -> None:
    """Reject a logit bias on a token the model does not have (every entry point)."""
    bad = sorted(t for t in sampling.logit_bias if t >= vocab_size)
    if bad:
        raise ValueError(
            f"logit_bias token ids {bad[:4]} are outside the vocabulary [0, {vocab_size})"
        )


def check_resume_ids(
    resume_ids: Sequence[int], vocab_size: int, max_new_tokens: int, stop_token_ids: Sequence[int]
) -> None:
    """Reject output tokens a resumed request cannot have been given (`Controller.resume`):
    ids outside the vocabulary, more than max_new_tokens, a stop token before the last."""
    bad = [t for t in resume_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"resume token ids {bad[:4]} are outside the vocabulary [0, {vocab_size})")
    if len(resume_ids) > max_new_tokens:
        raise ValueError(
            f"{len(resume_ids)} resume token ids are more than max_new_tokens "
            f"({max_new_tokens}): resume with the request's own max_new_tokens"
        )
    stops = set(stop_token_ids)
    early = [i for i, t in enumerate(resume_ids[:-1]) if t in stops]
    if early:
        raise ValueError(
            f"resume token {early[0]} is a stop token: the output it resumes ended there"
        )


def check_context(prompt_len: int, max_new_tokens: int, max_context: int) -> None:
    """Reject a request whose prompt plus output cannot fit the model's context."""
    if prompt_len >= max_context:
        raise ValueError(
            f"the prompt has {prompt_len} tokens; the context holds {max_context}, "
            "including at least one new token"
        )
    if prompt_len + max_new_tokens > max_context:
        room = max_context - prompt_len
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context of {max_context} tokens: the prompt leaves room for {room}"
        )
