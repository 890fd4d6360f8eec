"""Token tree invariants under any sequence of layer appends and prunes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from specpipe.common.spec.tree import TokenTree


def candidates(
    tree: TokenTree, k: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    parents = torch.from_numpy(tree.frontier()).repeat_interleave(k)
    tokens = torch.randint(0, 50, (parents.numel(),), generator=g)
    probs = torch.rand(parents.numel(), generator=g, dtype=torch.float64)
    return parents, tokens, probs


ops = st.lists(
    st.tuples(
        st.sampled_from(["append", "prune", "reset"]),
        st.integers(1, 4),
        st.integers(1, 6),
        st.integers(0, 10**6),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_mask_is_the_ancestor_relation_after_any_ops(sequence) -> None:
    tree = TokenTree(root_token=1)
    seen_ids: set[int] = set(tree.ids.tolist())
    for op, k, width, seed in sequence:
        if op == "append":
            frontier = tree.frontier().size
            new = tree.append_layer(*candidates(tree, k, seed), width)
            assert new.size == min(width, k * frontier)
            if new.size:
                assert tree.depth[new].tolist() == [tree.frontier_depth] * new.size
        elif op == "prune":
            kids = tree.children(0)
            if kids.size == 0:
                continue
            child = int(kids[seed % kids.size])
            child_id, child_token = int(tree.ids[child]), int(tree.tokens[child])
            subtree = set(tree.ids[tree.mask[:, child]].tolist())
            tree.prune_to(child)
            assert tree.root_id == child_id and tree.root_token == child_token
            assert set(tree.ids.tolist()) == subtree
        else:
            tree.reset(seed % 50)
        tree.check_invariants()
        new_ids = set(tree.ids.tolist()) - seen_ids
        assert all(i > max(seen_ids) for i in new_ids), "ids are never reused"
        seen_ids |= new_ids
        assert bool((tree.cum[1:] <= 1.0 + 1e-12).all())


def test_width_keeps_best_cumulative_probability() -> None:
    tree = TokenTree(root_token=0)
    tree.append_layer(
        torch.tensor([0, 0]), torch.tensor([10, 11]), torch.tensor([0.6, 0.4]), width=2
    )
    # children of 10 (cum .6*.5=.30, .6*.1=.06) and of 11 (cum .4*.9=.36, .4*.05=.02)
    parents = torch.tensor([1, 1, 2, 2])
    new = tree.append_layer(
        parents, torch.tensor([20, 21, 22, 23]), torch.tensor([0.5, 0.1, 0.9, 0.05]), width=2
    )
    assert tree.tokens[new].tolist() == [20, 22]  # BFS order: grouped by parent
    assert tree.cum[new].tolist() == pytest.approx([0.30, 0.36])


def test_prune_rebases_cumulative_probability_on_new_root() -> None:
    tree = TokenTree(root_token=0)
    tree.append_layer(
        torch.tensor([0, 0]), torch.tensor([10, 11]), torch.tensor([0.5, 0.5]), width=2
    )
    tree.append_layer(torch.tensor([1]), torch.tensor([20]), torch.tensor([0.8]), width=2)
    tree.prune_to(1)
    assert tree.tokens.tolist() == [10, 20]
    assert tree.cum.tolist() == pytest.approx([1.0, 0.8])
    assert tree.parent.tolist() == [-1, 0]


def test_cannot_prune_to_a_grandchild() -> None:
    tree = TokenTree(root_token=0)
    tree.append_layer(torch.tensor([0]), torch.tensor([1]), torch.tensor([1.0]), width=1)
    tree.append_layer(torch.tensor([1]), torch.tensor([2]), torch.tensor([1.0]), width=1)
    with pytest.raises(ValueError):
        tree.prune_to(2)


@settings(max_examples=100, deadline=None)
@given(ops)
def test_root_child_finds_what_the_array_lookups_find(sequence) -> None:
    """`root_child` (the root's children as nodes 1..k of BFS order) answers as
    `child_with_token` and `children` do, for every token of the vocabulary, after any
    appends and prunes."""
    tree = TokenTree(root_token=1)
    for op, k, width, seed in sequence:
        if op == "append":
            tree.append_layer(*candidates(tree, k, seed), width=width)
        elif op == "prune" and len(tree) > 1:
            kids = tree.children(0)
            tree.prune_to(int(kids[seed % kids.size]))
        elif op == "reset":
            tree.reset(seed % 50)
        for token in range(50):
            assert tree.root_child(token) == (
                tree.child_with_token(0, token),
                int(tree.children(0).size),
            )
