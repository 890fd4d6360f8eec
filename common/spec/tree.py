"""The dynamic speculative token tree of one request
(docs/architecture.md, "2. Token tree").

Nodes are stored in BFS order: token ids `I`, draft probabilities `P` (and cumulative
path probabilities), the ancestor mask `M` (`M[i, j]` iff j is i or an ancestor of i),
parent index and depth. Node 0 is the root: the newest verified token. Every node also
carries a stable id (unique for the request's lifetime) so stages can refer to nodes
across re-indexing, the source that proposed its token (`messages.SOURCE_*` bits), and
its path's ranking key for width limiting (`ranking.py`): a cumulative log score and a
count of deviations from the source's best proposals.

The arrays are numpy, not torch: the controller grows and prunes every request's tree
once or more per pipeline step on the router's CPU, on arrays of tens of elements, where
a torch operation's fixed cost (several microseconds) is most of the time and numpy's is
a fraction of it. On the router nothing becomes a tensor (`messages.py`); inputs may be
either (`np.asarray` reads a CPU tensor without a copy).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .ranking import log_probs

Indices = NDArray[np.int64]
NO_NODES: Indices = np.empty(0, dtype=np.int64)
NO_NODES.setflags(write=False)


def member(a: NDArray, b: NDArray) -> NDArray[np.bool_]:
    """`np.isin(a, b)` for the small arrays of a tree: set lookups in plain Python, several
    times faster than isin's sort, and than a broadcast comparison, at these sizes."""
    if a.size * b.size > 1 << 16:
        return np.isin(a, b)
    return np.fromiter(map(set(b.tolist()).__contains__, a.tolist()), dtype=bool, count=a.size)


class TokenTree:
    def __init__(self, root_token: int, first_id: int = 0) -> None:
        self._next_id = first_id
        self.reset(root_token)

    def reset(self, root_token: int) -> None:
        """Drop every node; `root_token` becomes the single root (a miss)."""
        self.tokens = np.array([root_token], dtype=np.int64)
        self.parent = np.array([-1], dtype=np.int64)
        self.depth = np.zeros(1, dtype=np.int64)
        self.prob = np.ones(1, dtype=np.float64)
        self.score = np.zeros(1, dtype=np.float64)
        self.dev = np.zeros(1, dtype=np.int64)
        self.source = np.zeros(1, dtype=np.int8)
        self._mask: NDArray[np.bool_] | None = None
        self.ids = self._new_ids(1)
        self.frontier_depth = 0

    def _new_ids(self, n: int) -> Indices:
        ids = np.arange(self._next_id, self._next_id + n, dtype=np.int64)
        self._next_id += n
        return ids

    @property
    def mask(self) -> NDArray[np.bool_]:
        """The ancestor mask `M` (`M[i, j]` iff j is i or an ancestor of i), built from
        `parent` when first read after a change: growth and prunes need only `parent`, and
        most steps never read it (the grammar's and the penalties' growth do)."""
        if self._mask is None:
            mask = np.eye(len(self), dtype=bool)
            for i, p in enumerate(self.parent.tolist()):
                if p >= 0:
                    mask[i] |= mask[p]
            self._mask = mask
        return self._mask

    def __len__(self) -> int:
        return int(self.tokens.size)

    @property
    def cum(self) -> NDArray[np.float64]:
        """Each node's path probability below the root (the product of `prob` along its
        path), computed when read: nothing on the router's step reads it."""
        cum = self.prob.tolist()
        for i, p in enumerate(self.parent.tolist()):
            if p >= 0:
                cum[i] *= cum[p]
        return np.array(cum, dtype=np.float64)

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

    def frontier(self) -> Indices:
        """Indices of the newest layer: the leaves the draft expands next."""
        return np.arange(self.frontier_start, len(self))

    @property
    def frontier_start(self) -> int:
        """The frontier's first index: it is the deepest layer (`frontier_depth` is the
        largest depth), the last nodes in BFS order."""
        return bisect_left(self.depth.tolist(), self.frontier_depth)  # no numpy call: cold

    def children(self, node: int) -> Indices:
        return (self.parent == node).nonzero()[0]

    def child_with_token(self, node: int, token: int) -> int | None:
        hit = ((self.parent == node) & (self.tokens == token)).nonzero()[0]
        return int(hit[0]) if hit.size else None

    def root_child(self, token: int) -> tuple[int | None, int]:
        """(the root's child with `token`, None if none; the root's number of children).
        In BFS order the root's children are nodes 1..k, the nodes of depth 1: one call
        and a list, where `child_with_token` and `children` take several calls each (and
        no numpy call but lists': the router meets this cold, 20 ms after its last step)."""
        k = bisect_right(self.depth.tolist(), 1) - 1
        tokens = self.tokens[1 : k + 1].tolist()
        return (tokens.index(token) + 1 if token in tokens else None), k

    def indices_of(self, ids: ArrayLike) -> Indices:
        """Indices (in tree order) of the nodes whose ids are among `ids`."""
        return member(self.ids, np.asarray(ids)).nonzero()[0]

    def has_ids(self, ids: ArrayLike) -> NDArray[np.bool_]:
        """Which of `ids` are nodes of the tree."""
        return member(np.asarray(ids), self.ids)

    def has_any(self, ids: ArrayLike) -> bool:
        """Whether any of `ids` is a node of the tree."""
        return not set(self.ids.tolist()).isdisjoint(np.asarray(ids).tolist())

    def append_layer(
        self,
        parents: ArrayLike,
        tokens: ArrayLike,
        probs: ArrayLike,
        width: int,
        logp: ArrayLike | None = None,
        deviation: ArrayLike | None = None,
        source: ArrayLike | None = None,
    ) -> Indices:
        """Add the best `width` candidate children by ranking key.

        `parents` are node indices (every candidate's parent must be a frontier node),
        `tokens`/`probs` the proposals. The key of a node is its path's (any deviation,
        -score): `logp` is each candidate's log score as its parent's child (default
        log `probs`: beam ranking by cumulative probability; -inf: never a node) and
        `deviation` 0/1 whether it departs from its parent's best proposal (default 0);
        see `ranking.edge_scores`. Returns the new nodes' indices.
        """
        parents = np.asarray(parents, dtype=np.int64)
        if parents.size == 0 or width <= 0:
            return np.empty(0, dtype=np.int64)
        order = parents.tolist()
        if min(order) < self.frontier_start or max(order) >= len(self):
            raise ValueError("candidates must extend the frontier layer")
        probs = np.asarray(probs, dtype=np.float64)
        logp = log_probs(probs) if logp is None else np.asarray(logp, dtype=np.float64)
        score = self.score[parents] + logp
        dev = self.dev[parents]
        if deviation is not None:
            dev = dev + np.asarray(deviation, dtype=np.int64)
        # best key first: on the source's argmax chain, then higher score; ties keep
        # candidate order (a sort of tens of tuples: cheaper than numpy's calls here)
        ranked = sorted(
            (d > 0, -s, i)
            for i, (s, d) in enumerate(zip(score.tolist(), dev.tolist(), strict=True))
            if math.isfinite(s)
        )
        if not ranked or width <= 0:
            return np.empty(0, dtype=np.int64)
        # BFS order within the layer: group children by parent, keep rank order inside.
        chosen = sorted((r[2] for r in ranked[:width]), key=order.__getitem__)
        best = np.array(chosen, dtype=np.int64)
        par, n0, m = parents[best], len(self), int(best.size)
        if source is None:
            src = np.ones(m, dtype=np.int8)
        else:
            src = np.asarray(source)[best]
            if src.dtype != np.int8:
                src = src.astype(np.int8)
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, dtype=np.int64)[best]])
        self.parent = np.concatenate([self.parent, par])
        # every parent is a frontier node (checked above): of depth `frontier_depth`
        self.depth = np.concatenate([self.depth, np.full(m, self.frontier_depth + 1, np.int64)])
        self.prob = np.concatenate([self.prob, probs[best]])
        self.score = np.concatenate([self.score, score[best]])
        self.dev = np.concatenate([self.dev, dev[best]])
        self.source = np.concatenate([self.source, src])
        self.ids = np.concatenate([self.ids, self._new_ids(m)])
        self._mask = None
        self.frontier_depth += 1
        return np.arange(n0, n0 + m)

    def prune_to(self, child: int) -> Indices:
        """Keep `child` and its descendants; `child` becomes the root. Returns kept old indices."""
        if int(self.parent[child]) != 0:
            raise ValueError("can only prune to a child of the root")
        # `child`'s subtree: in BFS order a node is in it iff its parent is (one pass over
        # tens of nodes in plain Python: cheaper than numpy's calls at this size)
        parent = self.parent.tolist()
        at = {child: 0}  # old index -> new index
        for i in range(child + 1, len(parent)):
            if parent[i] in at:
                at[i] = len(at)
        keep = np.fromiter(at, dtype=np.int64, count=len(at))
        # every kept node's parent is a node (none is the root); `child`'s, the root, is
        # not kept: it maps to -1
        self.parent = np.fromiter((at.get(parent[i], -1) for i in at), np.int64, len(at))
        self.tokens = self.tokens[keep]
        self.depth = self.depth[keep] - 1
        self.prob = self.prob[keep]
        self.prob[0] = 1.0
        self.score = self.score[keep] - self.score[child]
        self.dev = self.dev[keep] - self.dev[child]
        self.source = self.source[keep]
        self.source[0] = 0
        if self._mask is not None:
            self._mask = self._mask[keep][:, keep]
        self.ids = self.ids[keep]
        # If the newest layer lost every node, the deepest survivors become the frontier.
        self.frontier_depth = min(self.frontier_depth - 1, int(self.depth[-1]))  # BFS order
        return keep

    def path_to(self, node: int) -> Indices:
        """Indices from the root down to `node`, in order."""
        path, parent = [node], self.parent.tolist()
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        return np.array(path[::-1], dtype=np.int64)

    def check_invariants(self) -> None:
        """Assert M equals the ancestor relation of `parent` (used by property tests)."""
        n = len(self)
        expect = np.eye(n, dtype=bool)
        for i in range(1, n):
            p = int(self.parent[i])
            assert 0 <= p < i, "parents precede children in BFS order"
            expect[i] |= expect[p]
            assert int(self.depth[i]) == int(self.depth[p]) + 1
        assert np.array_equal(expect, self.mask), "ancestor mask disagrees with parent array"
        paths = [self.path_to(i).tolist() for i in range(n)]
        assert paths == [expect[i].nonzero()[0].tolist() for i in range(n)], "paths disagree"
        assert int(self.parent[0]) == -1 and int(self.depth[0]) == 0
        assert self.frontier_depth == int(self.depth.max()), "the frontier is the deepest layer"
