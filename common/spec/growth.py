"""Between the token tree and the pipeline: tree nodes as stage-1 input, the prompt as
prefill chunks, and growing the tree's frontier from the draft's candidates."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray

from .grammar import GrammarState
from .messages import SOURCE_DRAFT, SOURCE_GRAMMAR, Candidates, RowArrays
from .options import MAX_PREFILL_CHUNKS
from .ranking import Ranking, edge_score_lists
from .sampling import SamplingParams
from .tree import NO_NODES, Indices, TokenTree, as_list

# A candidate pool as numpy arrays: parent ids, tokens, probabilities, sources. The
# controller grows from pools (`pool_of` reads candidates of either kind).
Pool = tuple[NDArray[np.int64], NDArray[np.int64], NDArray, NDArray[np.int8]]
EMPTY_POOL: Pool = (
    np.empty(0, dtype=np.int64),
    np.empty(0, dtype=np.int64),
    np.empty(0, dtype=np.float32),
    np.empty(0, dtype=np.int8),
)

# The same as lists, probabilities as the float32 values `concat_pools` gives: how
# SpecPipe's controller grows its tree and keeps its reserve (tens of candidates, met cold
# once per step: list operations cost a fraction of numpy's calls there).
ListPool = tuple[list[int], list[int], list[float], list[int]]
EMPTY_LIST_POOL: ListPool = ([], [], [], [])


def pool_lists(pool: Pool, float32: bool = True) -> ListPool:
    """`pool` as lists; `float32`: its probabilities as float32 values first, as
    `concat_pools` makes them."""
    pid, tokens, probs, sources = pool
    if float32 and probs.dtype != np.float32:
        probs = probs.astype(np.float32)
    return pid.tolist(), tokens.tolist(), probs.tolist(), sources.tolist()


def join_lists(a: ListPool, b: ListPool) -> ListPool:
    """`a`'s candidates, then `b`'s (`concat_pools` of lists)."""
    if not b[0]:
        return a
    if not a[0]:
        return b
    return a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]


def array_pool(pool: ListPool, prob_dtype: type = np.float32) -> Pool:
    """A pool of lists as arrays of the pool's dtypes (probabilities: `prob_dtype`)."""
    pid, tokens, probs, sources = pool
    return (
        np.array(pid, dtype=np.int64),
        np.array(tokens, dtype=np.int64),
        np.array(probs, dtype=prob_dtype),
        np.array(sources, dtype=np.int8),
    )


def layer_rows(request_id: str, tree: TokenTree, idx: ArrayLike, root_pos: int) -> RowArrays:
    """The tree nodes `idx` as stage-1 input (parent -1 = attach to the committed prefix):
    the tree's lists picked in plain Python, one array per field."""
    idx = as_list(idx)
    ids, par, dep, tok = tree.id_list, tree.parent_list, tree.depth_list, tree.token_list
    return RowArrays(
        request_id,
        np.array([root_pos + dep[i] for i in idx], dtype=np.int64),
        node_ids=np.array([ids[i] for i in idx], dtype=np.int64),
        # the root's parent is -1: the committed prefix
        parent_ids=np.array([ids[par[i]] if par[i] >= 0 else -1 for i in idx], dtype=np.int64),
        tokens=np.array([tok[i] for i in idx], dtype=np.int64),
    )


def chunk_spans(
    start: int, stop: int, chunk: int, cells: int | None = None
) -> list[tuple[int, int]]:
    """Positions [start, stop) as prefill chunks [s, e): at most `chunk` rows each and,
    with `cells`, at most `cells` rows x keys (a chunk's rows each see the keys up to
    their own position, the last all e of them), so a chunk deep in a long prompt is no
    costlier for the step it shares with other requests' decodes than one at its start
    (docs/architecture.md, "3. The pipeline step"). Every chunk has at least a row, and
    so many that there are at most `MAX_PREFILL_CHUNKS` (a stage holds no more waiting)."""
    spans, s = [], start
    least = max(1, -(-(stop - start) // MAX_PREFILL_CHUNKS))
    while s < stop:
        rows = chunk
        if cells is not None:  # the largest r with r * (s + r) <= cells
            rows = min(rows, max(least, int((math.isqrt(s * s + 4 * cells) - s) // 2)))
        e = min(stop, s + rows)
        spans.append((s, e))
        s = e
    return spans


def prefill_chunks(
    request_id: str, prompt: Sequence[int], chunk: int, start: int = 0, cells: int | None = None
) -> list[RowArrays]:
    """The verified prompt tokens except the last (the first root) as committed chunks,
    from position `start` (the tokens before it are cached on the path already), sized
    by `chunk_spans`."""
    body = np.array(prompt[:-1], dtype=np.int64)
    return [
        RowArrays(request_id, np.arange(s, e, dtype=np.int64), committed=True, tokens=body[s:e])
        for s, e in chunk_spans(start, body.size, chunk, cells)
    ]


def extend_frontier(
    tree: TokenTree,
    pool: Pool,
    width: int,
    ranking: Ranking = Ranking.BEAM,
    sampling: SamplingParams | None = None,
) -> Indices:
    """Append the best `width` candidates of `pool` whose parents are (still) frontier
    nodes, ranked by `ranking` under the request's `sampling` rule (`ranking.py`)."""
    n0, m = grow_frontier(tree, pool_lists(pool, float32=False), width, ranking, sampling)
    return np.arange(n0, n0 + m) if m else NO_NODES


def grow_frontier(
    tree: TokenTree,
    pool: ListPool,
    width: int,
    ranking: Ranking = Ranking.BEAM,
    sampling: SamplingParams | None = None,
) -> tuple[int, int]:
    """`extend_frontier` on a pool of lists: (the first new node's index, how many). The
    tree's growth in plain Python on its lists (tens of candidates); numpy only for the
    logs (the same floats) and to merge duplicates (rare)."""
    pid, tokens, probs, sources = pool
    # each candidate's parent's index by its id
    first = tree.frontier_start
    at = dict(zip(tree.id_list[first:], range(first, len(tree)), strict=True))
    parent_of = [at.get(p, -1) for p in pid]
    if -1 in parent_of:
        alive = [i for i, q in enumerate(parent_of) if q >= 0]
        if not alive:
            return len(tree), 0
        pid, tokens, probs, sources = ([c[i] for i in alive] for c in pool)
        parent_of = [parent_of[i] for i in alive]
    if len(pid) > 1 and len(set(zip(pid, tokens, strict=True))) < len(pid):
        # duplicates: merged (then in (parent, token) order); float64 holds every value
        merged = merge_candidates(array_pool((pid, tokens, probs, sources), np.float64))
        pid, tokens, probs, sources = (a.tolist() for a in merged)
        parent_of = [at[p] for p in pid]
    logp, dev = edge_score_lists(parent_of, probs, ranking, sampling or SamplingParams())
    return tree.append(parent_of, tokens, probs, width, logp, dev, sources)


def allowed_by_grammar(tree: TokenTree, cand: Candidates, grammar: GrammarState) -> Candidates:
    """The candidates the request's grammar allows after their paths (`grammar`: its
    state after the output so far, the root's token included; a parent's path is the
    tree's tokens below the root down to it). Candidates of parents no longer in the
    tree go too (no node can grow from them)."""
    if len(cand) == 0:
        return cand
    pid, tokens, probs, sources = pool_of(cand)
    at = np.searchsorted(tree.ids, pid)  # ids are sorted: nodes are appended in id order
    present = (at < len(tree)) & (tree.ids[np.minimum(at, len(tree) - 1)] == pid)
    keep = np.zeros(pid.size, dtype=bool)
    paths: dict[int, list[int]] = {}
    for i in np.flatnonzero(present).tolist():
        node = int(at[i])
        if node not in paths:
            paths[node] = tree.tokens[tree.path_to(node)[1:]].tolist()
        keep[i] = grammar.allows(paths[node], int(tokens[i]))
    if keep.all():
        return cand
    return candidates_of((pid[keep], tokens[keep], probs[keep], sources[keep]))


def with_forced_tokens(tree: TokenTree, cand: Candidates, grammar: GrammarState) -> Candidates:
    """`cand` and, for every frontier node after whose path the grammar allows exactly
    one token, that token as a child of probability 1 (`SOURCE_GRAMMAR`): the target
    can draw nothing else there, so it is a sure hit whatever the draft proposed (a
    draft proposal of the same token merges with it, `merge_candidates`; others were
    forbidden already). Costs one grammar mask per frontier node."""
    frontier = tree.frontier()
    forced = []
    for node in frontier.tolist():
        token = grammar.forced_after(tree.tokens[tree.path_to(node)[1:]].tolist())
        if token is not None:
            forced.append((int(tree.ids[node]), token))
    if not forced:
        return cand
    ids, tokens = (np.array(x, dtype=np.int64) for x in zip(*forced, strict=True))
    extra = (ids, tokens, np.ones(ids.size, dtype=np.float32),
             np.full(ids.size, SOURCE_GRAMMAR, dtype=np.int8))  # fmt: skip
    return concat_candidates(cand, candidates_of(extra)) if len(cand) else candidates_of(extra)


def pool_of(cand: Candidates) -> Pool:
    """The candidates' arrays, numpy or CPU tensors alike (numpy views of tensors: no
    copy); probabilities as floats (float32 unless they were float64)."""
    pid, tokens, probs, source = cand.parent_ids, cand.tokens, cand.probs, cand.source
    if not isinstance(tokens, np.ndarray):  # tensors: an in-process draft's
        if probs.dtype not in (torch.float32, torch.float64):
            probs = probs.float()
        pid, tokens, probs = pid.numpy(), tokens.numpy(), probs.numpy()
        source = None if source is None else source.numpy()
    if probs.dtype != np.float32 and probs.dtype != np.float64:
        probs = probs.astype(np.float32)
    if source is None:
        source = _drafted(len(tokens))
    return pid, tokens, probs, source


_DRAFTED: dict[int, NDArray[np.int8]] = {}


def _drafted(n: int) -> NDArray[np.int8]:
    """`n` draft-model sources, one read-only array per size (an answer's size recurs:
    one numpy call fewer per step)."""
    got = _DRAFTED.get(n)
    if got is None:
        got = _DRAFTED[n] = np.full(n, SOURCE_DRAFT, dtype=np.int8)
        got.setflags(write=False)
    return got


def candidates_of(pool: Pool) -> Candidates:
    return Candidates(*pool)


def merge_candidates(pool: Pool) -> Pool:
    """One candidate per (parent, token): a token proposed more than once (by the draft
    and the n-gram source, or again from the reserve) keeps its highest probability and
    the sources of all its proposals (then in (parent, token) order)."""
    pid, tokens, probs, sources = pool
    if pid.size < 2:
        return pool
    if len(set(zip(pid.tolist(), tokens.tolist(), strict=True))) == pid.size:
        return pool  # no duplicate: the common case (a set of tens of pairs, no sort)
    key = pid * (int(tokens.max()) + 1) + tokens  # ids and tokens are >= 0
    uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
    best = np.full(uniq.size, -np.inf, dtype=probs.dtype)
    np.maximum.at(best, inv, probs)
    source = np.zeros(uniq.size, dtype=np.int8)
    np.bitwise_or.at(source, inv, sources.astype(np.int8))
    return pid[first], tokens[first], best, source


def unused_lists(tree: TokenTree, pool: ListPool) -> ListPool:
    """Candidates whose parent is still in the tree and that did not become a node."""
    ids, par = tree.id_list, tree.parent_list
    # (parent id, token) of every node but the root (node 0), as sets: tens of elements,
    # where a set lookup costs less than numpy's broadcast comparisons
    nodes = set(zip([ids[p] for p in par[1:]], tree.token_list[1:], strict=True))
    present = set(ids)
    pairs = zip(pool[0], pool[1], strict=True)
    keep = [i for i, pt in enumerate(pairs) if pt[0] in present and pt not in nodes]
    if len(keep) == len(pool[0]):
        return pool
    return tuple([c[i] for i in keep] for c in pool)  # type: ignore[return-value]


def beside(extra: Pool, main: Pool) -> Pool:
    """`extra` proposals scaled to share the mass `main` leaves for each parent: a parent's
    best `main` proposal stays its best, and an extra token ranks by its own probability
    among the alternatives (hybrid: n-grams beside the draft model)."""
    if main[0].size == 0 or extra[0].size == 0:
        return extra
    match = extra[0][:, None] == main[0][None, :]
    top = np.where(match, main[2][None, :].astype(np.float32), np.float32(0)).max(axis=1)
    return extra[0], extra[1], extra[2] * (np.float32(1) - top), extra[3]


def concat_candidates(*parts: Candidates) -> Candidates:
    """The candidates of `parts`, in order."""
    return candidates_of(concat_pools(*(pool_of(c) for c in parts)))


_POOL_DTYPES = (np.dtype(np.int64), np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.int8))


def concat_pools(*pools: Pool) -> Pool:
    """The pools' candidates, in order, with float32 probabilities (as the draft sends
    them: growth ranks the same whichever source and path they came by)."""
    parts = [p for p in pools if p[0].size]
    if len(parts) <= 1:
        pid, tokens, probs, sources = pool = parts[0] if parts else EMPTY_POOL
        if (pid.dtype, tokens.dtype, probs.dtype, sources.dtype) == _POOL_DTYPES:
            return pool  # as `astype(copy=False)` would return it: four numpy calls fewer
        return (
            pid.astype(np.int64, copy=False),
            tokens.astype(np.int64, copy=False),
            probs.astype(np.float32, copy=False),
            sources.astype(np.int8, copy=False),
        )
    return (
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        np.concatenate([p[2].astype(np.float32, copy=False) for p in parts]),
        np.concatenate([p[3] for p in parts]),
    )
