"""Between the token tree and the pipeline: tree nodes as stage-1 input, the prompt as
prefill chunks, and growing the tree's frontier from the draft's candidates."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .messages import EMPTY_IDS, Activation, Candidates
from .tree import TokenTree


def layer_activation(request_id: str, tree: TokenTree, idx: Tensor, root_pos: int) -> Activation:
    """The tree nodes `idx` as stage-1 input (parent -1 = attach to the committed prefix)."""
    parents = tree.parent[idx]
    parent_ids = torch.where(parents >= 0, tree.ids[parents.clamp(min=0)], -1)
    return Activation(
        request_id=request_id,
        positions=root_pos + tree.depth[idx],
        node_ids=tree.ids[idx],
        parent_ids=parent_ids,
        tokens=tree.tokens[idx],
    )


def prefill_chunks(request_id: str, prompt: Sequence[int], chunk: int) -> list[Activation]:
    """The verified prompt tokens except the last (the first root) as committed chunks."""
    body = torch.tensor(list(prompt[:-1]), dtype=torch.int64)
    return [
        Activation(
            request_id=request_id,
            positions=torch.arange(s, s + body[s : s + chunk].numel()),
            committed=True,
            tokens=body[s : s + chunk],
        )
        for s in range(0, body.numel(), chunk)
    ]


def extend_frontier(tree: TokenTree, cand: Candidates, width: int) -> Tensor:
    """Append the best `width` candidates whose parents are (still) frontier nodes."""
    frontier = tree.frontier()
    match = cand.parent_ids[:, None] == tree.ids[frontier][None, :]
    alive = match.any(dim=1)
    if not bool(alive.any()):
        return EMPTY_IDS
    parents = frontier[match[alive].to(torch.int8).argmax(dim=1)]
    return tree.append_layer(parents, cand.tokens[alive], cand.probs[alive], width)


def unused_candidates(tree: TokenTree, cand: Candidates) -> Candidates:
    """Candidates whose parent is still in the tree and that did not become a node."""
    parent_alive = torch.isin(cand.parent_ids, tree.ids)
    has_parent = tree.parent >= 0
    node_parent_ids = tree.ids[tree.parent[has_parent]]
    node_tokens = tree.tokens[has_parent]
    taken = (
        (cand.parent_ids[:, None] == node_parent_ids[None, :])
        & (cand.tokens[:, None] == node_tokens[None, :])
    ).any(dim=1)
    keep = parent_alive & ~taken
    return Candidates(cand.parent_ids[keep], cand.tokens[keep], cand.probs[keep])


def concat_candidates(*parts: Candidates) -> Candidates:
    return Candidates(
        torch.cat([c.parent_ids for c in parts]),
        torch.cat([c.tokens for c in parts]),
        torch.cat([c.probs.to(torch.float32) for c in parts]),
    )
