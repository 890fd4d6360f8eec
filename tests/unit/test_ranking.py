"""Ranking tree candidates by the target's decoding rule (`ranking.py`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from specpipe.common.spec.ranking import Ranking, edge_scores, sibling_ranks
from specpipe.common.spec.sampling import SamplingParams
from specpipe.common.spec.tree import TokenTree

GREEDY = SamplingParams()


def t(*x):
    return torch.tensor(x)


def test_sibling_ranks_and_mass_before() -> None:
    parents = t(4, 2, 4, 2, 4)
    probs = t(0.2, 0.5, 0.7, 0.5, 0.1).double()
    group, rank, before = sibling_ranks(parents, probs)
    assert group.tolist() == [1, 0, 1, 0, 1]
    assert rank.tolist() == [1, 0, 0, 1, 2]  # a tie: the earlier candidate first
    assert before.tolist() == pytest.approx([0.7, 0.0, 0.0, 0.5, 0.9])


def test_greedy_counts_deviations_from_each_parents_best() -> None:
    logp, dev = edge_scores(t(0, 0, 1, 1), t(0.6, 0.4, 0.3, 0.7), Ranking.TARGET, GREEDY)
    assert dev.tolist() == [0, 1, 1, 0]
    assert logp.tolist() == pytest.approx([math.log(x) for x in (0.6, 0.4, 0.3, 0.7)])
    _, dev = edge_scores(t(0, 0), t(0.6, 0.4), Ranking.BEAM, GREEDY)
    assert dev.tolist() == [0, 0]


def test_sampling_applies_the_requests_top_k_and_top_p_per_parent() -> None:
    probs = t(0.5, 0.3, 0.15, 0.05, 0.6, 0.4)
    parents = t(0, 0, 0, 0, 1, 1)
    top_k = SamplingParams(temperature=1.0, top_k=2)
    logp, dev = edge_scores(parents, probs, Ranking.TARGET, top_k)
    q = np.exp(logp)
    # Parent 0 keeps its top 2, renormalized; parent 1 has just 2 candidates, both kept.
    assert q.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0, 0.6, 0.4])
    assert dev.tolist() == [0] * 6
    top_p = SamplingParams(temperature=1.0, top_p=0.7)
    q = np.exp(edge_scores(parents, probs, Ranking.TARGET, top_p)[0])
    # Parent 0: 0.5 and 0.3 reach 0.7 (0.15 and 0.05 come after it is reached).
    assert q.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0, 0.6, 0.4])


def test_the_argmax_chain_survives_a_narrow_width() -> None:
    """Width 2: off the chain the draft is sure of two children each, and by cumulative
    probability those crowd out the chain; ranked by deviations the chain stays."""

    def grow(ranking: Ranking) -> tuple[TokenTree, set[int]]:
        tree = TokenTree(root_token=0)
        on = {0}  # node indices on the chain of best proposals
        for _ in range(5):
            frontier = tree.frontier().tolist()
            parents, tokens, probs = [], [], []
            for node in frontier:
                weights = [0.4, 0.35, 0.25] if node in on else [0.5, 0.49, 0.01]
                for tok, w in enumerate(weights):
                    parents.append(node)
                    tokens.append(tok)
                    probs.append(w)
            par, pr = torch.tensor(parents), torch.tensor(probs)
            logp, dev = edge_scores(par, pr, ranking, GREEDY)
            new = tree.append_layer(par, torch.tensor(tokens), pr, 2, logp, dev)
            on = {int(i) for i in new if int(tree.parent[i]) in on and int(tree.tokens[i]) == 0}
        return tree, on

    tree, on = grow(Ranking.TARGET)
    assert len(on) == 1 and tree.dev[next(iter(on))] == 0
    tree, on = grow(Ranking.BEAM)
    assert not on  # the beam dropped the chain


def test_past_the_chain_a_likely_second_deviation_beats_an_unlikely_first() -> None:
    """Greedy: the argmax chain first, then cumulative probability, whatever the number of
    deviations (counting them first kept junk single deviations and lost the paths where
    the target deviates twice within the levels the tree runs ahead)."""
    tree = TokenTree(root_token=0)
    par, pr = t(0, 0, 0), t(0.7, 0.29, 0.01)  # tokens 1 (chain), 2, 3
    tree.append_layer(par, t(1, 2, 3), pr, 3, *edge_scores(par, pr, Ranking.TARGET, GREEDY))
    # children of 1 (chain: 11, deviation: 12), of 2 (21, 22) and of 3 (31)
    par, pr = t(1, 1, 2, 2, 3), t(0.6, 0.001, 0.5, 0.49, 0.99)
    logp, dev = edge_scores(par, pr, Ranking.TARGET, GREEDY)
    new = tree.append_layer(par, t(11, 12, 21, 22, 31), pr, 3, logp, dev)
    assert sorted(tree.tokens[new].tolist()) == [11, 21, 22]  # 22 (0.142) beats 31 (0.0099)
    assert tree.dev[new].tolist() == [0, 1, 2]


def test_candidates_ruled_out_get_no_node() -> None:
    tree = TokenTree(root_token=0)
    logp = t(0.0, -math.inf).double()
    new = tree.append_layer(t(0, 0), t(5, 6), t(0.9, 0.1), 4, logp, t(0, 0))
    assert tree.tokens[new].tolist() == [5]
    tree.check_invariants()


def numpy_sampled_scores(parents: np.ndarray, p: np.ndarray, s: SamplingParams) -> np.ndarray:
    """The rule as numpy arrays (the implementation before the plain-Python one): the
    reference the controller's decisions must keep bit for bit."""
    order = np.lexsort((-p, parents))
    g, q = parents[order], p[order]
    n = p.size
    first = np.ones(n, dtype=bool)
    first[1:] = g[1:] != g[:-1]
    idx = np.arange(n)
    start = np.maximum.accumulate(np.where(first, idx, 0))
    before_all = np.cumsum(q) - q
    rank, before, group = np.empty_like(idx), np.empty_like(q), np.empty_like(idx)
    rank[order], before[order] = idx - start, before_all - before_all[start]
    group[order] = np.cumsum(first) - 1

    def per_parent(x: np.ndarray) -> np.ndarray:
        return np.bincount(group, weights=x)[group]

    keep = np.ones(n, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        if s.top_k:
            keep &= rank < s.top_k
            mass = np.where(per_parent(np.ones_like(p)) >= s.top_k, per_parent(p * keep), 1.0)
            p, before = p / mass, before / mass
        if s.top_p < 1.0:
            keep &= before < s.top_p
            p = p / np.maximum(per_parent(p * keep), s.top_p)
        return np.where(keep, np.log(p), -np.inf)


@pytest.mark.parametrize("seed", range(40))
def test_sampled_scores_equal_the_array_rule_bit_for_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    parents = rng.integers(0, 6, n)
    probs = rng.choice([0.5, 0.25, 0.1, 0.0], n) if seed % 4 == 0 else rng.random(n)
    if seed % 5 == 0:
        probs[rng.integers(0, n)] = np.nan  # sorts last among its siblings, as numpy's
    s = SamplingParams(temperature=1.0, top_k=int(rng.integers(0, 5)),
                       top_p=float(rng.choice([1.0, 0.9, 0.5])))  # fmt: skip
    logp, _ = edge_scores(parents, probs, Ranking.TARGET, s)
    want = numpy_sampled_scores(parents, probs.astype(np.float64), s)
    # the same floats (a NaN's sign aside: no NaN score is ever a node)
    assert np.array_equal(logp, want, equal_nan=True)
    group, rank, _ = sibling_ranks(parents, probs)
    assert rank.min() == 0 and group.max() == len(set(parents.tolist())) - 1


@pytest.mark.parametrize("seed", range(20))
def test_greedy_deviation_is_not_being_the_parents_best(seed: int) -> None:
    """Greedy TARGET deviations are exactly the candidates that are not their parent's
    best (`best_siblings`: ties to the earlier, NaN never before a number)."""
    from specpipe.common.spec.ranking import best_siblings

    g = np.random.default_rng(seed)
    n = int(g.integers(1, 30))
    parents = g.integers(0, 5, n)
    probs = g.choice([0.1, 0.25, 0.5, float("nan"), 0.0], n)  # ties, NaN and zeros
    logp, dev = edge_scores(parents, probs, Ranking.TARGET, GREEDY)
    assert dev.dtype == np.int64
    assert dev.tolist() == (~best_siblings(parents, probs)).astype(np.int64).tolist()
    for p, lp in zip(probs.tolist(), logp.tolist(), strict=True):
        assert (math.isnan(p) and math.isnan(lp)) or lp == (math.log(p) if p > 0 else -math.inf)
