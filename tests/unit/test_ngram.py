"""The n-gram token source: the index over the verified text and its tree proposals."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.spec.messages import SOURCE_NGRAM
from specpipe.common.spec.ngram import NgramIndex, confidence, ngram_candidates
from specpipe.common.spec.tree import TokenTree


def test_followers_of_the_longest_match_come_first() -> None:
    # "1 2 3" was followed by 4 once; "3" alone by 4 and by 9.
    index = NgramIndex([1, 2, 3, 4, 7, 3, 9], max_n=3)
    ranked = index.propose([5, 1, 2, 3], k=4)
    assert ranked[0] == (4, pytest.approx(confidence(3)))
    assert ranked[1] == (9, pytest.approx(confidence(1) * 0.5))  # a shorter match adds 9
    assert [t for t, _ in index.propose([8, 3], k=4)] == [4, 9]  # only "3" matches: a tie


def test_shares_weigh_followers_of_one_ngram() -> None:
    index = NgramIndex([6, 1, 6, 1, 6, 2], max_n=2)
    (first, p1), (second, p2) = index.propose([0, 6], k=2)
    assert (first, second) == (1, 2)
    assert p1 == pytest.approx(confidence(1) * 2 / 3) and p2 == pytest.approx(confidence(1) / 3)


def test_no_match_no_proposal_and_k_limits() -> None:
    index = NgramIndex([1, 2, 1, 3, 1, 4, 1, 5], max_n=2)
    assert index.propose([9], k=3) == []
    assert len(index.propose([1], k=3)) == 3
    assert NgramIndex([], max_n=2).propose([1, 2], k=3) == []


def test_extending_equals_indexing_at_once() -> None:
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    grown = NgramIndex(seq[:5], max_n=3)
    for t in seq[5:]:
        grown.extend([t])
    whole = NgramIndex(seq, max_n=3)
    for start in range(len(seq) - 3):
        ctx = seq[start : start + 3]
        assert grown.propose(ctx, 5) == whole.propose(ctx, 5)
    assert len(grown) == len(seq)


def test_min_n_ignores_short_matches() -> None:
    index = NgramIndex([1, 2, 3, 4, 3, 5], max_n=3, min_n=2)
    assert index.propose([9, 3], k=3) == []  # "3" matches, but one token is too short
    assert index.propose([2, 3], k=3) == [(4, pytest.approx(confidence(2)))]
    with pytest.raises(ValueError):
        NgramIndex([], max_n=2, min_n=3)


def test_tree_nodes_are_proposed_from_their_own_path() -> None:
    """A node's context is the verified text plus its path below the root."""
    verified = [10, 11, 12, 20, 21, 22, 10]  # the root is the last token, 10
    index = NgramIndex(verified, max_n=3)
    tree = TokenTree(root_token=10)
    kids = tree.append_layer(torch.tensor([0, 0]), torch.tensor([11, 20]),
                             torch.tensor([0.5, 0.5]), width=2)  # fmt: skip
    cand = ngram_candidates(index, verified, tree, kids, k=2)
    by_parent = {
        int(tree.ids[i]): cand.tokens[cand.parent_ids == tree.ids[i]].tolist() for i in kids
    }
    assert by_parent == {1: [12], 2: [21]}  # "10 11" was followed by 12, "20" by 21
    assert cand.sources.tolist() == [SOURCE_NGRAM] * 2
    assert (cand.probs > 0).all()
