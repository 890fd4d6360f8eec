"""The dynamic speculative token tree of one request
(docs/architecture.md, "2. Token tree").

Nodes are stored in BFS order: token ids `I`, draft probabilities `P` (and cumulative
path probabilities), the ancestor mask `M` (`M[i, j]` iff j is i or an ancestor of i),
parent index and depth. Node 0 is the root: the newest verified token. Every node also
carries a stable id (unique for the request's lifetime) so stages can refer to nodes
across re-indexing, the source that proposed its token (`messages.SOURCE_*` bits), and
its path's ranking key for width limiting (`ranking.py`): a cumulative log score and a
count of deviations from the source's best proposals.
"""

from __future__ import annotations

import torch
from torch import Tensor


class TokenTree:
    def __init__(self, root_token: int, first_id: int = 0) -> None:
        self._next_id = first_id
        self.reset(root_token)

    def reset(self, root_token: int) -> None:
        """Drop every node; `root_token` becomes the single root (a miss)."""
        self.tokens = torch.tensor([root_token], dtype=torch.int64)
        self.parent = torch.tensor([-1], dtype=torch.int64)
        self.depth = torch.zeros(1, dtype=torch.int64)
        self.prob = torch.ones(1, dtype=torch.float64)
        self.cum = torch.ones(1, dtype=torch.float64)
        self.score = torch.zeros(1, dtype=torch.float64)
        self.dev = torch.zeros(1, dtype=torch.int64)
        self.source = torch.zeros(1, dtype=torch.int8)
        self.mask = torch.ones(1, 1, dtype=torch.bool)
        self.ids = self._new_ids(1)
        self.frontier_depth = 0

    def _new_ids(self, n: int) -> Tensor:
        ids = torch.arange(self._next_id, self._next_id + n, dtype=torch.int64)
        self._next_id += n
        return ids

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def root_token(self) -> int:
        return int(self.tokens[0])

    @property
    def root_id(self) -> int:
        return int(self.ids[0])

    @property
    def last_id(self) -> int:
        """Largest node id ever created (also of nodes pruned since): the tree version."""
        return self._next_id - 1

    def frontier(self) -> Tensor:
        """Indices of the newest layer: the leaves the draft expands next."""
        return (self.depth == self.frontier_depth).nonzero().squeeze(1)

    def children(self, node: int) -> Tensor:
        return (self.parent == node).nonzero().squeeze(1)

    def child_with_token(self, node: int, token: int) -> int | None:
        hit = ((self.parent == node) & (self.tokens == token)).nonzero()
        return int(hit[0, 0]) if hit.numel() else None

    def append_layer(
        self,
        parents: Tensor,
        tokens: Tensor,
        probs: Tensor,
        width: int,
        logp: Tensor | None = None,
        deviation: Tensor | None = None,
        source: Tensor | None = None,
    ) -> Tensor:
        """Add the best `width` candidate children by ranking key.

        `parents` are node indices (every candidate's parent must be a frontier node),
        `tokens`/`probs` the proposals. The key of a node is its path's (deviations,
        -score): `logp` is each candidate's log score as its parent's child (default
        log `probs`: beam ranking by cumulative probability; -inf: never a node) and
        `deviation` 0/1 whether it departs from its parent's best proposal (default 0);
        see `ranking.edge_scores`. Returns the new nodes' indices.
        """
        if parents.numel() == 0 or width <= 0:
            return torch.empty(0, dtype=torch.int64)
        if not bool((self.depth[parents] == self.frontier_depth).all()):
            raise ValueError("candidates must extend the frontier layer")
        probs = probs.to(torch.float64)
        logp = torch.log(probs) if logp is None else logp.to(torch.float64)
        score = self.score[parents] + logp
        dev = self.dev[parents] + (0 if deviation is None else deviation)
        ok = torch.isfinite(score).nonzero().squeeze(1)
        order = torch.argsort(score[ok], descending=True, stable=True)
        order = order[torch.argsort(dev[ok][order], stable=True)]
        best = ok[order[:width]]
        if best.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        # BFS order within the layer: group children by parent, keep rank order inside.
        best = best[torch.argsort(parents[best], stable=True)]
        par, n0, m = parents[best], len(self), int(best.numel())
        src = torch.ones(m, dtype=torch.int8) if source is None else source[best].to(torch.int8)
        self.tokens = torch.cat([self.tokens, tokens[best].to(torch.int64)])
        self.parent = torch.cat([self.parent, par])
        self.depth = torch.cat([self.depth, self.depth[par] + 1])
        self.prob = torch.cat([self.prob, probs[best]])
        self.cum = torch.cat([self.cum, self.cum[par] * probs[best]])
        self.score = torch.cat([self.score, score[best]])
        self.dev = torch.cat([self.dev, dev[best]])
        self.source = torch.cat([self.source, src])
        self.ids = torch.cat([self.ids, self._new_ids(m)])
        mask = torch.zeros(n0 + m, n0 + m, dtype=torch.bool)
        mask[:n0, :n0] = self.mask
        mask[n0:, :n0] = self.mask[par]
        mask[torch.arange(n0, n0 + m), torch.arange(n0, n0 + m)] = True
        self.mask = mask
        self.frontier_depth += 1
        return torch.arange(n0, n0 + m)

    def prune_to(self, child: int) -> Tensor:
        """Keep `child` and its descendants; `child` becomes the root. Returns kept old indices."""
        if int(self.parent[child]) != 0:
            raise ValueError("can only prune to a child of the root")
        keep = self.mask[:, child].nonzero().squeeze(1)
        remap = torch.full((len(self),), -1, dtype=torch.int64)
        remap[keep] = torch.arange(keep.numel())
        old_parent = self.parent[keep]
        self.parent = torch.where(old_parent >= 0, remap[old_parent.clamp(min=0)], -1)
        self.parent[0] = -1
        self.tokens = self.tokens[keep]
        self.depth = self.depth[keep] - 1
        self.prob = self.prob[keep]
        self.prob[0] = 1.0
        self.cum = self.cum[keep] / self.cum[child]
        self.score = self.score[keep] - self.score[child]
        self.dev = self.dev[keep] - self.dev[child]
        self.source = self.source[keep]
        self.source[0] = 0
        self.mask = self.mask[keep][:, keep]
        self.ids = self.ids[keep]
        # If the newest layer lost every node, the deepest survivors become the frontier.
        self.frontier_depth = min(self.frontier_depth - 1, int(self.depth.max()))
        return keep

    def path_to(self, node: int) -> Tensor:
        """Indices from the root down to `node`, in order."""
        return self.mask[node].nonzero().squeeze(1)

    def check_invariants(self) -> None:
        """Assert M equals the ancestor relation of `parent` (used by property tests)."""
        n = len(self)
        expect = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            p = int(self.parent[i])
            assert 0 <= p < i, "parents precede children in BFS order"
            expect[i] |= expect[p]
            assert int(self.depth[i]) == int(self.depth[p]) + 1
        assert torch.equal(expect, self.mask), "ancestor mask disagrees with parent array"
        assert int(self.parent[0]) == -1 and int(self.depth[0]) == 0
