"""Token selection from the target's distribution.

The random draw for output position p depends only on (seed, p). Every decoding mode
therefore emits exactly the tokens plain decoding emits for the same seed: speculation
only decides whether the continuation was computed ahead of time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


def sample_token(logits: Tensor, params: SamplingParams, position: int) -> int:
    """Draw the token at output `position` from `logits` [vocab]."""
    return int(draw_index(logits, params, position))


def draft_probs(logits: Tensor, temperature: float) -> Tensor:
    """Draft ranking distribution [n, vocab]: mirrors the target's temperature when sampling."""
    temp = temperature if temperature > 0 else 1.0
    return torch.softmax(logits.float() / temp, dim=-1)
