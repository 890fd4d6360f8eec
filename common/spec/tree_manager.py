"""The router's per-request tree managers: verification, pruning and growth decisions.

They hold no model and do no I/O, so the same logic drives the in-process lockstep loop
(`runtime.lockstep.Generation`) and the asynchronous network router: feed them the last
stage's logits and the draft's candidates as they arrive, send what they return.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .messages import EMPTY_IDS, Activation, Candidates, Prune
from .sampling import SamplingParams, sample_token
from .tree import TokenTree


@dataclass
class Verdict:
    """What one verification at the last stage decided."""

    tokens: list[int]  # emitted, in order (one for specpipe/pp, 1..D+1 for specinfer)
    prune: Prune  # for every stage
    done: bool
    draft_prune: Prune | None = None  # for the draft, when it differs from `prune`
    restart: Activation | None = None  # after a miss: the new root, to enter stage 1


@dataclass
class OutputState:
    """Verified tokens of one request and the stopping rule."""

    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    hits: int = 0

    def sample(self, logits: Tensor) -> int:
        return sample_token(logits, self.sampling, len(self.tokens))

    def emit(self, token: int) -> bool:
        """Record a verified token; True when generation must stop."""
        self.tokens.append(token)
        if token in self.stop_token_ids:
            self.finish_reason = "stop"
            return True
        return len(self.tokens) >= self.max_new_tokens


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


class SpecPipeManager:
    """SpecPipe (with a draft) and plain PP (without): one tree layer enters stage 1 at a
    time, the root is verified when it leaves the last stage
    (docs/architecture.md, "3. The pipeline step")."""

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        out: OutputState,
        width: int,
        max_depth: int,
    ) -> None:
        self.request_id, self.out = request_id, out
        self.width = width
        self.max_depth = max_depth  # layers in flight ahead of the root: about one per stage
        self.root_pos = len(prompt) - 1
        self.tree = TokenTree(int(prompt[-1]))
        self.verifications = 0
        self.root_children: list[int] = []
        # Draft proposals not (yet) in the tree, for nodes still in it: if a prune removes
        # the whole newest layer, the tree regrows from the deepest survivors' proposals
        # (a one-step bubble) instead of running dry until a miss (S steps).
        self.reserve = Candidates.empty()
        self.regrowths = 0

    def root_layer(self) -> Activation:
        return layer_activation(self.request_id, self.tree, torch.tensor([0]), self.root_pos)

    @property
    def can_grow(self) -> bool:
        return self.width > 0 and self.tree.frontier_depth < self.max_depth

    def is_root(self, act: Activation) -> bool:
        return act.node_ids.tolist() == [self.tree.root_id]

    def verify(self, logits: Tensor) -> Verdict:
        """The root's logits are out: draw the token, then prune to its subtree or restart."""
        tree = self.tree
        token = self.out.sample(logits)
        child = tree.child_with_token(0, token)
        self.verifications += 1
        self.root_children.append(int(tree.children(0).numel()))
        old_root = torch.tensor([tree.root_id])
        horizon = tree.last_id
        restart = None
        if child is not None:
            self.out.hits += 1
            tree.prune_to(child)
            prune = Prune(commit_ids=old_root, keep_ids=tree.ids.clone(), horizon=horizon)
        else:
            tree.reset(token)
            self.reserve = Candidates.empty()
            prune = Prune(commit_ids=old_root, keep_ids=EMPTY_IDS, horizon=horizon)
        self.root_pos += 1
        if child is None:
            restart = self.root_layer()
        return Verdict([token], prune, self.out.emit(token), restart=restart)

    def grow(self, cand: Candidates) -> Activation | None:
        """Append the best `width` candidates whose parents are frontier nodes: the draft's
        fresh proposals for the newest layer, or kept ones if that layer was pruned away."""
        if not self.can_grow:
            return None
        pool = Candidates(
            torch.cat([cand.parent_ids, self.reserve.parent_ids]),
            torch.cat([cand.tokens, self.reserve.tokens]),
            torch.cat([cand.probs.to(torch.float32), self.reserve.probs.to(torch.float32)]),
        )
        fresh_alive = bool(torch.isin(cand.parent_ids, self.tree.ids).any())
        new = extend_frontier(self.tree, pool, self.width)
        if new.numel() and not fresh_alive:
            self.regrowths += 1
        self.reserve = unused_candidates(self.tree, pool)
        if new.numel() == 0:
            return None
        return layer_activation(self.request_id, self.tree, new, self.root_pos)


class SpecInferManager:
    """SpecInfer on the same pipeline: the draft grows a whole tree, the tree crosses all
    stages in one pass, the longest verified path plus one token is emitted."""

    def __init__(
        self, request_id: str, prompt: Sequence[int], out: OutputState, width: int, depth: int
    ) -> None:
        self.request_id, self.out = request_id, out
        self.width, self.depth = width, depth
        self.root_pos = len(prompt) - 1
        self.tree = TokenTree(int(prompt[-1]))
        self.draft_computed: list[Tensor] = []
        self.unseen_by_draft: list[int] = []  # verified tokens the draft must still cache
        self.verifications = 0
        self.root_children: list[int] = []
        self.accepted_lengths: list[int] = []

    def draft_layer(self) -> Activation | None:
        """Next layer the draft must expand, or None when the tree is complete."""
        if self.tree.frontier_depth >= self.depth:
            return None
        layer = layer_activation(self.request_id, self.tree, self.tree.frontier(), self.root_pos)
        self.draft_computed.append(layer.node_ids)
        return layer

    def grow(self, cand: Candidates) -> bool:
        """Add the draft's children of the frontier; False when nothing was added."""
        return extend_frontier(self.tree, cand, self.width).numel() > 0

    def whole_tree(self) -> Activation:
        return layer_activation(
            self.request_id, self.tree, torch.arange(len(self.tree)), self.root_pos
        )

    def verify(self, last: Activation) -> Verdict:
        tree = self.tree
        if last.logits is None or not torch.equal(last.node_ids, tree.ids):
            raise RuntimeError(
                "pipeline desynchronized: the tree did not come out of the last stage"
            )
        self.verifications += 1
        self.root_children.append(int(tree.children(0).numel()))
        path, emitted = [0], []
        while True:
            token = self.out.sample(last.logits[path[-1]])
            emitted.append(token)
            done = self.out.emit(token)
            child = tree.child_with_token(path[-1], token)
            if child is None or done:
                break
            self.out.hits += 1
            path.append(child)
        self.accepted_lengths.append(len(emitted))
        path_t = torch.tensor(path)
        path_ids = tree.ids[path_t]
        horizon = tree.last_id
        seen = torch.isin(path_ids, torch.cat(self.draft_computed))
        verdict = Verdict(
            emitted,
            Prune(commit_ids=path_ids, keep_ids=EMPTY_IDS, horizon=horizon),
            done,
            draft_prune=Prune(commit_ids=path_ids[seen], keep_ids=EMPTY_IDS, horizon=horizon),
        )
        self.unseen_by_draft = tree.tokens[path_t][~seen].tolist()
        # The next tree is rooted at the last emitted token; ids keep increasing.
        self.root_pos += len(path)
        self.tree = TokenTree(emitted[-1], first_id=horizon + 1)
        self.draft_computed = []
        return verdict
