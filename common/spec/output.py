"""A request's verified tokens and its stopping rule."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from .sampling import SamplingParams, sample_token


@dataclass
class OutputState:
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    hits: int = 0  # emitted tokens that were already in the tree when verified

    def sample(self, logits: Tensor) -> int:
        """The target's token at the next position (the draw depends on (seed, position))."""
        return sample_token(logits, self.sampling, len(self.tokens))

    def emit(self, token: int) -> bool:
        """Record a verified token; True when generation must stop."""
        self.tokens.append(token)
        if token in self.stop_token_ids:
            self.finish_reason = "stop"
            return True
        return len(self.tokens) >= self.max_new_tokens
