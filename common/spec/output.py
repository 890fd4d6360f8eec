"""A request's verified tokens and its stopping rule."""

from __future__ import annotations

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
    # one per prompt token after the first, for a request that asked for them (None
    # until the first verification brings them)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    finish_reason: str = "length"
    hits: int = 0  # emitted tokens that were already in the tree when verified

    def emit(self, token: int, logprobs: TokenLogprobs | None = None) -> bool:
        """Record a verified token; True when generation must stop."""
        self.tokens.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if token in self.stop_token_ids:
            self.finish_reason = "stop"
            return True
        return len(self.tokens) >= self.max_new_tokens
