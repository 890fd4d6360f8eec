"""Between the token tree and the pipeline: tree nodes as stage-1 input, the prompt as
prefill chunks, and growing the tree's frontier from the draft's candidates."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .messages import EMPTY_IDS, SOURCE_DRAFT, SOURCE_NGRAM, Activation, Candidates
from .ranking import Ranking, edge_scores
from .sampling import SamplingParams
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


def extend_frontier(
    tree: TokenTree,
    cand: Candidates,
    width: int,
    ranking: Ranking = Ranking.BEAM,
    sampling: SamplingParams | None = None,
) -> Tensor:
    """Append the best `width` candidates whose parents are (still) frontier nodes,
    ranked by `ranking` under the request's `sampling` rule (`ranking.py`)."""
    frontier = tree.frontier()
    match = cand.parent_ids[:, None] == tree.ids[frontier][None, :]
    alive = match.any(dim=1)
    if not bool(alive.any()):
        return EMPTY_IDS
    cand = merge_candidates(select(cand, alive))
    match = cand.parent_ids[:, None] == tree.ids[frontier][None, :]
    parents = frontier[match.to(torch.int8).argmax(dim=1)]
    logp, dev = edge_scores(parents, cand.probs, ranking, sampling or SamplingParams())
    return tree.append_layer(parents, cand.tokens, cand.probs, width, logp, dev, cand.sources)


def select(cand: Candidates, rows: Tensor) -> Candidates:
    return Candidates(
        cand.parent_ids[rows], cand.tokens[rows], cand.probs[rows], cand.sources[rows]
    )


def merge_candidates(cand: Candidates) -> Candidates:
    """One candidate per (parent, token): a token proposed more than once (by the draft
    and the n-gram source, or again from the reserve) keeps its highest probability and
    the sources of all its proposals."""
    pairs = torch.stack([cand.parent_ids, cand.tokens])
    uniq, inv = torch.unique(pairs, dim=1, return_inverse=True)
    if uniq.shape[1] == len(cand):
        return cand
    n = uniq.shape[1]
    probs = torch.zeros(n, dtype=cand.probs.dtype).scatter_reduce(
        0, inv, cand.probs, "amax", include_self=False
    )
    src = cand.sources.to(torch.int64)
    source = torch.zeros(n, dtype=torch.int64)
    for bit in (SOURCE_DRAFT, SOURCE_NGRAM):
        source |= torch.zeros(n, dtype=torch.int64).scatter_reduce(0, inv, src & bit, "amax")
    return Candidates(uniq[0], uniq[1], probs, source.to(torch.int8))


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
    return select(cand, parent_alive & ~taken)


def beside(extra: Candidates, main: Candidates) -> Candidates:
    """`extra` proposals scaled to share the mass `main` leaves for each parent: a parent's
    best `main` proposal stays its best, and an extra token ranks by its own probability
    among the alternatives (hybrid: n-grams beside the draft model)."""
    if len(main) == 0 or len(extra) == 0:
        return extra
    match = extra.parent_ids[:, None] == main.parent_ids[None, :]
    top = torch.where(match, main.probs[None, :].to(torch.float32), 0.0).amax(dim=1)
    return Candidates(extra.parent_ids, extra.tokens, extra.probs * (1.0 - top), extra.sources)


def concat_candidates(*parts: Candidates) -> Candidates:
    return Candidates(
        torch.cat([c.parent_ids for c in parts]),
        torch.cat([c.tokens for c in parts]),
        torch.cat([c.probs.to(torch.float32) for c in parts]),
        torch.cat([c.sources for c in parts]),
    )
