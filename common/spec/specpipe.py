"""SpecPipe's controller (with a draft), and plain pipeline decoding (without one).

The tree enters stage 1 one layer per step; the root is verified when it leaves the last
stage (docs/architecture.md, "3. The pipeline step"). Without a draft the tree is only
ever its root: one token per S steps (pp), or per step with one stage (autoregressive).

When the draft answers for the layer entering at step e while the root's verification
is due at a step <= e, its candidates are held until that verification: in lockstep the
verification comes first, so the layer grows from the surviving parents only. The
decision then does not depend on which of the two events reaches the executor first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .commands import Command, Propose
from .controller import Controller
from .growth import concat_candidates, extend_frontier, layer_activation, unused_candidates
from .messages import EMPTY_IDS, Activation, Candidates, Prune
from .options import DecodeOptions, Mode
from .tree import TokenTree


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
        self.max_depth = num_stages  # layers in flight ahead of the root: one per stage
        self.root_pos = len(self.prompt) - 1
        self.tree = TokenTree(self.prompt[-1])
        # Draft proposals not (yet) in the tree, for nodes still in it: if a prune removes
        # the whole newest layer, the tree regrows from the deepest survivors' proposals
        # (a one-step bubble) instead of running dry until a miss (S steps).
        self.reserve = Candidates.empty()
        self._held: list[Candidates] = []  # answers waiting for a verification
        self._asked: dict[int, int] = {}  # outstanding Propose tickets -> layer's entry step
        self._late: set[int] = set()  # outstanding tickets a verification had to pass by
        self._newest = EMPTY_IDS  # node ids of the newest layer fed
        self._newest_ticket: int | None = None
        self._node_depth: dict[int, int] = {}  # depth below the root when a node was fed

    @property
    def rows_in_flight(self) -> int:
        return len(self.tree)  # every node of the tree has been fed

    # -- events ----------------------------------------------------------------------------
    def start(self) -> list[Command]:
        return [*self._prefill(), *self._enter(self._root_layer())]

    def on_candidates(self, ticket: int, cand: Candidates) -> list[Command]:
        step = self._asked.pop(ticket, None)
        self._late.discard(ticket)
        if self.done or step is None:
            return []
        if self._root_due(self.tree.root_id) <= step:
            self._held.append(cand)
            return []
        return self._grow(cand)

    def on_logits(self, act: Activation) -> list[Command]:
        if self.done or act.logits is None:
            return []
        rows = (act.node_ids == self.tree.root_id).nonzero()
        if rows.numel() == 0:
            return []  # rows a prune dropped after they left the stage before
        return self._verify(act.logits[int(rows[0, 0])])

    # -- faults ----------------------------------------------------------------------------
    def _restart_at(self, seq: list[int]) -> list[Command]:
        self.width = self.opts.width if self.uses_draft else 0
        self.tree = TokenTree(seq[-1], first_id=self.tree.last_id + 1)
        self.root_pos = len(seq) - 1
        self._forget_draft_work()
        return self._enter(self._root_layer())

    def _without_draft(self) -> list[Command]:
        # What is in the pipeline is verified as usual; a hit's subtree is already in
        # flight, and a miss restarts from the root: nothing waits on the draft.
        self.width = 0
        self._forget_draft_work()
        return []

    def _forget_draft_work(self) -> None:
        self.reserve = Candidates.empty()
        self._held, self._asked, self._late = [], {}, set()
        self._newest_ticket = None

    # -- decisions -------------------------------------------------------------------------
    def _root_layer(self) -> Activation:
        return layer_activation(self.request_id, self.tree, torch.tensor([0]), self.root_pos)

    def _enter(self, layer: Activation) -> list[Command]:
        step = self._entry_step(layer)
        depths = (layer.positions - self.root_pos).tolist()
        self._node_depth.update(zip(layer.node_ids.tolist(), depths, strict=True))
        cmds: list[Command] = [self._feed(layer, step)]
        self._newest, self._newest_ticket = layer.node_ids, None
        if self.width:
            ticket = next(self._tickets)
            self._asked[ticket] = step
            self._newest_ticket = ticket
            top_k = min(self.opts.top_k_children, self.width)
            temperature = self.opts.sampling.temperature
            cmds.append(Propose(layer, top_k, temperature, ticket, step))
        return cmds

    def _verify(self, logits: torch.Tensor) -> list[Command]:
        """The root's logits are out: draw the token, then prune to its subtree or restart."""
        tree, root_id = self.tree, self.tree.root_id
        token = self.out.sample(logits)
        child = tree.child_with_token(0, token)
        self.stats.root_children.append(int(tree.children(0).numel()))
        self._verified(root_id)
        self._count_late_answers()
        old_root = torch.tensor([root_id])
        horizon = tree.last_id
        if child is not None:
            self.out.hits += 1
            self.stats.hit_depths.append(self._node_depth.get(int(tree.ids[child]), 1))
            tree.prune_to(child)
            prune = Prune(commit_ids=old_root, keep_ids=tree.ids.clone(), horizon=horizon)
        else:
            tree.reset(token)
            prune = Prune(commit_ids=old_root, keep_ids=EMPTY_IDS, horizon=horizon)
        self.root_pos += 1
        cmds = self._emit([token], self.out.emit(token))
        if self.done:
            return cmds
        cmds += self._prune(prune)
        live = tree.ids.tolist()
        self._forget_nodes(live)
        self._node_depth = {i: self._node_depth[i] for i in live if i in self._node_depth}
        if child is None:
            self.reserve = Candidates.empty()
            self._held = []
            return cmds + self._enter(self._root_layer())
        if not self.width:
            return cmds
        held, self._held = self._held, []
        if held:
            return cmds + self._grow(concat_candidates(*held))
        newest_alive = bool(torch.isin(self._newest, tree.ids).any())
        if not (newest_alive and self._newest_ticket in self._asked):
            # The newest layer was pruned away (or nothing will come for it): regrow from
            # the kept proposals now instead of waiting for the draft.
            return cmds + self._grow(Candidates.empty())
        return cmds

    def _count_late_answers(self) -> None:
        """Answers for layers that entered before this verification's step and are still
        outstanding: in lockstep they would have been used by now (counted once each)."""
        for ticket, step in self._asked.items():
            if step < self._last_verify and ticket not in self._late:
                self._late.add(ticket)
                self.stats.late_draft_answers += 1

    def _grow(self, cand: Candidates) -> list[Command]:
        """Append the best `width` candidates whose parents are frontier nodes: the draft's
        fresh proposals for the newest layer, or kept ones if that layer was pruned away."""
        if self.tree.frontier_depth >= self.max_depth:
            self._held.append(cand)  # too deep: wait until a verification makes room
            return []
        pool = concat_candidates(cand, self.reserve)
        fresh_alive = bool(torch.isin(cand.parent_ids, self.tree.ids).any())
        new = extend_frontier(self.tree, pool, self.width)
        if new.numel() and not fresh_alive:
            self.stats.regrowths += 1
        self.reserve = unused_candidates(self.tree, pool)
        if new.numel() == 0:
            return []
        return self._enter(layer_activation(self.request_id, self.tree, new, self.root_pos))
