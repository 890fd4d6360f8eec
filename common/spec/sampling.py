"""Token selection from the target's distribution.

The random draw for output position p depends only on (seed, p). Every decoding mode
therefore emits exactly the tokens plain decoding emits for the same seed: speculation
only decides whether the continuation was computed ahead of time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import torch
from torch import Tensor

# Bounds of the logits rules (vLLM's and OpenAI's; docs/api.md, "Penalties, logit bias
# and min_tokens").
MAX_REPETITION_PENALTY = 2.0
MAX_FREQUENCY_PENALTY = 2.0  # frequency and presence penalties lie in [-2, 2]
MAX_LOGIT_BIAS = 100.0  # a bias is clamped to [-100, 100], as OpenAI and vLLM
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from the target's logits: first the logits rules (logit bias,
    then the penalties: `penalties.py`, vLLM's definitions and order), then temperature,
    top-k and top-p."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0
    seed: int = 0
    # over the prompt's and the output's tokens: a positive logit divided by it, a
    # negative one multiplied (1: none)
    repetition_penalty: float = 1.0
    # over the output's tokens: logit -= frequency * count + presence * (count > 0)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # token id -> added to its logit (clamped to [-100, 100]); read-only after checks
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        self._check_rules()
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    def _check_rules(self) -> None:
        rep = self.repetition_penalty
        if not math.isfinite(rep) or not 0.0 < rep <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {rep}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_FREQUENCY_PENALTY <= value <= MAX_FREQUENCY_PENALTY:  # also NaN
                raise ValueError(
                    f"{name} must be in [-{MAX_FREQUENCY_PENALTY}, {MAX_FREQUENCY_PENALTY}], "
                    f"got {value}"
                )
        bias = dict(self.logit_bias or {})
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias has {len(bias)} entries: at most {MAX_LOGIT_BIAS_ENTRIES}"
            )
        checked: dict[int, float] = {}
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (>= 0), got {token!r}")
            value = float(value)
            if math.isnan(value):
                raise ValueError(f"logit_bias of token {token} is not a number")
            checked[int(token)] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
        object.__setattr__(self, "logit_bias", MappingProxyType(checked))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        """Whether a penalty reads the request's tokens (they are then counted)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution tokens are drawn from: temperature, then top-k, then top-p (as HF)."""
    logits = logits.double() / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p.
        drop_sorted = (sorted_p.cumsum(0) - sorted_p) >= params.top_p
        probs = probs.masked_fill(drop_sorted.scatter(0, order, drop_sorted), 0.0)
        probs = probs / probs.sum()
    return probs


def position_uniform(seed: int, position: int) -> float:
    return float(np.random.default_rng([seed, position]).random())


def draw_index(logits: Tensor, params: SamplingParams, position: int) -> Tensor:
    """The token at output `position` as a 0-d tensor on `logits`' device: every tensor
    of the draw stays there (a GPU's logits never meet a host tensor), and nothing is
    read back until the caller asks for the id."""
    if params.greedy:
        return torch.argmax(logits)
    probs = target_probs(logits, params)
    cdf = probs.cumsum(0)
    u = torch.tensor([position_uniform(params.seed, position)], dtype=cdf.dtype, device=cdf.device)
    u = u * cdf[-1]
    idx = torch.searchsorted(cdf, u, right=True)[0]
    # Never land on a zero-probability token through rounding at the top of the CDF.
    ids = torch.arange(probs.numel(), device=probs.device)
    return torch.minimum(idx, torch.where(probs > 0, ids, 0).max())


def draft_probs(logits: Tensor, temperature: float) -> Tensor:
    """Draft ranking distribution [n, vocab]: mirrors the target's temperature when sampling.
    Greedy (or a temperature of 1): the softmax of the logits as they are, no division by
    1 (the same values, one operation fewer per step)."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return torch.softmax(logits, dim=-1)
