"""Which candidate children become tree nodes: ranked by the chance that the target's own
decoding takes them (docs/architecture.md, "2.6 Several tree layers per step").

A node is worth computing ahead only if the target can reach it, and the target decodes
by the request's rule, not by the draft's beam. `Ranking.BEAM` (the paper's) keeps the
best `width` children of a layer by cumulative draft probability; it can drop the path
the target takes even when the draft is perfect, because the target's greedy path need
not be the most probable one (issue 11 reports 0.63 tokens per step on 7 stages with the
target as its own draft, ideal 0.91; `tests/unit/test_layers.py` builds such a draft).
`Ranking.TARGET` (the default) ranks by the rule:

- greedy: the target takes a node iff its token is the target's argmax at every
  ancestor. Sharpened toward the source's argmax: a parent's best proposal is taken
  with the *agreement* a (how often the target took its parent's best proposal so far
  in this request, with a prior of 0.9: `agreement_estimate`), the other proposals share
  the remaining 1 - a in proportion to their probabilities; nodes rank by the product
  along their path. With a > 1/2 every node's best child outranks its siblings and the
  chain of best proposals from the root (the source's own greedy continuation) always
  survives the width limit; unlike cumulative draft probability, a deep continuation
  does not crowd out a likely departure nearer the root. `Ranking.ARGMAX` is the limit
  a -> 1: deviations from the best proposals counted first, then probability.
- sampling: the source's distribution under the request's temperature (the draft applies
  it), top-k and top-p, renormalized per parent: a candidate the request's top-k/top-p
  rules out gets no node; the others rank by cumulative probability.

The tree keeps, per node, the cumulative log score and deviation count of its path (and
whether it was its parent's best proposal); a layer keeps its best `width` candidates by
(deviations, -score).
"""

from __future__ import annotations

import math
from enum import StrEnum

import torch
from torch import Tensor

from .sampling import SamplingParams


class Ranking(StrEnum):
    TARGET = "target"
    ARGMAX = "argmax"  # greedy: deviations first, then cumulative probability (the limit)
    BEAM = "beam"


DEFAULT_AGREEMENT = 0.9  # prior: the target takes the best proposal 9 times in 10
PRIOR_WEIGHT = 10  # ... worth this many verifications
MAX_AGREEMENT = 0.999  # never certain: other proposals keep some chance


def sibling_ranks(parents: Tensor, probs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per candidate: its parent's group index, its rank among its siblings by probability
    (0 = best; ties: the earlier candidate first), and the probability mass of the
    siblings ranked before it."""
    n = probs.numel()
    _, group = torch.unique(parents, return_inverse=True)
    order = torch.argsort(probs, descending=True, stable=True)
    order = order[torch.argsort(group[order], stable=True)]
    g, p = group[order], probs[order]
    first = torch.ones(n, dtype=torch.bool)
    first[1:] = g[1:] != g[:-1]
    idx = torch.arange(n)
    start = torch.cummax(torch.where(first, idx, 0), 0).values
    before_all = torch.cumsum(p, 0) - p
    rank, before = torch.empty_like(idx), torch.empty_like(p)
    rank[order] = idx - start
    before[order] = before_all - before_all[start]
    return group, rank, before


def edge_scores(
    parents: Tensor,
    probs: Tensor,
    ranking: Ranking,
    sampling: SamplingParams,
    agreement: float = DEFAULT_AGREEMENT,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log score, deviation 0/1, best) of each candidate as the child of its parent
    (`parents` identifies the parent of each candidate): a log score of -inf means never
    a node; a deviation counts before any score (ranked by deviations first); best:
    whether it is its parent's best proposal.

    `agreement` (greedy `TARGET`): the chance that the target's token is its parent's
    best proposal (measured by the controller)."""
    p = probs.to(torch.float64)
    zero = torch.zeros(p.numel(), dtype=torch.int64)
    if p.numel() == 0:
        return p, zero, zero.bool()
    group, rank, before = sibling_ranks(parents, p)
    best = rank == 0
    if ranking == Ranking.BEAM:
        return torch.log(p), zero, best

    def per_parent(x: Tensor) -> Tensor:
        return torch.zeros(int(group.max()) + 1, dtype=x.dtype).index_add_(0, group, x)[group]

    if sampling.greedy:
        if ranking == Ranking.ARGMAX:
            return torch.log(p), (~best).to(torch.int64), best
        # The best proposal is taken with the measured agreement; the rest of the chance
        # is shared by the other proposals in proportion to their probabilities, of the
        # mass the best leaves (or of their own, where merged sources exceed it).
        a = min(max(agreement, 0.5), MAX_AGREEMENT)
        others = per_parent(torch.where(best, 0.0, p))
        rest = torch.maximum(1.0 - per_parent(torch.where(best, p, 0.0)), others).clamp(min=1e-12)
        pi = torch.where(best, a, (1.0 - a) * p / rest)
        return torch.log(pi), zero, best

    keep = torch.ones(p.numel(), dtype=torch.bool)
    if sampling.top_k:
        keep &= rank < sampling.top_k
        # Renormalize over the top-k where the candidates hold all of it (as the target's
        # rule does: temperature, then top-k, then top-p).
        whole = per_parent(torch.ones_like(p)) >= sampling.top_k
        mass = torch.where(whole, per_parent(p * keep), 1.0)
        p, before = p / mass, before / mass
    if sampling.top_p < 1.0:
        keep &= before < sampling.top_p  # the mass before it has not reached top_p yet
        # The nucleus's mass: the kept candidates', or top_p where it extends beyond them.
        p = p / per_parent(p * keep).clamp(min=sampling.top_p)
    return torch.where(keep, torch.log(p), -math.inf), zero, best


def agreement_estimate(agreed: int, verified: int) -> float:
    """The chance that the target takes its parent's best proposal, from a request's
    verifications so far (`agreed` of `verified` did), with a prior of
    `DEFAULT_AGREEMENT` worth `PRIOR_WEIGHT` verifications."""
    return (agreed + DEFAULT_AGREEMENT * PRIOR_WEIGHT) / (verified + PRIOR_WEIGHT)
