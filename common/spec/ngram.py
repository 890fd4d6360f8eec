"""A model-free token source: n-gram lookup over the prompt and the text generated so far
(prompt lookup; docs/architecture.md, "2. Token tree").

Code and chat answers repeat what came before (identifiers, argument lists, quoted
lines), so the tokens that followed the last n tokens earlier in the text are good
guesses for what follows them now. The index maps every n-gram (n = 1..`max_n`) of the
verified text to the tokens that followed it, with counts; a tree node's context is the
verified text plus the node's path below the root. Proposals come from the longest
n-gram that matches, then shorter ones; a token's probability is its share of the
followers of that n-gram times a confidence that grows with n (a 1-gram match is a weak
hint, a 4-gram match a strong one). Nothing here runs a model: the source costs nothing
and needs no draft service.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from .growth import EMPTY_POOL, candidates_of
from .messages import SOURCE_NGRAM, Candidates
from .tree import Indices, TokenTree, as_list

DEFAULT_MAX_N = 4
DEFAULT_MIN_N = 1


def confidence(n: int) -> float:
    """How much a match of n tokens is trusted: 1/2, 3/4, 7/8, ... for n = 1, 2, 3, ..."""
    return 1.0 - 0.5**n


class NgramIndex:
    """The followers of every n-gram of a growing token sequence."""

    def __init__(
        self, tokens: Sequence[int] = (), max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], dict[int, int]] = defaultdict(dict)
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append verified tokens: each becomes a follower of the n-grams before it."""
        seq = self.tokens
        for t in tokens:
            t = int(t)
            for n in range(1, min(self.max_n, len(seq)) + 1):
                followers = self._next[tuple(seq[-n:])]
                followers[t] = followers.get(t, 0) + 1
            seq.append(t)

    def propose(self, context: Sequence[int], k: int) -> list[tuple[int, float]]:
        """Up to `k` (token, probability) guesses for what follows `context`, best first.

        The longest matching n-gram's followers come first, weighted by their share and
        `confidence(n)`; shorter matches add tokens not proposed yet, with their lower
        weights. A token proposed at several n keeps its highest weight."""
        best: dict[int, float] = {}
        tail = list(context[-self.max_n :])
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            followers = self._next.get(tuple(tail[-n:]))
            if not followers:
                continue
            total = sum(followers.values())
            for t, c in followers.items():
                p = confidence(n) * c / total
                if p > best.get(t, 0.0):
                    best[t] = p
            if len(best) >= k:
                break
        ranked = sorted(best.items(), key=lambda tp: (-tp[1], tp[0]))
        return ranked[:k]


def ngram_candidates(
    index: NgramIndex, verified: Sequence[int], tree: TokenTree, nodes: Indices, k: int
) -> Candidates:
    """Children of tree nodes `nodes` (indices) proposed by `index`. `verified` is the
    verified text, ending with the root's token; a node's context is it plus the node's
    path below the root."""
    tail = list(verified[-index.max_n :])
    parents: list[int] = []
    tokens: list[int] = []
    probs: list[float] = []
    for node in as_list(nodes):
        path = tree.tokens[tree.path_to(node)[1:]].tolist()
        for t, p in index.propose(tail + path, k):
            parents.append(int(tree.ids[node]))
            tokens.append(t)
            probs.append(p)
    if not parents:
        return candidates_of(EMPTY_POOL)
    return Candidates(  # numpy, as the router's candidates (messages.py)
        np.array(parents, dtype=np.int64),
        np.array(tokens, dtype=np.int64),
        np.array(probs, dtype=np.float32),
        np.full(len(parents), SOURCE_NGRAM, dtype=np.int8),
    )
