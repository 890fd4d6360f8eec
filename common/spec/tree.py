"""The dynamic speculative token tree of one request
(docs/architecture.md, "2. Token tree").

Nodes are stored in BFS order: token ids `I`, draft probabilities `P` (and cumulative
path probabilities), the ancestor mask `M` (`M[i, j]` iff j is i or an ancestor of i),
parent index and depth. Node 0 is the root: the newest verified token. Every node also
carries a stable id (unique for the request's lifetime) so stages can refer to nodes
across re-indexing, the source that proposed its token (`messages.SOURCE_*` bits), and
its path's ranking key for width limiting (`ranking.py`): a cumulative log score and a
count of deviations from the source's best proposals.

The columns are plain Python lists; each is read as a numpy array (`tokens`, `parent`,
`ids`, ...) made when first read after a change. The controller grows and prunes every
request's tree once or more per pipeline step on the router's CPU, on tens of nodes, and
meets that work cold (some 20 ms after its last step, the caches refilled by other
processes): there every distinct numpy call costs 10-25 us, several times a list
comprehension over the same nodes (session 47: growth and prune in lists, the arrays made
once per message that carries them). Readers off the router's step (the grammar's and
the penalties' growth, the n-gram source, tests) read the arrays as before. On the router
nothing becomes a tensor (`messages.py`); inputs may be lists, numpy arrays or CPU
tensors.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .ranking import log_probs

Indices = NDArray[np.int64]
NO_NODES: Indices = np.empty(0, dtype=np.int64)
NO_NODES.setflags(write=False)


def member(a: NDArray, b: NDArray | list[int]) -> NDArray[np.bool_]:
    """`np.isin(a, b)` for the small arrays of a tree: set lookups in plain Python, several
    times faster than isin's sort, and than a broadcast comparison, at these sizes. `b`
    may be a list (a tree's id column as it keeps it)."""
    if a.size * len(b) > 1 << 16:
        return np.isin(a, b)
    values = b.tolist() if isinstance(b, np.ndarray) else b
    return np.fromiter(map(set(values).__contains__, a.tolist()), dtype=bool, count=a.size)


def as_list(x: ArrayLike | Iterable) -> list:
    """`x` (a list, a numpy array, a CPU tensor, a range) as a list of Python numbers."""
    if isinstance(x, list):
        return x
    tolist = getattr(x, "tolist", None)
    return tolist() if tolist is not None else list(x)


# The columns: (list attribute, the array's dtype); `_array` makes each array when read.
_COLUMNS = {
    "tokens": ("_tok", np.int64),
    "parent": ("_par", np.int64),
    "depth": ("_dep", np.int64),
    "prob": ("_prob", np.float64),
    "score": ("_score", np.float64),
    "dev": ("_dev", np.int64),
    "source": ("_src", np.int8),
    "ids": ("_ids", np.int64),
}


def _column(name: str) -> property:
    attr, dtype = _COLUMNS[name]

    def read(self: TokenTree) -> NDArray:
        got = self._arrays.get(name)
        if got is None:
            got = self._arrays[name] = np.array(getattr(self, attr), dtype=dtype)
        return got

    read.__doc__ = f"The nodes' `{name}` as a numpy array ({np.dtype(dtype).name}), made when read."
    return property(read)


class TokenTree:
    tokens = _column("tokens")
    parent = _column("parent")
    depth = _column("depth")
    prob = _column("prob")
    score = _column("score")
    dev = _column("dev")
    source = _column("source")
    ids = _column("ids")

    def __init__(self, root_token: int, first_id: int = 0) -> None:
        self._next_id = first_id
        self.reset(root_token)

    def reset(self, root_token: int) -> None:
        """Drop every node; `root_token` becomes the single root (a miss)."""
        self._tok: list[int] = [int(root_token)]
        self._par: list[int] = [-1]
        self._dep: list[int] = [0]
        self._prob: list[float] = [1.0]
        self._score: list[float] = [0.0]
        self._dev: list[int] = [0]
        self._src: list[int] = [0]
        self._ids: list[int] = [self._next_id]
        self._next_id += 1
        self._changed()
        self.frontier_depth = 0

    def _changed(self) -> None:
        """The columns changed: their arrays and the mask are made again when read. (The
        arrays handed out before are never written: `PruneArrays` keeps `ids` as it is.)"""
        self._arrays: dict[str, NDArray] = {}
        self._mask: NDArray[np.bool_] | None = None

    @property
    def mask(self) -> NDArray[np.bool_]:
        """The ancestor mask `M` (`M[i, j]` iff j is i or an ancestor of i), built from
        `parent` when first read after a change: growth and prunes need only `parent`, and
        most steps never read it (the grammar's and the penalties' growth do)."""
        if self._mask is None:
            mask = np.eye(len(self), dtype=bool)
            for i, p in enumerate(self._par):
                if p >= 0:
                    mask[i] |= mask[p]
            self._mask = mask
        return self._mask

    def __len__(self) -> int:
        return len(self._tok)

    @property
    def cum(self) -> NDArray[np.float64]:
        """Each node's path probability below the root (the product of `prob` along its
        path), computed when read: nothing on the router's step reads it."""
        cum = list(self._prob)
        for i, p in enumerate(self._par):
            if p >= 0:
                cum[i] *= cum[p]
        return np.array(cum, dtype=np.float64)

    @property
    def root_token(self) -> int:
        return self._tok[0]

    @property
    def root_id(self) -> int:
        return self._ids[0]

    @property
    def last_id(self) -> int:
        """Largest node id ever created (also of nodes pruned since): the tree version."""
        return self._next_id - 1

    # The columns as the lists the tree keeps, for growth on lists (never to be written:
    # the tree replaces or extends them itself).
    id_list = property(lambda self: self._ids)
    parent_list = property(lambda self: self._par)
    depth_list = property(lambda self: self._dep)
    token_list = property(lambda self: self._tok)
    source_list = property(lambda self: self._src)

    def ids_at(self, idx: Iterable[int]) -> list[int]:
        """The ids of the nodes at indices `idx`."""
        ids = self._ids
        return [ids[i] for i in as_list(idx)]

    def frontier(self) -> Indices:
        """Indices of the newest layer: the leaves the draft expands next."""
        return np.arange(self.frontier_start, len(self))

    @property
    def frontier_start(self) -> int:
        """The frontier's first index: it is the deepest layer (`frontier_depth` is the
        largest depth), the last nodes in BFS order."""
        return bisect_left(self._dep, self.frontier_depth)

    def children(self, node: int) -> Indices:
        return (self.parent == node).nonzero()[0]

    def child_with_token(self, node: int, token: int) -> int | None:
        hit = ((self.parent == node) & (self.tokens == token)).nonzero()[0]
        return int(hit[0]) if hit.size else None

    def root_child(self, token: int) -> tuple[int | None, int]:
        """(the root's child with `token`, None if none; the root's number of children).
        In BFS order the root's children are nodes 1..k, the nodes of depth 1."""
        k = bisect_right(self._dep, 1) - 1
        tokens = self._tok[1 : k + 1]
        return (tokens.index(token) + 1 if token in tokens else None), k

    def index_list(self, ids: Iterable[int]) -> list[int]:
        """Indices (in tree order) of the nodes whose ids are among `ids`."""
        want = set(as_list(ids))
        return [i for i, x in enumerate(self._ids) if x in want]

    def has_ids(self, ids: ArrayLike) -> NDArray[np.bool_]:
        """Which of `ids` are nodes of the tree."""
        return member(np.asarray(ids), self._ids)

    def has_any(self, ids: ArrayLike) -> bool:
        """Whether any of `ids` is a node of the tree."""
        return not set(self._ids).isdisjoint(as_list(ids))

    def append_layer(self, *args, **kwargs) -> Indices:
        """`append`, the new nodes' indices as an array."""
        n0, m = self.append(*args, **kwargs)
        return np.arange(n0, n0 + m)

    def append(
        self,
        parents: ArrayLike,
        tokens: ArrayLike,
        probs: ArrayLike,
        width: int,
        logp: ArrayLike | None = None,
        deviation: ArrayLike | None = None,
        source: ArrayLike | None = None,
    ) -> tuple[int, int]:
        """Add the best `width` candidate children by ranking key; returns (the first
        new node's index, how many).

        `parents` are node indices (every candidate's parent must be a frontier node),
        `tokens`/`probs` the proposals. The key of a node is its path's (any deviation,
        -score): `logp` is each candidate's log score as its parent's child (default
        log `probs`: beam ranking by cumulative probability; -inf: never a node) and
        `deviation` 0/1 whether it departs from its parent's best proposal (default 0);
        see `ranking.edge_scores`. Lists, arrays or tensors; the growth runs on lists.
        """
        n0 = len(self._tok)
        parents = as_list(parents)
        if not parents or width <= 0:
            return n0, 0
        if min(parents) < self.frontier_start or max(parents) >= n0:
            raise ValueError("candidates must extend the frontier layer")
        if logp is None:
            logp = log_probs(np.asarray(probs, dtype=np.float64))
        # (float64 sums, as numpy's were: Python floats are doubles)
        ps, pd = self._score, self._dev
        score = [ps[p] + x for p, x in zip(parents, as_list(logp), strict=True)]
        if deviation is None:
            dev = [pd[p] for p in parents]
        else:
            dev = [pd[p] + int(d) for p, d in zip(parents, as_list(deviation), strict=True)]
        # best key first: on the source's argmax chain, then higher score; ties keep
        # candidate order
        ranked = sorted(
            (d > 0, -s, i)
            for i, (s, d) in enumerate(zip(score, dev, strict=True))
            if math.isfinite(s)
        )
        if not ranked:
            return n0, 0
        # BFS order within the layer: group children by parent, keep rank order inside.
        best = sorted((r[2] for r in ranked[:width]), key=parents.__getitem__)
        tokens, probs = as_list(tokens), as_list(probs)
        src = [1] * len(best) if source is None else [int(x) for x in _picked(source, best)]
        self._tok += [int(tokens[i]) for i in best]
        self._par += [parents[i] for i in best]
        # every parent is a frontier node (checked above): of depth `frontier_depth`
        self._dep += [self.frontier_depth + 1] * len(best)
        self._prob += [float(probs[i]) for i in best]
        self._score += [score[i] for i in best]
        self._dev += [dev[i] for i in best]
        self._src += src
        self._ids += range(self._next_id, self._next_id + len(best))
        self._next_id += len(best)
        self._changed()
        self.frontier_depth += 1
        return n0, len(best)

    def prune_to(self, child: int) -> Indices:
        """Keep `child` and its descendants; `child` becomes the root. Returns kept old indices."""
        return np.array(self.prune_list(child), dtype=np.int64)

    def prune_list(self, child: int) -> list[int]:
        """`prune_to`, the kept old indices as a list."""
        parent = self._par
        if parent[child] != 0:
            raise ValueError("can only prune to a child of the root")
        # `child`'s subtree: in BFS order a node is in it iff its parent is
        at = {child: 0}  # old index -> new index
        for i in range(child + 1, len(parent)):
            if parent[i] in at:
                at[i] = len(at)
        keep = list(at)
        # every kept node's parent is a node (none is the root); `child`'s, the root, is
        # not kept: it maps to -1
        self._par = [at.get(parent[i], -1) for i in keep]
        tok, dep, prob, src, ids = self._tok, self._dep, self._prob, self._src, self._ids
        score, dev = self._score, self._dev
        s0, d0 = score[child], dev[child]
        self._tok = [tok[i] for i in keep]
        self._dep = [dep[i] - 1 for i in keep]
        self._prob = [prob[i] for i in keep]
        self._prob[0] = 1.0
        self._score = [score[i] - s0 for i in keep]
        self._dev = [dev[i] - d0 for i in keep]
        self._src = [src[i] for i in keep]
        self._src[0] = 0
        self._ids = [ids[i] for i in keep]
        mask = self._mask
        self._changed()
        if mask is not None:
            at_ = np.array(keep, dtype=np.int64)
            self._mask = mask[at_][:, at_]
        # If the newest layer lost every node, the deepest survivors become the frontier.
        self.frontier_depth = min(self.frontier_depth - 1, self._dep[-1])  # BFS order
        return keep

    def path_to(self, node: int) -> Indices:
        """Indices from the root down to `node`, in order."""
        path, parent = [node], self._par
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        return np.array(path[::-1], dtype=np.int64)

    def check_invariants(self) -> None:
        """Assert M equals the ancestor relation of `parent` (used by property tests)."""
        n = len(self)
        assert all(len(getattr(self, a)) == n for a, _ in _COLUMNS.values()), "column lengths"
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


def _picked(values: ArrayLike, at: list[int]) -> list:
    """`values[at]` as a list (values: a list, an array or a tensor)."""
    values = as_list(values)
    return [values[i] for i in at]
