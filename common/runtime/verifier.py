"""Verification at the last stage (docs/architecture.md, "3. The pipeline step").

The last stage computes the final hidden states of every tree row it runs; for the rows
that are the root of a request's tree it computes the logits, draws the token there
(`sampling.draw_index`, on the logits' device) and walks down the tree as far as rows
are present (`spec.verify.child_row`). What leaves the stage is a `Verified` message (the
nodes drawn at and their tokens, logprobs if asked for), not logits.

Which row is the root the stage decides itself, without waiting for the router's prune:
after drawing token x at node p, p's child with token x is the next root, whenever it
arrives; p's other children, and everything below them, are dead. A row whose parent
the stage has never seen (attached to the committed prefix: the first root, the root
after a miss, a pending root fed after the router's prune) is a root as well. The
router's controller decides the same from the same draws (it holds the tree, so a child
that reached the stage is one it had grown), so the two never disagree; the router's
prunes then only clean up (they apply to the cache as before, and forget what this
module no longer needs).

Rows that are neither roots nor dead (their parent is a tree row not drawn at yet) keep
their final hidden states here until a walk reaches them or a prune drops them.
Everything is per request and bounded by the rows the request has in the tree.

The LM head reads its whole weight for every call (Qwen2.5's: 467 MB in bf16, a sixth of
the model): `verify_many` computes, in one call, the logits of every row the round's
walks can reach (each request's first root and the rows below it that are present: at
most the request's rows of the round, the K levels that came together), so a round
reads it once, as the layers before it do, however deep its walks go. Computing a row
no walk reaches costs its share of the matmul, a fraction of a second weight read on a
device that streams weights (on a CPU in fp32 it is not: benchmarks/README.md, "One LM
head call and one read per level"). The walks then go level by level for all requests
at once (`drive`): one draw op for the greedy ones, one read of the drawn tokens back
to the host per level (the walk branches on them), none per request.

Prompt logprobs (`VerifySpec.prompt_logprobs`, for `echo` with `logprobs`): the request's
prefill rows come out of this stage with their final hidden states too; each is scored
for the prompt token after it (`PromptLogprobs`), and they leave with the first walk.
Structured output: a request opened with a grammar draws every token under it (the
grammar's state after every token drawn so far; docs/architecture.md, "3. The pipeline
step", "Structured output"). The logits rules (logit bias, min_tokens, the penalties:
`spec/penalties.py`) likewise: one state per request, counting the committed tokens
(the Open's prefix and the first root's token) and then every token drawn, so each
node is drawn at with the counts of the output and the path down to it.

One module: a round's head call, its level-by-level walks and the per-request state they
advance (the root bookkeeping, the grammar and the logits rules) are one protocol, each
step reading what the previous left; split, each half would have to know the other's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..spec.messages import Activation, Prune, TokenLogprobs, Verified
from ..spec.sampling import SamplingParams
from ..spec.tree import member
from ..spec.verify import (
    VerifySpec,
    child_row,
    draw_logits,
    draw_tokens,
    read_tokens,
    rows_logprobs,
    took,
)

NONE = np.empty(0, dtype=np.int64)
# Rows per LM head call of a round (its roots and the rows below them): bounds the
# [rows, vocab] logits (Qwen2.5's vocabulary, 256 rows: 148 MiB in fp32, a third of the
# head's weight in bf16, which a second call would read again).
HEAD_ROWS = 256
# Rows per logprobs pass (prompt logprobs' head calls, a round's logprobs): they are
# computed in fp64 (64 rows of Qwen2.5's vocabulary: 78 MiB).
LOGPROB_ROWS = 64
log = logging.getLogger(__name__)


@dataclass
class _Rows:
    """Tree rows with final hidden states, in arrival order (parents before children)."""

    ids: np.ndarray
    parents: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    hidden: Tensor | None

    def __len__(self) -> int:
        return int(self.ids.size)

    def take(self, keep: np.ndarray) -> _Rows:
        if keep.all():
            return self
        idx = np.flatnonzero(keep)
        hidden = None
        if self.hidden is not None and idx.size:
            hidden = self.hidden.index_select(0, torch.from_numpy(idx).to(self.hidden.device))
        return _Rows(
            self.ids[idx], self.parents[idx], self.tokens[idx], self.positions[idx], hidden
        )

    @staticmethod
    def cat(a: _Rows | None, b: _Rows, hidden: bool = True) -> _Rows:
        """`a`'s rows, then `b`'s; `hidden=False`: without hidden states (no copy)."""
        if a is None or len(a) == 0:
            return b
        assert a.hidden is not None and b.hidden is not None
        return _Rows(
            np.concatenate([a.ids, b.ids]),
            np.concatenate([a.parents, b.parents]),
            np.concatenate([a.tokens, b.tokens]),
            np.concatenate([a.positions, b.positions]),
            torch.cat([a.hidden, b.hidden.to(a.hidden.device)]) if hidden else None,
        )


def row_tokens_of(out: Activation, inp: Activation) -> Tensor | None:
    """The token ids of `out`'s tree rows, from the activation they were computed from
    (its `tokens` on the first stage, its `row_tokens` after): a stage's output keeps
    only the rows a prune left, so they are looked up by node id."""
    src = inp.tokens if inp.row_tokens is None else inp.row_tokens
    if src is None or out.committed or len(out) == 0:
        return None
    if len(out) == len(inp) and torch.equal(out.node_ids, inp.node_ids):
        return src
    order = torch.argsort(inp.node_ids)
    at = torch.searchsorted(inp.node_ids[order], out.node_ids)
    return src[order[at]]


class PromptLogprobs:
    """A request's prompt logprobs (`VerifySpec.prompt_logprobs`), computed as the final
    hidden states of its prefill's committed rows come out: the row at position p gives
    the logprob of prompt token p + 1. Those tokens are the ones the request commits
    before its first root (`prefix_tokens`, the Open's) and, for the last prefill row,
    the first root's token: that row's hidden state waits for the first walk. Rows a
    prefix cache served were never computed here, so such a request's prefill starts at
    0 (`Controller._prefill_start`); one that did not is refused (ValueError)."""

    def __init__(self, prefix_tokens: Sequence[int], prompt_len: int, top: int) -> None:
        self.tokens = np.asarray(prefix_tokens, dtype=np.int64).reshape(-1)
        self.top = top
        self.found: list[TokenLogprobs | None] = [None] * max(prompt_len - 1, 0)
        self._last: tuple[int, Tensor] | None = None  # (position, hidden) of the last row

    def on_rows(self, positions: np.ndarray, hidden: Tensor, logits: Callable) -> None:
        """Committed rows with their final hidden states [rows, hidden]."""
        scored = positions < len(self.found)  # rows before the prompt's last token
        known = scored & (positions + 1 < self.tokens.size)
        rows = np.flatnonzero(known)
        for at in range(0, rows.size, LOGPROB_ROWS):
            part = rows[at : at + LOGPROB_ROWS]
            h = hidden.index_select(0, torch.from_numpy(part).to(hidden.device))
            self._put(positions[part], logits(h), self.tokens[positions[part] + 1])
        for i in np.flatnonzero(scored & ~known):
            if self._last is not None or int(positions[i]) != len(self.found) - 1:
                raise ValueError(
                    f"prompt logprobs: the token after position {int(positions[i])} is unknown"
                )
            self._last = (int(positions[i]), hidden[int(i) : int(i) + 1])

    def take(self, root_token: int, root_position: int, logits: Callable) -> tuple:
        """All of them, at the first walk (its root: the first root's token and position)."""
        if self._last is not None:
            position, h = self._last
            if root_position != position + 1:
                raise ValueError(f"prompt logprobs: a first root at {root_position}")
            self._put(np.array([position]), logits(h), [root_token])
            self._last = None
        missing = [p for p, lp in enumerate(self.found) if lp is None]
        if missing:
            raise ValueError(
                f"prompt logprobs: the prompt's rows at positions {missing[0]}.."
                f"{missing[-1]} were not computed here (a prefix cache served them?)"
            )
        return tuple(self.found)  # type: ignore[arg-type]

    def _put(self, positions: np.ndarray, logits: Tensor, tokens) -> None:
        for p, lp in zip(positions.tolist(), rows_logprobs(logits, tokens, self.top), strict=True):
            self.found[p] = lp


class RequestVerifier:
    """One request's verification at the last stage. `logits` computes the LM head of
    final hidden states [rows, hidden] (the stage model's); `prefix_tokens`: the tokens
    the request commits before its first root (the Open's), which prompt logprobs score."""

    def __init__(
        self,
        request_id: str,
        spec: VerifySpec,
        logits: Callable[[Tensor], Tensor],
        prefix_tokens: Sequence[int] = (),
    ) -> None:
        self.request_id, self.spec, self._logits = request_id, spec, logits
        self._prompt: PromptLogprobs | None = None
        if spec.prompt_logprobs is not None:
            self._prompt = PromptLogprobs(prefix_tokens, spec.output_start, spec.prompt_logprobs)
        self._held: _Rows | None = None  # rows whose parent is a tree row not drawn at yet
        self._dead = NONE  # ids of rows a draw ruled out (until a prune's horizon passes them)
        self._drawn = NONE  # ids drawn at before the tip (until the router commits them)
        self._tip: tuple[int, int] | None = None  # (node drawn at last, its token)
        # structured output: the grammar after every token drawn so far (each draw is
        # committed, in order: the router accepts what this stage draws)
        self._grammar = spec.grammar_state()
        # the logits rules after every token so far: the committed prefix now, the first
        # root's token at the first walk (`_first_root`), then each draw
        self._rules = spec.rules(prefix_tokens)
        self._first_root: int | None = len(prefix_tokens)  # its position (None once counted)

    @property
    def held_rows(self) -> int:
        return 0 if self._held is None else len(self._held)

    def on_output(self, out: Activation) -> list[Verified]:
        """The final hidden states of tree rows this stage just computed: every walk
        they allow, in order (usually one, or none). Committed rows (prefill) give none;
        they are scored for prompt logprobs when the request asked for them."""
        rows = self._arrived(out)
        if rows is None:
            return []
        walk = self._next_walk(rows)
        if walk is not None:
            drive([walk], self._logits)
        return self._walks_from(walk)

    def _arrived(self, out: Activation) -> _Rows | None:
        """The rows a walk may use now: those held, then `out`'s tree rows (None: it
        has none). Its committed rows are scored for prompt logprobs if asked for."""
        if out.committed and self._prompt is not None and out.hidden is not None:
            self._prompt.on_rows(out.positions.numpy(), out.hidden, self._logits)
        new = self._tree_rows(out)
        if new is None:
            return None
        if log.isEnabledFor(logging.DEBUG):
            log.debug("verify %s: rows %s parents %s tokens %s; tip %s dead %s drawn %s",
                      self.request_id, new.ids.tolist(), new.parents.tolist(),
                      new.tokens.tolist(), self._tip, self._dead.tolist(),
                      self._drawn.tolist())  # fmt: skip
        return _Rows.cat(self._held, new)

    def _next_walk(self, rows: _Rows) -> _Walk | None:
        """The walk `rows` allow now (None: none; the rows not dead are then held)."""
        dead, root = self._classify(rows)
        self._dead = np.union1d(self._dead, rows.ids[dead])
        if root is None:
            rows = rows.take(~dead)
            self._held = rows if len(rows) else None
            return None
        self._count_first_root(rows, root)
        return _Walk(self, rows, dead, root)

    def _walks_from(self, walk: _Walk | None) -> list[Verified]:
        """`walk` (drawn to its end) ended, then every further walk its rows allow, each
        driven alone (a second root in one output is rare: a miss's new root)."""
        found: list[Verified] = []
        while walk is not None:
            verified, rows = self._end(walk)
            found.append(verified)
            walk = self._next_walk(rows)
            if walk is not None:
                drive([walk], self._logits)
        return found

    @staticmethod
    def _tree_rows(out: Activation) -> _Rows | None:
        """`out`'s tree rows (None: committed rows or none)."""
        if out.committed or len(out) == 0:
            return None
        if out.hidden is None or out.row_tokens is None:
            raise ValueError("verification needs the rows' final hidden states and token ids")
        return _Rows(
            out.node_ids.numpy(),
            out.parent_ids.numpy(),
            out.row_tokens.numpy(),
            out.positions.numpy(),
            out.hidden,
        )

    def on_prune(self, prune: Prune) -> None:
        """The router's prune: forget what it settles. The router decides after this
        stage (it verifies what the stage drew, later), so its prune may still keep
        nodes the stage already knows are dead or drew at: those are remembered until a
        prune drops or commits them (the stage's own filter then drops what hangs below
        them)."""
        h = prune.horizon
        if log.isEnabledFor(logging.DEBUG):
            log.debug("verify %s: prune commit %s keep %s horizon %d", self.request_id,
                      prune.commit_ids.tolist(), prune.keep_ids.tolist(), h)  # fmt: skip
        if self._held is not None:
            ids = self._held.ids
            alive = (ids > h) | member(ids, prune.keep_ids.numpy())
            self._held = self._held.take(alive) if alive.any() else None
        keep = prune.keep_ids.numpy()
        self._dead = self._dead[(self._dead > h) | member(self._dead, keep)]
        self._drawn = self._drawn[(self._drawn > h) | member(self._drawn, keep)]

    # -- one walk ----------------------------------------------------------------------
    def _count_first_root(self, rows: _Rows, root: int) -> None:
        """The first walk's root is the last committed token (the prompt's last, or the
        last emitted before a replay): the penalties count it before the first draw."""
        committed = self._first_root
        if committed is None:
            return
        position, self._first_root = int(rows.positions[root]), None
        if self._rules.counts is None:
            return
        if position != committed:
            raise ValueError(
                f"penalties: the first root is at position {position}, but the Open "
                f"committed {committed} tokens before it (prefix_token_ids)"
            )
        self._rules.counts.add(int(rows.tokens[root]), output=position >= self.spec.output_start)

    def _classify(self, rows: _Rows) -> tuple[np.ndarray, int | None]:
        """Which rows are dead, and the first root (None: none), by the parent of each
        (rows are in order, so a dead parent comes before its children)."""
        n = len(rows)
        dead = np.zeros(n, dtype=bool)
        present = set(rows.ids.tolist())
        dead_ids = set(self._dead.tolist())
        drawn = set(self._drawn.tolist())
        tip_node, tip_token = self._tip if self._tip is not None else (None, None)
        root = None
        for i, (node, parent, token) in enumerate(
            zip(rows.ids.tolist(), rows.parents.tolist(), rows.tokens.tolist(), strict=True)
        ):
            if parent in dead_ids or parent in drawn:
                is_root = False
            elif parent == tip_node:
                is_root = token == tip_token
            elif parent in present:
                continue  # below a row not drawn at yet: held
            else:
                is_root = True  # attached to the committed prefix
            if is_root:
                if root is None:
                    root = i
            else:
                dead[i] = True
                dead_ids.add(node)
        return dead, root

    def _end(self, walk: _Walk) -> tuple[Verified, _Rows]:
        """What `walk` drew, as a `Verified`, and the rows left after it (its path and
        the dead rows gone)."""
        rows, path, tokens = walk.rows, walk.path, walk.tokens
        ids = rows.ids[path]
        self._drawn = np.union1d(self._drawn, ids[:-1])
        if self._tip is not None:
            self._drawn = np.union1d(self._drawn, [self._tip[0]])
        self._tip = (int(ids[-1]), tokens[-1])
        found = None if self.spec.logprobs is None else tuple(walk.logprobs)
        prompt = None
        if self._prompt is not None:  # the first walk brings them
            root = walk.root
            prompt = self._prompt.take(
                int(rows.tokens[root]), int(rows.positions[root]), self._logits
            )
            self._prompt = None
        verified = Verified(
            self.request_id,
            tuple(int(i) for i in ids),
            tuple(tokens),
            int(rows.positions[walk.root]),
            found,
            prompt,
        )
        gone = walk.dead.copy()
        gone[path] = True
        return verified, rows.take(~gone)


class _Walk:
    """One walk in progress: its rows, the row it draws at next, what it drew so far,
    and the raw logits of the rows it may reach (computed ahead: `below_root`)."""

    def __init__(self, verifier: RequestVerifier, rows: _Rows, dead: np.ndarray, root: int):
        self.verifier, self.rows, self.dead, self.root = verifier, rows, dead, root
        self.row: int = root
        self.path: list[int] = []
        self.tokens: list[int] = []
        self.logits: dict[int, Tensor] = {}  # row -> its raw logits [vocab]
        self.drawn_from: list[Tensor] = []  # the raw logits of each draw (for logprobs)
        self.logprobs: list[TokenLogprobs] = []

    def below_root(self) -> np.ndarray:
        """The rows this walk can reach: its root and every row below it present now
        (the rows are in arrival order, parents first). Bounded by the request's rows
        in the round: the tree's levels that arrived together, K of them."""
        ids, parents = self.rows.ids, self.rows.parents
        under = {int(ids[self.root])}
        reach = [self.root]
        for i in range(self.root + 1, len(ids)):
            if int(parents[i]) in under:
                under.add(int(ids[i]))
                reach.append(i)
        return np.asarray(reach, dtype=np.int64)

    def draw(self) -> tuple[Tensor, SamplingParams, int]:
        """What the next draw is (for `draw_tokens`): the logits to draw from, after the
        grammar and the rules, the sampling parameters and the output position."""
        v = self.verifier
        position = v.spec.draw_position(int(self.rows.positions[self.row]))
        drawn = draw_logits(self.logits[self.row], v.spec, position, v._grammar, v._rules)
        return drawn, v.spec.sampling, position

    def took(self, token: int) -> bool:
        """The token drawn at the row: taken by the grammar and the rules; whether the
        walk goes on (at the child with that token, if present)."""
        v = self.verifier
        took(token, v._grammar, v._rules)
        self.path.append(self.row)
        self.tokens.append(token)
        if v.spec.logprobs is not None:
            self.drawn_from.append(self.logits[self.row])
        rows = self.rows
        child = child_row(self.row, token, rows.ids, rows.parents, rows.tokens)
        if child is None:
            return False
        self.row = child
        return True


def _compute_ahead(walks: Sequence[_Walk], logits: Callable[[Tensor], Tensor]) -> None:
    """The raw logits of every row the walks can reach, in one LM head call per
    `HEAD_ROWS` rows (one per round unless the round holds more)."""
    parts, owners = [], []
    for w in walks:
        reach = w.below_root()
        hidden = w.rows.hidden
        assert hidden is not None
        parts.append(hidden.index_select(0, torch.from_numpy(reach).to(hidden.device)))
        owners += [(w, int(r)) for r in reach]
    if not parts:
        return
    hidden = torch.cat(parts) if len(parts) > 1 else parts[0]
    for at in range(0, hidden.shape[0], HEAD_ROWS):
        computed = logits(hidden[at : at + HEAD_ROWS])
        for (w, row), x in zip(owners[at : at + HEAD_ROWS], computed, strict=True):
            w.logits[row] = x


def _add_logprobs(walks: Sequence[_Walk]) -> None:
    """Each walk's logprobs (the raw logits of its draws), for all walks that ask the
    same number of top logprobs in one computation (and one read back) per
    `LOGPROB_ROWS` draws."""
    by_top: dict[int, list[_Walk]] = {}
    for w in walks:
        top = w.verifier.spec.logprobs
        if top is not None and w.drawn_from:
            by_top.setdefault(top, []).append(w)
    for top, group in by_top.items():
        rows = [x for w in group for x in w.drawn_from]
        tokens = [t for w in group for t in w.tokens]
        found: list[TokenLogprobs] = []
        for at in range(0, len(rows), LOGPROB_ROWS):
            part = torch.stack(rows[at : at + LOGPROB_ROWS])
            found += rows_logprobs(part, tokens[at : at + LOGPROB_ROWS], top)
        it = iter(found)
        for w in group:
            w.logprobs = [next(it) for _ in w.tokens]


def drive(walks: Sequence[_Walk], logits: Callable[[Tensor], Tensor]) -> None:
    """Every walk drawn to its end, all of them level by level: the logits of every row
    they can reach in one LM head call (`_compute_ahead`), then per level one draw of
    every walk still going (`draw_tokens`: one op for the greedy ones) and one read of
    the drawn tokens back to the host, which the walks branch on."""
    _compute_ahead(walks, logits)
    going = list(walks)
    while going:
        tokens = read_tokens(draw_tokens([w.draw() for w in going]))
        going = [w for w, token in zip(going, tokens, strict=True) if w.took(token)]
    _add_logprobs(walks)


def verify_many(
    outputs: Sequence[tuple[RequestVerifier, Activation]], logits: Callable[[Tensor], Tensor]
) -> list[list[Verified] | ValueError]:
    """Every request's walks of one round (`RequestVerifier.on_output`), the first walk
    of every request driven together (`drive`: one LM head call for the rows they can
    reach, one read back per level). A request whose output is bad gets its ValueError
    in its place; the others are verified."""
    found: list[list[Verified] | ValueError | None] = [None] * len(outputs)
    firsts: dict[int, _Walk | None] = {}  # output -> its request's first walk
    seen: set[int] = set()
    for i, (verifier, out) in enumerate(outputs):
        if id(verifier) in seen:
            continue  # a later output of a request: its walk depends on the earlier's
        seen.add(id(verifier))
        try:
            rows = verifier._arrived(out)
            firsts[i] = None if rows is None else verifier._next_walk(rows)
        except ValueError as e:
            found[i] = e
    drive([w for w in firsts.values() if w is not None], logits)
    for i, (verifier, out) in enumerate(outputs):
        if found[i] is not None:
            continue
        try:
            found[i] = verifier._walks_from(firsts[i]) if i in firsts else verifier.on_output(out)
        except ValueError as e:
            found[i] = e
    return found  # type: ignore[return-value]
