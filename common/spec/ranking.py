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

import math
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
    p = np.asarray(probs, dtype=np.float64).reshape(-1).tolist()
    group, rank, before = _sibling_ranks(np.asarray(parents).reshape(-1).tolist(), p)
    return (np.array(group, dtype=np.int64), np.array(rank, dtype=np.int64),
            np.array(before, dtype=np.float64))  # fmt: skip


def _sibling_ranks(parents: list[int], p: list[float]) -> tuple[list[int], list[int], list[float]]:
    """`sibling_ranks` on lists, in plain Python: a layer's tens of candidates cost less
    so than in numpy's sorts and scans. The masses are the floats numpy's cumulative sum
    gave: one running sum over the candidates ordered by parent, then probability down
    (NaN last, as numpy sorts it), minus the sum at the group's start."""
    n = len(p)
    # stable: ties by position
    order = sorted(
        range(n), key=lambda i: (parents[i], p[i] != p[i], -p[i] if p[i] == p[i] else 0.0)
    )
    group, rank, before = [0] * n, [0] * n, [0.0] * n
    total, g, start, start_before = 0.0, -1, 0, 0.0
    for k, i in enumerate(order):
        total += p[i]
        before_all = total - p[i]
        if k == 0 or parents[i] != parents[order[k - 1]]:
            g, start, start_before = g + 1, k, before_all
        group[i], rank[i], before[i] = g, k - start, before_all - start_before
    return group, rank, before


def best_siblings(parents: ArrayLike, probs: ArrayLike) -> NDArray[np.bool_]:
    """Whether each candidate is its parent's best proposal: `sibling_ranks`' rank 0
    (the highest probability, the earlier candidate on ties, NaN never before a number).
    One pass in plain Python: on a layer's tens of candidates it costs a fraction of
    the sorts `sibling_ranks` needs (numpy's fixed cost per call dominates there)."""
    p = np.asarray(probs, dtype=np.float64).reshape(-1).tolist()
    out = np.zeros(len(p), dtype=bool)
    out[_best_of(np.asarray(parents).reshape(-1).tolist(), p)] = True
    return out


def _best_of(parents: list[int], p: list[float]) -> list[int]:
    """The index of each parent's best candidate (`best_siblings`), in plain Python."""
    best: dict[int, int] = {}
    for i, g in enumerate(parents):
        j = best.get(g)
        if j is None or p[i] > p[j] or (p[j] != p[j] and p[i] == p[i]):
            best[g] = i
    return list(best.values())


def edge_scores(
    parents: ArrayLike, probs: ArrayLike, ranking: Ranking, sampling: SamplingParams
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """(log score, deviation 0/1) of each candidate as the child of its parent (`parents`
    identifies the parent of each candidate); a log score of -inf: never a node."""
    p = np.asarray(probs, dtype=np.float64)
    if ranking == Ranking.BEAM or p.size == 0:
        return log_probs(p), np.zeros(p.size, dtype=np.int64)
    if sampling.greedy:
        dev = np.ones(p.size, dtype=np.int64)
        dev[_best_of(np.asarray(parents).reshape(-1).tolist(), p.tolist())] = 0
        return log_probs(p), dev
    logp = _sampled_scores(np.asarray(parents).reshape(-1).tolist(), p, sampling)
    return logp, np.zeros(p.size, dtype=np.int64)


def edge_score_lists(
    parents: list[int], p: list[float], ranking: Ranking, sampling: SamplingParams
) -> tuple[list[float], list[int] | None]:
    """`edge_scores` of lists, for the tree's growth on its lists (`TokenTree.append`):
    (log scores, deviations; None: none deviates). The same floats: the logs are numpy's."""
    probs = np.array(p, dtype=np.float64)
    if ranking == Ranking.BEAM or not p:
        return _log_list(probs, p), None
    if sampling.greedy:
        dev = [1] * len(p)
        for i in _best_of(parents, p):
            dev[i] = 0
        return _log_list(probs, p), dev
    return _sampled_scores(parents, probs, sampling).tolist(), None


def _log_list(probs: NDArray[np.float64], p: list[float]) -> list[float]:
    """`log_probs(probs)` as a list (`p`: the same probabilities as a list)."""
    if all(x > 0 for x in p):  # (NaN: not > 0)
        return np.log(probs).tolist()
    return log_probs(probs).tolist()


def log_probs(p: NDArray[np.float64]) -> NDArray[np.float64]:
    """`np.log(p)`, log 0 = -inf without a warning (numpy's `errstate`, a context
    manager that costs more than the log of a layer's candidates, only where needed)."""
    if p.size and p.min() > 0:  # (NaN: not > 0)
        return np.log(p)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(p)


def _sampled_scores(
    parents: list[int], probs: NDArray[np.float64], sampling: SamplingParams
) -> NDArray[np.float64]:
    """Log scores under the request's top-k and top-p, renormalized per parent (plain
    Python on the layer's candidates; the sums in numpy's order: same floats)."""
    p = probs.tolist()
    group, rank, before = _sibling_ranks(parents, p)
    n, groups = len(p), (max(group) + 1 if group else 0)

    def per_parent(x: list[float]) -> list[float]:
        sums = [0.0] * groups
        for g, v in zip(group, x, strict=True):
            sums[g] += v
        return [sums[g] for g in group]

    keep = [True] * n
    # a candidate left out adds x * 0.0 to its parent's mass, as numpy's p * keep did
    # (0 unless x is NaN)
    if sampling.top_k:
        keep = [r < sampling.top_k for r in rank]
        # Renormalize over the top-k where the candidates hold all of it (as the target's
        # rule does: temperature, then top-k, then top-p).
        count = per_parent([1.0] * n)
        kept = per_parent([x if k else x * 0.0 for x, k in zip(p, keep, strict=True)])
        mass = [m if c >= sampling.top_k else 1.0 for m, c in zip(kept, count, strict=True)]
        p = [_divide(x, m) for x, m in zip(p, mass, strict=True)]
        before = [_divide(b, m) for b, m in zip(before, mass, strict=True)]
    if sampling.top_p < 1.0:
        # the mass before it has not reached top_p yet
        keep = [k and b < sampling.top_p for k, b in zip(keep, before, strict=True)]
        # The nucleus's mass: the kept candidates', or top_p where it extends beyond.
        kept = per_parent([x if k else x * 0.0 for x, k in zip(p, keep, strict=True)])
        p = [x / max(m, sampling.top_p) for x, m in zip(p, kept, strict=True)]
    return np.where(np.array(keep, dtype=bool), log_probs(np.array(p, dtype=np.float64)), -np.inf)


def _divide(a: float, b: float) -> float:
    """`a / b` as numpy divides float64 (IEEE: a parent whose kept mass is 0 gives inf or
    NaN, not an exception)."""
    try:
        return a / b
    except ZeroDivisionError:
        if a == 0 or a != a:
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
