"""What one request's decoding did: steps, tokens, hits and a per-step trace.

The figures a request reports have one set of names everywhere: `record()` gives them
(ratios rounded to `RATIO_DIGITS`); the router sends them as `SpeculationStats`, whose
fields carry the same names (`services/stats_wire.py`); `--json` output prints
`SUMMARY_KEYS` under "stats" and `SPECULATION_KEYS` under "speculation".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

SUMMARY_KEYS = (
    "mode",
    "stages",
    "width",
    "prefill_steps",
    "decode_steps",
    "new_tokens",
    "tokens_per_step",
    "hit_rate",
)
SPECULATION_KEYS = (
    "regrowths",
    "steady_tokens_per_step",
    "layers_per_step",
    "token_source",
    "draft_hit_rate",
    "ngram_hit_rate",
)
RECORD_KEYS = (
    *SUMMARY_KEYS,
    "verifications",
    *SPECULATION_KEYS,
    "late_draft_answers",
    "replays",
    "draft_drops",
)
RATIO_DIGITS = 6


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
    # specpipe: draft answers still outstanding at a later step's verification (only an
    # asynchronous executor sees any; while there are none, its steps are lockstep's)
    late_draft_answers: int = 0
    # faults: re-opens of the request on another path (`Controller.replay`; the
    # re-prefill's steps count as decode steps) and losses of the draft after which it
    # went on without one (`Controller.drop_draft`)
    replays: int = 0
    draft_drops: int = 0
    # a resumed request (`Controller.resume`): output tokens the client already held
    # (from a router that died), re-prefilled rather than drawn here
    resumed_tokens: int = 0
    # per hit, the depth below the root of its time at which the draft proposed the
    # token (specpipe: layers ahead of the verification; specinfer: place in the path)
    hit_depths: list[int] = field(default_factory=list)
    # specpipe: tree layers entering stage 1 per step; what proposed the tree's tokens
    # ("draft", "ngram", "hybrid"; empty without a tree)
    layers_per_step: int = 1
    token_source: str = ""
    # emitted tokens that were tree nodes proposed by the draft model / the n-gram
    # source (a token both proposed counts for both)
    draft_hits: int = 0
    ngram_hits: int = 0
    # emitted tokens that were tree nodes the grammar forced (the only token allowed)
    forced_hits: int = 0
    # per decode step (as `trace`): the rows of each draft forward (specpipe grows
    # `layers_per_step` layers a step, one forward each)
    draft_forwards: list[list[int]] = field(default_factory=list)

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

    @property
    def draft_hit_rate(self) -> float:
        """Share of emitted tokens that were tree nodes the draft model proposed."""
        return self.draft_hits / self.new_tokens if self.new_tokens else 0.0

    @property
    def ngram_hit_rate(self) -> float:
        """Share of emitted tokens that were tree nodes the n-gram source proposed."""
        return self.ngram_hits / self.new_tokens if self.new_tokens else 0.0

    def record(self) -> dict[str, object]:
        """Every reported figure by its name (see the module docstring)."""
        out: dict[str, object] = {k: getattr(self, k) for k in RECORD_KEYS}
        ratios = ("tokens_per_step", "hit_rate", "steady_tokens_per_step")
        for k in (*ratios, "draft_hit_rate", "ngram_hit_rate"):
            out[k] = round(float(out[k]), RATIO_DIGITS)
        return out

    def summary(self) -> dict[str, object]:
        """The "stats" object of `--json` output."""
        return summary_of(self.record())

    def speculation(self) -> dict[str, object]:
        """The "speculation" object of `--json` output (beside "stats")."""
        return speculation_of(self.record())


def summary_of(record: Mapping[str, object]) -> dict[str, object]:
    return {k: record[k] for k in SUMMARY_KEYS if k in record}


def speculation_of(record: Mapping[str, object]) -> dict[str, object]:
    return {k: record[k] for k in SPECULATION_KEYS if k in record}
