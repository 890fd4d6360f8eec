"""What one request's decoding did: steps, tokens, hits and a per-step trace."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    mode: str
    stages: int
    width: int
    prefill_steps: int = 0
    decode_steps: int = 0
    new_tokens: int = 0
    verifications: int = 0  # root verifications (specpipe/pp) or tree passes (specinfer)
    hits: int = 0  # emitted tokens that were already in the tree when verified
    finish_reason: str = "length"
    regrowths: int = 0  # specpipe: the newest layer was pruned away and regrown from reserves
    root_children: list[int] = field(
        default_factory=list
    )  # children of the root at each verification
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per specinfer pass
    # per step: rows each stage computed, then rows the draft computed
    trace: list[list[int]] = field(default_factory=list)
    # decode step (1-based count) at which each token was emitted
    emit_steps: list[int] = field(default_factory=list)
    # specinfer: rows of every draft forward, per pass (the draft works before each pass)
    draft_layers: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.decode_steps if self.decode_steps else 0.0

    @property
    def steady_tokens_per_step(self) -> float:
        """Tokens per step after the first token (which must cross the empty pipeline)."""
        if len(self.emit_steps) < 2 or self.emit_steps[-1] == self.emit_steps[0]:
            return 0.0
        return (len(self.emit_steps) - 1) / (self.emit_steps[-1] - self.emit_steps[0])

    @property
    def hit_rate(self) -> float:
        return self.hits / self.new_tokens if self.new_tokens else 0.0

    def summary(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "stages": self.stages,
            "width": self.width,
            "prefill_steps": self.prefill_steps,
            "decode_steps": self.decode_steps,
            "new_tokens": self.new_tokens,
            "tokens_per_step": round(self.tokens_per_step, 6),
            "hit_rate": round(self.hit_rate, 6),
        }
