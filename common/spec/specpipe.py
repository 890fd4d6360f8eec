"""SpecPipe's controller (with a token source), and plain pipeline decoding (without one).

The tree enters stage 1 `layers_per_step` (K) layers per step; the root is verified
when it leaves the last stage (docs/architecture.md, "3. The pipeline step"), and with
K > 1 the verification goes on down the tree as far as the same step's logits go: a
drawn token that is a child whose logits came out with the root's is verified at once,
and so on, so a step may emit up to K tokens. Without a source the tree is
only ever its root: one token per S steps (pp), or per step with one stage
(autoregressive).

Layers are grown one at a time (each from the source's children of the previous one)
and gather in a pending group until it has K layers; the group then enters stage 1 as
one feed. A fresh root (the start, a miss, a replay) is the first layer of its group:
it enters with the K - 1 layers grown below it right after it is drawn, so the step its
logits come out verifies K levels, as a steady group does (K = 1: it enters alone). A
source works, for the group entering at step e + 1, during step e: its asks carry
step e (an ask made between two steps runs beside the next one).

When the source answers an ask of step e while the root's verification is due at a step
<= e, its candidates are held until that verification: in lockstep the verification
comes first, so the layer grows from the surviving parents only. The decision then does
not depend on which of the two events reaches the executor first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .commands import Command
from .controller import Controller
from .growth import (
    EMPTY_LIST_POOL,
    Pool,
    concat_pools,
    join_lists,
    layer_rows,
    pool_lists,
    pool_of,
    unused_lists,
)
from .messages import NO_IDS, Candidates, PruneArrays, RowArrays, Verified
from .options import DecodeOptions, Growth, Mode
from .tree import NO_NODES, TokenTree

ROOT = range(1)  # the root's index, as `_add_layer` takes a layer's


class SpecPipeController(Controller):
    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        mode: Mode,
        opts: DecodeOptions,
        num_stages: int,
    ) -> None:
        super().__init__(request_id, prompt, mode, opts, num_stages)
        # layers in flight ahead of the root: K per stage, and with eager growth the K of
        # the group grown before the verification that makes room for it
        k = self.layers_per_step
        self.max_depth = num_stages * k + (k if opts.growth == Growth.EAGER else 0)
        self.root_pos = len(self.prompt) - 1
        self.tree = TokenTree(self.prompt[-1])
        # Source proposals not (yet) in the tree, for nodes still in it: if a prune removes
        # the whole newest layer, the tree regrows from the deepest survivors' proposals
        # (a one-step bubble) instead of running dry until a miss (S steps). Lists:
        # growth runs on lists (`growth.grow_frontier`).
        self.reserve = EMPTY_LIST_POOL
        self._held: list[Pool] = []  # answers waiting for a verification
        self._asked: dict[int, int] = {}  # outstanding tickets -> the step the source works in
        self._late: set[int] = set()  # outstanding tickets a verification had to pass by
        self._newest: list[int] = []  # node ids of the newest layer grown
        self._newest_ticket: int | None = None
        self._pending = NO_NODES  # node ids grown but not fed yet (the group being built)
        self._node_depth: dict[int, int] = {}  # depth below the root when a node was fed

    @property
    def rows_in_flight(self) -> int:
        return len(self.tree)  # the tree's nodes: fed, or about to be

    def draft_is_late_for(self, v: Verified) -> bool:
        if self.done or not self._asked or v.node_ids[0] != self.tree.root_id:
            return False
        due = self._root_due(self.tree.root_id)
        return any(self._answer_first(step, due) for step in self._asked.values())

    # -- events ----------------------------------------------------------------------------
    def _start(self) -> list[Command]:
        return [*self._prefill(), *self._add_root()]

    def on_candidates(self, ticket: int, cand: Candidates) -> list[Command]:
        step = self._asked.pop(ticket, None)
        self._late.discard(ticket)
        pool = self._answer(ticket, cand)
        if self.done or step is None:
            return []
        return self._offer(pool, step)

    def on_verified(self, v: Verified) -> list[Command]:
        if self.done or v.node_ids[0] != self.tree.root_id:
            return []  # a verification of rows a prune dropped after they left the stage
        if v.position != self.root_pos:
            return self._desynchronized(v, f"root at {v.position}, not {self.root_pos}")
        return self._verify(v)

    # -- faults ----------------------------------------------------------------------------
    def _restart_at(self, seq: list[int]) -> list[Command]:
        self.width = self.opts.width if self.grows_tree else 0
        self.tree = TokenTree(seq[-1], first_id=self.tree.last_id + 1)
        self.root_pos = len(seq) - 1
        self._forget_draft_work()
        self._pending = NO_NODES
        return self._add_root()

    def _without_draft(self) -> list[Command]:
        # What is in the pipeline is verified as usual; a hit's subtree is already in
        # flight, and a miss restarts from the root: nothing waits on the draft.
        self._forget_draft_work()
        if not self.grows_tree:
            self.width = 0
            return self._flush()
        # hybrid: the n-gram source grows the frontier on its own from now on
        return self._offer(pool_of(self._ngram_children(self.tree.frontier())), self._work_step())

    def _forget_draft_work(self) -> None:
        self.reserve = EMPTY_LIST_POOL
        self._held, self._asked, self._late, self._local = [], {}, set(), {}
        self._newest_ticket = None

    # -- decisions -------------------------------------------------------------------------
    def _asked_for(self, ticket: int, step: int | None) -> None:
        assert step is not None
        self._asked[ticket] = step
        self._newest_ticket = ticket

    def _work_step(self) -> int:
        """The step the source works in now: the one before the next group can enter."""
        return max(self._last_enter, self._last_verify)

    def _add_root(self) -> list[Command]:
        """A fresh root (the start, a miss, a replay) joins the pending group like any layer:
        with K > 1 it enters together with the K - 1 layers grown below it, so the step its
        logits come out verifies down to them too; without a source it goes in at once."""
        return self._add_layer(ROOT, feed_now=not self.width)

    def _add_layer(self, idx: range, feed_now: bool = False) -> list[Command]:
        """New tree nodes `idx` (one layer, indices) join the pending group, which is fed
        once it has K layers (or reaches the depth limit, or `feed_now`); then the source
        is asked for their children."""
        tree = self.tree
        ids = tree.ids_at(idx)
        alone = self._pending.size == 0  # the group is this layer (K = 1: always)
        self._newest, self._newest_ticket = ids, None
        cmds: list[Command] = []
        layer = layer_rows(self.request_id, tree, idx, self.root_pos) if self.width else None
        if alone and self.layers_per_step == 1:
            full = True  # fed now: the group is never kept
        else:
            pending = np.array(ids, dtype=np.int64)
            self._pending = pending if alone else np.concatenate([self._pending, pending])
            full = self._pending_layers() >= self.layers_per_step
        if feed_now or full or tree.frontier_depth >= self.max_depth:
            if alone:  # the group is this layer: fed as the source is asked about it
                self._pending = NO_NODES
                cmds += self._feed_group(idx, layer)
            else:
                cmds += self._flush()
        if layer is not None:
            cmds += self._ask(layer, idx, self._work_step())
        return cmds

    def _pending_layers(self) -> int:
        tree = self.tree
        depth = tree.depth_list
        return len({depth[i] for i in tree.index_list(self._pending)})

    def _flush(self) -> list[Command]:
        """Feed the pending group (the nodes of it still in the tree) into stage 1."""
        tree, pending = self.tree, self._pending
        self._pending = NO_NODES
        idx = tree.index_list(pending)
        return self._feed_group(idx) if idx else []

    def _feed_group(self, idx: Sequence[int], layer: RowArrays | None = None) -> list[Command]:
        """Feed tree nodes `idx` into stage 1 as one group (`layer`: their rows, when the
        caller made them already)."""
        tree = self.tree
        group = layer_rows(self.request_id, tree, idx, self.root_pos) if layer is None else layer
        step = self._entry_step(group)
        depth = tree.depth_list
        self._node_depth.update(zip(tree.ids_at(idx), [depth[i] for i in idx], strict=True))
        return [self._feed(group, step)]

    def _offer(self, pool: Pool, step: int) -> list[Command]:
        """Candidates for the layer after the newest, from the source working in `step`."""
        if not self._answer_first(step, self._root_due(self.tree.root_id)):
            self._held.append(pool)
            return []
        return self._grow(pool)

    def _verify(self, v: Verified) -> list[Command]:
        """The last stage drew the root's token, and while that token was a child whose
        logits it had too, that child's (`Verified`): accept them in order; then prune to
        the subtree of the last hit, or restart from the drawn token (a miss)."""
        tree = self.tree
        self._verified(tree.root_id)
        self._count_late_answers()
        horizon = tree.last_id
        path: list[int] = []
        tokens: list[int] = []
        logprobs = []
        for i, token in enumerate(v.tokens):
            if v.node_ids[i] != tree.root_id:
                return self._desynchronized(v, f"node {v.node_ids[i]} is not the root's child")
            path.append(tree.root_id)
            child, children = tree.root_child(token)
            self.stats.root_children.append(children)
            tokens.append(token)
            logprobs.append(self._logprobs_of(v, i))
            self.root_pos += 1
            done = self.out.emit(token, logprobs[-1])
            if child is None:
                break
            self.out.hits += 1
            self._count_hit(tree.source_list[child])
            self.stats.hit_depths.append(self._node_depth.get(tree.id_list[child], 1))
            tree.prune_list(child)
            if done or i + 1 == len(v.tokens):
                break
        hit = child is not None
        cmds = self._emit(tokens, done, logprobs)
        if self.done:
            return cmds
        commit = np.array(path, dtype=np.int64)
        if hit:  # the tree's arrays are replaced, never written: no copy
            prune = PruneArrays(commit_ids=commit, keep_ids=tree.ids, horizon=horizon)
        else:
            tree.reset(token)
            prune = PruneArrays(commit_ids=commit, keep_ids=NO_IDS, horizon=horizon)
        cmds += self._prune(prune)
        live = tree.id_list
        self._forget_nodes(live)
        self._node_depth = {i: self._node_depth[i] for i in live if i in self._node_depth}
        if self.opts.growth == Growth.EAGER:
            # A layer fed ahead of this verification that it dropped whole frees its step:
            # what grows next enters then (a stage drops such rows on arrival).
            ahead = (s for s in self._node_step.values() if s > self._last_verify)
            self._last_enter = max(ahead, default=self._last_verify)
        if self._pending.size:
            self._pending = self._pending[tree.has_ids(self._pending)]
        if not hit:
            self.reserve = EMPTY_LIST_POOL
            self._held, self._pending = [], NO_NODES
            return cmds + self._add_root()
        if not self.width or (self._pending.size and bool((self._pending == tree.root_id).any())):
            cmds += self._flush()  # nothing may wait for growth: the root must go in
            if not self.width:
                return cmds
        held, self._held = self._held, []
        if held:
            return cmds + self._grow(concat_pools(*held))
        newest_alive = tree.has_any(self._newest)
        if not (newest_alive and self._newest_ticket in self._asked):
            # The newest layer was pruned away (or nothing will come for it): regrow from
            # the kept proposals (and fresh n-gram ones) now instead of waiting.
            return cmds + self._grow(pool_of(self._ngram_children(tree.frontier())))
        return cmds

    def _answer_first(self, step: int, due: int) -> bool:
        """Whether, in lockstep, the answer of a source working in `step` comes before the
        verification due at step `due`: strictly before it, or also in the same step
        with eager growth (`Growth`)."""
        return step <= due if self.opts.growth == Growth.EAGER else step < due

    def _count_late_answers(self) -> None:
        """Answers for layers that entered before this verification's step and are still
        outstanding: in lockstep they would have been used by now (counted once each)."""
        for ticket, step in self._asked.items():
            if self._answer_first(step, self._last_verify) and ticket not in self._late:
                self._late.add(ticket)
                self.stats.late_draft_answers += 1

    def _grow(self, fresh: Pool) -> list[Command]:
        """Append the best `width` candidates whose parents are frontier nodes: the source's
        fresh proposals for the newest layer, or kept ones if that layer was pruned away.
        Nothing to append: the pending group goes in as it is."""
        if self.tree.frontier_depth >= self.max_depth:
            self._held.append(fresh)  # too deep: wait until a verification makes room
            return []
        fresh_lists = pool_lists(fresh)  # growth and the reserve on lists
        pool = join_lists(fresh_lists, self.reserve)
        fresh_alive = self.tree.has_any(fresh_lists[0])
        start, new = self._extend_lists(pool)
        if new and not fresh_alive:
            self.stats.regrowths += 1
        self.reserve = unused_lists(self.tree, pool)
        if new == 0:
            return self._flush()
        return self._add_layer(range(start, start + new))
