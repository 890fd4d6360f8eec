"""A step's candidates are built for all its requests at once (issue 34, point 3): one LM
head call, softmax and top-k per (top_k, temperature) and one host copy. Each request
gets what a top-k of its own rows alone gives."""

from __future__ import annotations

import torch
from specpipe.common.runtime import draft as draft_module
from specpipe.common.spec.messages import Activation

VOCAB, HIDDEN = 50, 16


def _outputs(rid: str, nodes: list[int], seed: int) -> Activation:
    """A tree layer's output rows: node ids and random final hidden states (fp64)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(nodes, dtype=torch.int64)
    hidden = torch.randn(len(nodes), HIDDEN, generator=g, dtype=torch.float64)
    parents = torch.full_like(ids, -1)
    return Activation(rid, ids + 10, False, ids, parents, tokens=ids, hidden=hidden)


def _asks() -> list[tuple[Activation, int, float]]:
    """Requests of two (top_k, temperature) groups, interleaved; one asks for more
    children than the vocabulary has."""
    return [
        (_outputs("a", [0, 1, 2], 1), 3, 0.0),
        (_outputs("b", [7], 2), 2, 0.7),
        (_outputs("c", [4, 5], 3), 3, 0.0),
        (_outputs("d", [1, 2], 4), VOCAB + 5, 0.7),
        (_outputs("e", [3, 6, 8, 9], 5), 2, 0.7),
    ]


def _head() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64).requires_grad_(False)


def _alone(out: Activation, top_k: int, temperature: float, head) -> tuple[list, list, list]:
    """One request's children, from its rows alone (the reference)."""
    logits = head(out.hidden).float()
    probs = torch.softmax(logits / temperature if temperature else logits, dim=-1)
    top = torch.topk(probs, min(top_k, VOCAB), dim=-1)
    k = top.indices.shape[-1]
    parents = out.node_ids.repeat_interleave(k).tolist()
    return parents, top.indices.reshape(-1).tolist(), top.values.reshape(-1).tolist()


def test_candidates_of_a_batch_equal_each_requests_own() -> None:
    head, asks = _head(), _asks()
    batched = draft_module._top_children_many(asks, head)
    for (out, top_k, temperature), got in zip(asks, batched, strict=True):
        parents, tokens, probs = _alone(out, top_k, temperature, head)
        assert got.parent_ids.tolist() == parents
        assert got.tokens.tolist() == tokens
        assert got.tokens.dtype == torch.int64 and got.probs.dtype == torch.float32
        torch.testing.assert_close(got.probs, torch.tensor(probs), rtol=1e-6, atol=1e-7)
    assert len(batched[3]) == 2 * VOCAB  # k capped at the vocabulary


def test_a_requests_candidates_are_its_own_to_change() -> None:
    """Requests' candidates share the step's arrays: they must not alias the model's
    tensors in a way a later step overwrites, nor be inference tensors the router's
    tree could not edit in place."""
    head, asks = _head(), _asks()
    first = draft_module._top_children_many(asks, head)
    want = [c.tokens.tolist() for c in first]
    draft_module._top_children_many(asks[::-1], head)  # another step
    assert [c.tokens.tolist() for c in first] == want
    assert not any(c.tokens.is_inference() or c.probs.is_inference() for c in first)
    first[0].probs.mul_(0.5)  # an in-place edit outside inference mode works
