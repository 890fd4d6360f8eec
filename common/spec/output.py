"""A request's verified tokens and its stopping rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .messages import TokenLogprobs
from .sampling import SamplingParams


@dataclass
class OutputState:
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    # one per token, for a request that asked for logprobs
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # prompt logprobs: the top alternatives asked for (None: none), and one per prompt
    # token after the first once the request's first verification brought them
    prompt_top: int | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def prompt_logprobs_due(self) -> int | None:
        """The top alternatives of prompt logprobs asked for and still to come (while
        they are, a replay asks again, and no prefill starts after a cached prefix:
        cached rows have no logits to score the prompt with)."""
        return self.prompt_top if self.prompt_logprobs is None else None

    def take_prompt_logprobs(self, found: Sequence[TokenLogprobs] | None, prompt_len: int) -> None:
        """What an accepted verification brought: taken when due and one per prompt
        token after the first (else they stay due, and the request fails)."""
        if self.prompt_logprobs_due is not None and len(found or ()) == prompt_len - 1:
            self.prompt_logprobs = tuple(found or ())

    finish_reason: str = "length"
    hits: int = 0  # emitted tokens that were already in the tree when verified
    # tokens the client already held when the request was resumed (`resume`); they
    # have no logprobs here (the client has them)
    resumed: int = 0
    finished: bool = False  # generation must stop (a stop token, or max_new_tokens)

    def resume(self, tokens: Sequence[int]) -> None:
        """The output starts with `tokens`, which the client already holds (a resumed
        request). They follow the stopping rule as emitted ones do; only the last may
        end generation (the router refuses others: `check_resume`)."""
        for t in tokens:
            self.emit(int(t))
        self.resumed = len(tokens)

    def logprobs_at(self, index: int, count: int) -> list[TokenLogprobs]:
        """The logprobs of output tokens `index`.. (`count` of them), among those drawn
        here (a resumed request's first `resumed` have none)."""
        start = index - self.resumed
        return self.logprobs[max(start, 0) : max(start + count, 0)]

    def emit(self, token: int, logprobs: TokenLogprobs | None = None) -> bool:
        """Record a verified token; True when generation must stop."""
        self.tokens.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if token in self.stop_token_ids:
            self.finish_reason = "stop"
            self.finished = True
        elif len(self.tokens) >= self.max_new_tokens:
            self.finished = True
        return self.finished
