"""SpecInfer's controller, on the same pipeline: per pass the token source grows a whole
tree (one layer per draft forward, `depth` layers), the tree crosses all S
stages in one feed, and the longest verified path plus one token is emitted."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .commands import Command, DraftPrefill
from .controller import Controller
from .growth import layer_rows
from .messages import NO_IDS, Candidates, PruneArrays, Verified
from .options import DecodeOptions, Mode
from .tree import NO_NODES, Indices, TokenTree, member


class SpecInferController(Controller):
    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        mode: Mode,
        opts: DecodeOptions,
        num_stages: int,
    ) -> None:
        super().__init__(request_id, prompt, mode, opts, num_stages)
        self.root_pos = len(self.prompt) - 1
        self.tree = TokenTree(self.prompt[-1])
        self._draft_computed: list[Indices] = []  # node ids the draft has cached this pass
        self._unseen: list[int] = []  # verified tokens the draft must still cache
        self._ticket: int | None = None  # the outstanding Propose
        self._fed = False  # the pass's tree is in the pipeline

    @property
    def rows_in_flight(self) -> int:
        return len(self.tree) if self._fed else 0

    # -- events ----------------------------------------------------------------------------
    def _start(self) -> list[Command]:
        return [*self._prefill(), *self._next_pass()]

    def on_candidates(self, ticket: int, cand: Candidates) -> list[Command]:
        pool = self._answer(ticket, cand)
        if self.done or ticket != self._ticket:
            return []
        self._ticket = None
        if self._extend(pool).size == 0:
            return self._feed_tree()
        return self._propose_or_feed()

    def on_verified(self, v: Verified) -> list[Command]:
        if self.done or not self._fed or v.node_ids[0] != self.tree.root_id:
            return []  # not this pass's tree (a stale frame)
        if v.position != self.root_pos:
            return self._desynchronized(v, f"root at {v.position}, not {self.root_pos}")
        return self._verify(v)

    # -- faults ----------------------------------------------------------------------------
    def _restart_at(self, seq: list[int]) -> list[Command]:
        self.tree = TokenTree(seq[-1], first_id=self.tree.last_id + 1)
        self.root_pos = len(seq) - 1
        self._draft_computed, self._unseen, self._ticket, self._fed = [], [], None, False
        return self._next_pass()

    def _without_draft(self) -> list[Command]:
        self._unseen = []
        if self._ticket is not None and not self._fed:  # the pass waited for the draft
            self._ticket = None
            if self.grows_tree:  # hybrid: the n-gram source finishes the tree
                return self._propose_or_feed()
            return self._feed_tree()
        self._ticket = None
        return []

    def _asked_for(self, ticket: int, step: int | None) -> None:
        self._ticket = ticket

    # -- decisions -------------------------------------------------------------------------
    def _next_pass(self) -> list[Command]:
        cmds: list[Command] = []
        if not self.grows_tree:  # one token per pass, as pp
            return self._feed_tree()
        if self._unseen:
            start = self.root_pos - len(self._unseen)
            cmds.append(DraftPrefill(self._unseen, start, self.opts.prefill_chunk))
            self._unseen = []
        self.stats.draft_layers.append([])
        return cmds + self._propose_or_feed()

    def _propose_or_feed(self) -> list[Command]:
        """Ask the draft for the next layer, or feed the tree once it is complete."""
        tree = self.tree
        if tree.frontier_depth >= self.opts.depth:
            return self._feed_tree()
        frontier = tree.frontier()
        layer = layer_rows(self.request_id, tree, frontier, self.root_pos)
        if self.uses_draft:
            self._draft_computed.append(layer.node_ids)
            self.stats.draft_layers[-1].append(len(layer))
        return self._ask(layer, frontier, None)

    def _feed_tree(self) -> list[Command]:
        whole = layer_rows(self.request_id, self.tree, np.arange(len(self.tree)), self.root_pos)
        self._fed = True
        return [self._feed(whole, self._entry_step(whole))]

    def _verify(self, v: Verified) -> list[Command]:
        """The walk down the whole tree the last stage made: the longest verified path
        plus one token."""
        tree = self.tree
        self.stats.root_children.append(int(tree.children(0).size))
        self._verified(tree.root_id)
        path, emitted, logprobs = [0], [], []
        for i, token in enumerate(v.tokens):
            if v.node_ids[i] != int(tree.ids[path[-1]]):
                return self._desynchronized(v, f"node {v.node_ids[i]} is off the path")
            emitted.append(token)
            logprobs.append(self._logprobs_of(v, i))
            done = self.out.emit(token, logprobs[-1])
            child = tree.child_with_token(path[-1], token)
            if child is None or done:
                break
            if i + 1 == len(v.tokens):  # every row of the tree had its logits there
                return self._desynchronized(v, "the walk stopped at a child")
            self.out.hits += 1
            self._count_hit(int(tree.source[child]))
            path.append(child)
            self.stats.hit_depths.append(len(path) - 1)
        self.stats.accepted_lengths.append(len(emitted))
        cmds = self._emit(emitted, done, logprobs)
        if self.done:
            return cmds
        path_ids = tree.ids[path]
        horizon = tree.last_id
        computed = np.concatenate(self._draft_computed or [NO_NODES])
        seen = member(path_ids, computed)
        cmds += self._prune(
            PruneArrays(commit_ids=path_ids, keep_ids=NO_IDS, horizon=horizon),
            draft_prune=PruneArrays(commit_ids=path_ids[seen], keep_ids=NO_IDS, horizon=horizon),
        )
        self._unseen = tree.tokens[path][~seen].tolist() if self.uses_draft else []
        # The next tree is rooted at the last emitted token; ids keep increasing.
        self.root_pos += len(path)
        self.tree = TokenTree(emitted[-1], first_id=horizon + 1)
        self._draft_computed, self._fed = [], False
        self._forget_nodes([])
        return cmds + self._next_pass()
