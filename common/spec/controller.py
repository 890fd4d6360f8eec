"""The request controller: every decision of one request, as a state machine with no I/O
(docs/architecture.md, "5. The request controller and its executors").

Events in: logits of some rows out of the last stage (`on_logits`), the draft's
candidates for a layer it was asked to expand (`on_candidates`), a failure
(`on_failure`). Commands out (`commands.py`): feed rows to stage 1, broadcast a prune,
open/prefill/prune the draft and ask it to propose, emit tokens, finish. The controller
owns the statistics and the step accounting: the pipeline step at which every feed
enters stage 1 and every verification happens, had the stages run in lockstep. The
in-process executor runs exactly those steps; the network executor runs asynchronously
and reports the same figures whenever the draft keeps up.

Subclasses: `SpecPipeController` (specpipe, pp, autoregressive) and
`SpecInferController`; `make_controller` picks one for a mode.

Faults (docs/architecture.md, "5. The request controller and its executors"): when a
replica on the request's path is lost, `replay` re-opens the request on a fresh path
from the tokens verified so far; when only the draft is lost, `drop_draft` continues
without it (width 0, as pp). Because every token is drawn from (seed, position), the
continuation is the one the request would have had.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence

from .commands import BroadcastPrune, Command, DraftOpen, DraftPrune, Emit, Feed, Finish
from .growth import prefill_chunks
from .messages import Activation, Candidates, Prune
from .options import DecodeOptions, Mode, tree_capacity
from .output import OutputState
from .stats import DecodeStats


class Controller(ABC):
    """One request's decisions. `num_stages` is the pipeline depth the accounting uses."""

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        mode: Mode,
        opts: DecodeOptions,
        num_stages: int,
    ) -> None:
        self.request_id, self.mode, self.opts = request_id, mode, opts
        self.prompt = [int(t) for t in prompt]
        self.num_stages = num_stages
        self._uses_draft = mode.uses_draft  # until the draft is dropped
        self.out = OutputState(opts.max_new_tokens, opts.sampling, opts.stop_token_ids)
        self.width = opts.width if self.uses_draft else 0  # tree nodes per layer, for now
        self.stats = DecodeStats(mode=mode.value, stages=num_stages, width=self.width)
        self.done = False
        self._feeds = 0  # feeds created
        self._prunes = 0  # prunes broadcast
        self._tickets = itertools.count()
        # Step accounting: lockstep step at which each live node entered stage 1.
        self._node_step: dict[int, int] = {}
        self._last_enter = -1
        self._last_verify = -1

    # -- what executors ask --------------------------------------------------------------
    @property
    def uses_draft(self) -> bool:
        """Whether the request still uses a draft (False once `drop_draft` was called)."""
        return self._uses_draft

    @property
    def tree_rows(self) -> int:
        """The most tree rows in flight, so the most rows of one logits frame."""
        return tree_capacity(self.mode, self.num_stages, self.opts)

    @property
    def capacity(self) -> int:
        """Cache rows a stage (or the draft) needs for this request."""
        return len(self.prompt) + self.opts.max_new_tokens + self.tree_rows

    @property
    def root_logits_only(self) -> bool:
        """The last stage needs to return logits only for the root (one verification at a
        time); specinfer verifies whole trees."""
        return self.mode != Mode.SPECINFER

    @property
    def tokens(self) -> list[int]:
        return self.out.tokens

    @property
    def max_width(self) -> int:
        """The width the request asked for (its caches are sized for it)."""
        return self.opts.width if self.uses_draft else 0

    def set_width(self, width: int) -> None:
        """Tree nodes per layer from the next growth on (elastic width under load);
        between 1 and the width asked for. Tokens do not depend on it."""
        if self.uses_draft:
            self.width = max(1, min(int(width), self.max_width))

    def rows_in_flight(self) -> int:
        """Tree rows the pipeline holds for this request now (executors weigh replicas'
        load by it)."""
        return 0

    # -- events ----------------------------------------------------------------------------
    @abstractmethod
    def start(self) -> list[Command]:
        """The request's first commands: prefill, the draft's prompt, the first root."""

    @abstractmethod
    def on_logits(self, act: Activation) -> list[Command]:
        """Rows with logits came out of the last stage."""

    @abstractmethod
    def on_candidates(self, ticket: int, cand: Candidates) -> list[Command]:
        """The draft answered `Propose(ticket=...)` (possibly with no candidates)."""

    def replay(self, uses_draft: bool) -> list[Command]:
        """Re-open the request on a fresh path (another replica of some stage, or of the
        draft), from what is verified so far: the tree restarts at the last emitted token
        (or the prompt's last) as its root; the commands are the prefill chunks of prompt
        + emitted tokens (all but that root), a `DraftOpen` with the whole sequence when
        the new path has a draft (`uses_draft`: False drops the draft, True takes one
        again in a mode that uses one, also after `drop_draft`), then the root's feed. Feeds and prunes are numbered from 0 again (the new path's
        stages know nothing of the old one); node ids and draft tickets keep growing, so
        nothing of the old path can be mistaken for the new one.

        Accounting: the chunks enter one per step after every feed the old path
        received, and those steps count as decode steps (the time the pipeline spends
        on the fault); `prefill_steps` stays the first prefill's; `stats.replays`
        counts the re-opens."""
        if self.done:
            return []
        if self._uses_draft and not uses_draft:
            self.drop_draft()
        elif uses_draft and self.mode.uses_draft:
            self._uses_draft = True  # a draft again (one dropped before is replaced)
        self.stats.replays += 1
        seq = [*self.prompt, *self.out.tokens]
        self._feeds = self._prunes = 0
        self._node_step = {}
        start = max(self._last_enter, self._last_verify) + 1
        chunks = prefill_chunks(self.request_id, seq, self.opts.prefill_chunk)
        cmds: list[Command] = []
        if self.uses_draft:
            cmds.append(DraftOpen(seq, self.capacity, self.opts.prefill_chunk))
        cmds += [self._feed(c, start + i) for i, c in enumerate(chunks)]
        self._last_enter = start + len(chunks) - 1
        return cmds + self._restart_at(seq)

    def drop_draft(self) -> list[Command]:
        """The draft is lost and the stages are not: go on without it (width 0, as pp)
        from now on; what is in the pipeline is verified as usual. `stats.draft_drops`
        counts it."""
        if self.done or not self._uses_draft:
            return []
        self._uses_draft = False
        self.stats.draft_drops += 1
        return self._without_draft()

    @abstractmethod
    def _restart_at(self, seq: list[int]) -> list[Command]:
        """Replay: a fresh tree rooted at `seq[-1]` (position len(seq) - 1), the commands
        that put that root into the pipeline."""

    @abstractmethod
    def _without_draft(self) -> list[Command]:
        """Forget the draft's outstanding work; commands needed to go on without it."""

    def on_failure(self, message: str) -> list[Command]:
        """A stage or the draft failed the request."""
        if self.done:
            return []
        self.done = True
        self.stats.finish_reason = "error"
        return [Finish("error", message)]

    # -- helpers for the modes -------------------------------------------------------------
    def _prefill(self) -> list[Command]:
        """Verified prompt tokens (all but the last, the first root) into stage 1, one chunk
        per step before step 0; the draft caches the prompt at the same time."""
        chunks = prefill_chunks(self.request_id, self.prompt, self.opts.prefill_chunk)
        self.stats.prefill_steps = len(chunks)
        cmds: list[Command] = []
        if self.uses_draft:
            cmds.append(DraftOpen(self.prompt, self.capacity, self.opts.prefill_chunk))
        cmds += [self._feed(c, i - len(chunks)) for i, c in enumerate(chunks)]
        return cmds

    def _feed(self, act: Activation, step: int) -> Feed:
        feed = Feed(act, self._feeds, self._prunes, step)
        self._feeds += 1
        return feed

    def _entry_step(self, layer: Activation) -> int:
        """Lockstep step at which `layer` enters stage 1: after the previous layer, after
        the last verification (it was decided after it) and after its parents' layer."""
        parents = (self._node_step.get(p) for p in set(layer.parent_ids.tolist()))
        step = max(
            [
                self._last_enter + 1,
                self._last_verify + 1,
                *(p + 1 for p in parents if p is not None),
            ]
        )
        self._last_enter = step
        self._node_step.update(dict.fromkeys(layer.node_ids.tolist(), step))
        return step

    def _root_due(self, root_id: int) -> int:
        """Lockstep step at which the root's logits leave the last stage."""
        entered = self._node_step.get(root_id, self._last_verify + 1)
        return max(entered + self.num_stages - 1, self._last_verify + 1)

    def _verified(self, root_id: int) -> None:
        self._last_verify = self._root_due(root_id)
        self.stats.decode_steps = self._last_verify + 1
        self.stats.verifications += 1

    def _forget_nodes(self, live_ids: Sequence[int]) -> None:
        """Keep step accounting only for nodes still in the tree (bounded memory)."""
        self._node_step = {i: self._node_step[i] for i in live_ids if i in self._node_step}

    def _prune(self, prune: Prune, draft_prune: Prune | None = None) -> list[Command]:
        self._prunes += 1
        cmds: list[Command] = [BroadcastPrune(prune, self._prunes)]
        if self.uses_draft:
            cmds.append(DraftPrune(draft_prune or prune, self._prunes))
        return cmds

    def _emit(self, tokens: list[int], done: bool) -> list[Command]:
        """Record verified tokens (already added to `out`); finish when done."""
        st = self.stats
        st.new_tokens += len(tokens)
        st.emit_steps += [st.decode_steps] * len(tokens)
        st.hits = self.out.hits
        st.finish_reason = self.out.finish_reason
        cmds: list[Command] = [Emit(tokens)]
        if done:
            self.done = True
            cmds.append(Finish(self.out.finish_reason))
        return cmds


def make_controller(
    mode: Mode | str,
    request_id: str,
    prompt: Sequence[int],
    opts: DecodeOptions,
    num_stages: int,
) -> Controller:
    """The controller of `mode` for a pipeline of `num_stages` stages.

    autoregressive is plain decoding of the target, one token per forward of the whole
    model: the pp controller with one stage in its accounting, whatever pipeline the
    executor runs it on (the tokens are the same)."""
    from .specinfer import SpecInferController
    from .specpipe import SpecPipeController

    mode = Mode(mode)
    if mode == Mode.SPECINFER:
        return SpecInferController(request_id, prompt, mode, opts, num_stages)
    stages = 1 if mode == Mode.AUTOREGRESSIVE else num_stages
    return SpecPipeController(request_id, prompt, mode, opts, stages)
