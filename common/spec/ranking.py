"""Which candidate children become tree nodes: ranked by the chance that the target's own
decoding takes them (docs/architecture.md, "2. Token tree", "Ranking").

A node is worth computing ahead only if the target can reach it, and the target decodes
by the request's rule, not by the draft's beam. `Ranking.BEAM` (the paper's) keeps the
best `width` children of a layer by cumulative draft probability; it can drop the path
the target takes even when the draft is perfect, because the target's greedy path need
not be the most probable one (issue 11 reports 0.63 tokens per step on 7 stages with the
target as its own draft, ideal 0.91; `tests/unit/test_layers.py` builds such a draft).
`Ranking.TARGET` (the default) ranks by the rule:

- greedy: the target takes a node iff the node's token is its argmax at every ancestor.
  The chain of the source's best proposals from the root (its own greedy continuation)
  comes first, so it always survives the width limit; every other node ranks by
  cumulative probability, like the beam. A candidate that is not its parent's best
  proposal is a *deviation*; the tree counts them per path.
  Measured (`bench_tree_policy.py`, Qwen pair, S = 8, K = 2, W = 16, greedy): an
  earlier version ranked by the number of deviations first, so a path with two likely
  deviations (0.24, then 0.31 two tokens later) lost to every path with one, however
  unlikely (0.001), and the tree missed where the target deviates twice within the S·K
  levels it runs ahead; the chain-first rule gave 1.280 tokens per step against 1.185.
  (A softer sharpening that gives every best proposal the request's measured agreement
  and the others the rest by their shares did worse than both: it discards the draft's
  confidence along the chain.)
- sampling: the source's distribution under the request's temperature (the draft applies
  it), top-k and top-p, renormalized per parent: a candidate the request's top-k/top-p
  rules out gets no node; the others rank by cumulative probability.

The tree keeps, per node, the cumulative log score and deviation count of its path; a
layer keeps its best `width` candidates by (any deviation, -score).
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .sampling import SamplingParams


class Ranking(StrEnum):
    TARGET = "target"
    BEAM = "beam"


def sibling_ranks(
    parents: ArrayLike, probs: ArrayLike
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
    """Per candidate: its parent's group index, its rank among its siblings by probability
    (0 = best; ties: the earlier candidate first), and the probability mass of the
    siblings ranked before it."""
    p = np.asarray(probs, dtype=np.float64)
    parents = np.asarray(parents).reshape(-1)
    n = p.size
    order = np.lexsort((-p, parents))  # by parent, then probability down, then position
    g, p = parents[order], p[order]
    first = np.ones(n, dtype=bool)
    first[1:] = g[1:] != g[:-1]
    idx = np.arange(n)
    start = np.maximum.accumulate(np.where(first, idx, 0))
    before_all = np.cumsum(p) - p
    rank, before = np.empty_like(idx), np.empty_like(p)
    group = np.empty_like(idx)
    rank[order] = idx - start
    before[order] = before_all - before_all[start]
    group[order] = np.cumsum(first) - 1  # parents in increasing order, as np.unique's
    return group, rank, before


def best_siblings(parents: ArrayLike, probs: ArrayLike) -> NDArray[np.bool_]:
    """Whether each candidate is its parent's best proposal: `sibling_ranks`' rank 0
    (the highest probability, the earlier candidate on ties, NaN never before a number).
    One pass in plain Python: on a layer's tens of candidates it costs a fraction of
    the sorts `sibling_ranks` needs (numpy's fixed cost per call dominates there)."""
    p = np.asarray(probs, dtype=np.float64).reshape(-1).tolist()
    best: dict[int, int] = {}
    for i, g in enumerate(np.asarray(parents).reshape(-1).tolist()):
        j = best.get(g)
        if j is None or p[i] > p[j] or (p[j] != p[j] and p[i] == p[i]):
            best[g] = i
    out = np.zeros(len(p), dtype=bool)
    out[list(best.values())] = True
    return out


def edge_scores(
    parents: ArrayLike, probs: ArrayLike, ranking: Ranking, sampling: SamplingParams
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """(log score, deviation 0/1) of each candidate as the child of its parent (`parents`
    identifies the parent of each candidate); a log score of -inf: never a node."""
    p = np.asarray(probs, dtype=np.float64)
    zero = np.zeros(p.size, dtype=np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        if ranking == Ranking.BEAM or p.size == 0:
            return np.log(p), zero
        if sampling.greedy:
            return np.log(p), (~best_siblings(parents, p)).astype(np.int64)
        group, rank, before = sibling_ranks(parents, p)

        def per_parent(x: NDArray[np.float64]) -> NDArray[np.float64]:
            return np.bincount(group, weights=x)[group]

        keep = np.ones(p.size, dtype=bool)
        if sampling.top_k:
            keep &= rank < sampling.top_k
            # Renormalize over the top-k where the candidates hold all of it (as the
            # target's rule does: temperature, then top-k, then top-p).
            whole = per_parent(np.ones_like(p)) >= sampling.top_k
            mass = np.where(whole, per_parent(p * keep), 1.0)
            p, before = p / mass, before / mass
        if sampling.top_p < 1.0:
            keep &= before < sampling.top_p  # the mass before it has not reached top_p yet
            # The nucleus's mass: the kept candidates', or top_p where it extends beyond.
            p = p / np.maximum(per_parent(p * keep), sampling.top_p)
        return np.where(keep, np.log(p), -np.inf), zero
