"""Verification at the last stage (docs/architecture.md, "3. The pipeline step").

The last stage computes the final hidden states of every tree row it runs; for the rows
that are the root of a request's tree it computes the logits, draws the token there
(`sampling.draw_index`, on the logits' device) and walks down the tree as far as rows
are present (`spec.verify.walk`). What leaves the stage is a `Verified` message (the
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
the model): `verify_many` computes the logits of the first root of every request of a
round in one call, so a round of many requests reads it once, as the layers before it
do (measured on the CPU with 4 requests: 36% of the round in per-request head calls).

Prompt logprobs (`VerifySpec.prompt_logprobs`, for `echo` with `logprobs`): the request's
prefill rows come out of this stage with their final hidden states too; each is scored
for the prompt token after it (`PromptLogprobs`), and they leave with the first walk.
Structured output: a request opened with a grammar draws every token under it (the
grammar's state after every token drawn so far; docs/architecture.md, "3. The pipeline
step", "Structured output"). The logits rules (logit bias, min_tokens, the penalties:
`spec/penalties.py`) likewise: one state per request, counting the committed tokens
(the Open's prefix and the first root's token) and then every token drawn, so each
node is drawn at with the counts of the output and the path down to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..spec.messages import Activation, Prune, TokenLogprobs, Verified
from ..spec.tree import member
from ..spec.verify import VerifySpec, draw_at, rows_logprobs, walk

NONE = np.empty(0, dtype=np.int64)
# Rows per LM head call (prompt logprobs, a round's roots): bounds the [rows, vocab]
# logits (Qwen2.5's vocabulary, 64 rows: 38 MiB of fp32 logits, 78 MiB in fp64).
HEAD_ROWS = 64
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
        for at in range(0, rows.size, HEAD_ROWS):
            part = rows[at : at + HEAD_ROWS]
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

    def first_root(self, out: Activation) -> tuple[int, Tensor] | None:
        """The node id and final hidden state [1, hidden] of the row the first walk of
        `out` would start at now (None: no walk), for `verify_many` to batch; changes
        nothing."""
        new = self._tree_rows(out)
        if new is None:
            return None
        _, root = self._classify(_Rows.cat(self._held, new, hidden=False))
        if root is None:
            return None
        held = 0 if self._held is None else len(self._held)
        rows, at = (self._held, root) if root < held else (new, root - held)
        assert rows is not None and rows.hidden is not None
        return int(rows.ids[at]), rows.hidden[at : at + 1]

    def on_output(self, out: Activation, ahead: tuple[int, Tensor] | None = None) -> list[Verified]:
        """The final hidden states of tree rows this stage just computed: every walk
        they allow, in order (usually one, or none). Committed rows (prefill) give none;
        they are scored for prompt logprobs when the request asked for them.
        `ahead`: (node id, logits [vocab]) computed already, used if the first walk's
        root is that node."""
        if out.committed and self._prompt is not None and out.hidden is not None:
            self._prompt.on_rows(out.positions.numpy(), out.hidden, self._logits)
        new = self._tree_rows(out)
        if new is None:
            return []
        rows = _Rows.cat(self._held, new)
        found: list[Verified] = []
        while True:
            dead, root = self._classify(rows)
            self._dead = np.union1d(self._dead, rows.ids[dead])
            if root is None:
                rows = rows.take(~dead)
                break
            first = ahead[1] if ahead is not None and ahead[0] == int(rows.ids[root]) else None
            path, verified = self._walk(rows, root, first)
            ahead = None  # only the first walk's root was computed ahead
            found.append(verified)
            gone = dead.copy()
            gone[path] = True
            rows = rows.take(~gone)
        self._held = rows if len(rows) else None
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "verify %s: rows %s parents %s tokens %s -> %s; tip %s dead %s drawn %s held %d",
                self.request_id, new.ids.tolist(), new.parents.tolist(), new.tokens.tolist(),
                [(v.node_ids, v.tokens) for v in found], self._tip, self._dead.tolist(),
                self._drawn.tolist(), self.held_rows,
            )  # fmt: skip
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

    def _walk(
        self, rows: _Rows, root: int, root_logits: Tensor | None = None
    ) -> tuple[list[int], Verified]:
        spec, logprobs = self.spec, []
        hidden = rows.hidden
        assert hidden is not None

        self._count_first_root(rows, root)

        def draw(row: int) -> int:
            if row == root and root_logits is not None:
                logits = root_logits
            else:
                logits = self._logits(hidden[row : row + 1])[0]
            position = int(rows.positions[row])
            return draw_at(logits, spec, position, logprobs, self._grammar, self._rules)

        path, tokens = walk(root, rows.ids, rows.parents, rows.tokens, draw)
        ids = rows.ids[path]
        self._drawn = np.union1d(self._drawn, ids[:-1])
        if self._tip is not None:
            self._drawn = np.union1d(self._drawn, [self._tip[0]])
        self._tip = (int(ids[-1]), tokens[-1])
        found: tuple[TokenLogprobs, ...] | None = None if spec.logprobs is None else tuple(logprobs)
        prompt = None
        if self._prompt is not None:  # the first walk brings them
            prompt = self._prompt.take(
                int(rows.tokens[root]), int(rows.positions[root]), self._logits
            )
            self._prompt = None
        verified = Verified(
            self.request_id,
            tuple(int(i) for i in ids),
            tuple(tokens),
            int(rows.positions[root]),
            found,
            prompt,
        )
        return path, verified


def verify_many(
    outputs: Sequence[tuple[RequestVerifier, Activation]], logits: Callable[[Tensor], Tensor]
) -> list[list[Verified] | ValueError]:
    """Every request's walks of one round (`RequestVerifier.on_output`), the logits of
    their first roots computed by `logits` (the stage model's LM head) in one call per
    `HEAD_ROWS` roots. A request whose output is bad gets its ValueError in its place;
    the others are verified."""
    found: list[list[Verified] | ValueError | None] = [None] * len(outputs)
    roots: list[tuple[int, int, Tensor]] = []  # (output, node id, hidden)
    seen: set[int] = set()
    for i, (verifier, out) in enumerate(outputs):
        if id(verifier) in seen:
            continue  # a later output of a request: its walk depends on the earlier's
        seen.add(id(verifier))
        try:
            root = verifier.first_root(out)
        except ValueError as e:
            found[i] = e
            continue
        if root is not None:
            roots.append((i, *root))
    ahead: dict[int, tuple[int, Tensor]] = {}
    for at in range(0, len(roots), HEAD_ROWS):
        part = roots[at : at + HEAD_ROWS]
        rows = logits(torch.cat([h for _, _, h in part]))
        ahead.update((i, (node, row)) for (i, node, _), row in zip(part, rows, strict=True))
    for i, (verifier, out) in enumerate(outputs):
        if found[i] is not None:
            continue
        try:
            found[i] = verifier.on_output(out, ahead.get(i))
        except ValueError as e:
            found[i] = e
    return found  # type: ignore[return-value]
