"""The request controller: every decision of one request, as a state machine with no I/O
(docs/architecture.md, "5. The request controller and its executors").

Events in: the tokens the last stage verified (`on_verified`: it draws them and walks
down the tree itself, `common/runtime/verifier.py`), the draft's candidates for a layer it
was asked to expand (`on_candidates`), a failure (`on_failure`). Commands out (`commands.py`): feed rows to stage 1, broadcast a prune,
open/prefill/prune the draft and ask it to propose, emit tokens, finish. The controller
owns the statistics and the step accounting: the pipeline step at which every feed
enters stage 1 and every verification happens, had the stages run in lockstep. The
in-process executor runs exactly those steps; the network executor runs asynchronously
and reports the same figures whenever the draft keeps up.

Subclasses: `SpecPipeController` (specpipe, pp, autoregressive) and
`SpecInferController`; `make_controller` picks one for a mode. One module: what every
mode shares (events, faults, token sources, step accounting, emitting), so that the
modes' own files hold only how each grows and verifies its tree.

Token sources (`DecodeOptions.token_source`): the draft model (a draft service:
`Propose` commands, answered by `on_candidates`), the n-gram source (`ngram.py`: no
model, no draft service; the controller answers its own asks at once, as a draft that
keeps up would be answered in lockstep), or both merged into one layer (hybrid: the
n-gram proposals for a layer wait beside its `Propose` and join the draft's answer).

Structured output: with a grammar (`DecodeOptions.grammar`), `_extend` grows only the
children it allows after their paths (the last stage draws under its own copy).

It is one module, the base every mode's controller extends: the step accounting, the
prefill, prunes, emission and the token sources are one state machine's parts.

Faults (docs/architecture.md, "5. The request controller and its executors"): when a
replica on the request's path is lost, `replay` re-opens the request on a fresh path
from the tokens verified so far; when only the draft is lost, `drop_draft` continues
without it (with the n-gram source alone in hybrid, else width 0, as pp). Because every
token is drawn from (seed, position), the continuation is the one the request would
have had.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence

from .commands import (
    BroadcastPrune,
    Command,
    DraftOpen,
    DraftPrune,
    Emit,
    Feed,
    Finish,
    Propose,
)
from .growth import (
    EMPTY_POOL,
    ListPool,
    Pool,
    allowed_by_grammar,
    array_pool,
    beside,
    candidates_of,
    concat_pools,
    extend_frontier,
    grow_frontier,
    pool_of,
    prefill_chunks,
    with_forced_tokens,
)
from .messages import (
    SOURCE_DRAFT,
    SOURCE_GRAMMAR,
    SOURCE_NGRAM,
    Candidates,
    PruneArrays,
    RowArrays,
    TokenLogprobs,
    Verified,
)
from .ngram import NgramIndex, ngram_candidates
from .options import DecodeOptions, Mode, tree_capacity
from .output import OutputState
from .penalties import GrowthRules
from .stats import DecodeStats
from .tree import Indices, TokenTree
from .verify import VerifySpec


def needs_draft(mode: Mode, opts: DecodeOptions) -> bool:
    """Whether a request's path holds a draft replica (the one statement of the rule)."""
    return mode.uses_draft and opts.token_source.uses_model


class Controller(ABC):
    """One request's decisions. `num_stages` is the pipeline depth the accounting uses."""

    tree: TokenTree  # the request's token tree (the modes make it)
    root_pos: int  # the root's sequence position (the modes keep it)

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
        source = opts.token_source
        self._uses_draft = needs_draft(mode, opts)  # the draft model, until it is dropped
        # n-gram lookup over prompt + output (costs nothing, is never lost)
        self.ngram = NgramIndex(self.prompt) if mode.uses_draft and source.uses_ngram else None
        self._local: dict[int, Candidates] = {}  # hybrid: n-gram proposals by ticket
        # specpipe: tree layers entering stage 1 per step
        self.layers_per_step = opts.layers_per_step if mode == Mode.SPECPIPE else 1
        self.out = OutputState(
            opts.max_new_tokens, opts.sampling, opts.stop_token_ids, prompt_top=opts.prompt_logprobs
        )
        # structured output: the grammar after the emitted tokens, which prunes the
        # tree's growth (the last stage holds its own for the draws)
        self._grammar = opts.grammar.state() if opts.grammar is not None else None
        # the logits rules as the tree's growth ranks with them (`penalties.py`)
        self._growth_rules = GrowthRules.of(
            opts.sampling, self.prompt, opts.min_tokens, opts.stop_token_ids
        )
        self.width = opts.width if self.grows_tree else 0  # tree nodes per layer, for now
        self.stats = DecodeStats(
            mode=mode.value,
            stages=num_stages,
            width=self.width,
            layers_per_step=self.layers_per_step,
            token_source=source.value if mode.uses_draft else "",
        )
        self.done = False
        self._feeds = 0  # feeds created
        self._prunes = 0  # prunes broadcast
        self._tickets = itertools.count()
        # Step accounting: lockstep step at which each live node entered stage 1.
        self._node_step: dict[int, int] = {}
        self._last_enter = -1
        self._last_verify = -1
        # Set by the executor after each (re)open: how many leading tokens of
        # `committed_before_root` every stage of the path holds cached (the prefix
        # cache); the prefill starts there.
        self.cached_prefix = 0

    # -- what executors ask --------------------------------------------------------------
    @property
    def uses_draft(self) -> bool:
        """Whether the request still uses a draft (False once `drop_draft` was called)."""
        return self._uses_draft

    @property
    def tree_rows(self) -> int:
        """The most tree rows in flight (the most the last stage holds for the request)."""
        return tree_capacity(self.mode, self.num_stages, self.opts)

    @property
    def grows_tree(self) -> bool:
        """Whether some token source still proposes children (a draft, or n-grams)."""
        return self._uses_draft or self.ngram is not None

    @property
    def capacity(self) -> int:
        """Cache rows a stage (or the draft) needs for this request."""
        return len(self.prompt) + self.opts.max_new_tokens + self.tree_rows

    @property
    def verify_spec(self) -> VerifySpec:
        """What the last stage needs to draw this request's tokens (`Open`, and again at
        every replay: the draws depend on (seed, position) only; prompt logprobs while
        due; a grammar's state on the tokens emitted so far)."""
        opts, due = self.opts, self.out.prompt_logprobs_due
        g = opts.grammar
        consumed = tuple(self.out.tokens) if g is not None else ()
        return VerifySpec(
            opts.sampling,
            len(self.prompt),
            opts.logprobs,
            prompt_logprobs=due,
            grammar=g,
            grammar_consumed=consumed,
            min_tokens=opts.min_tokens,
            stop_token_ids=opts.stop_token_ids if opts.min_tokens else (),
        )

    @property
    def committed_before_root(self) -> list[int]:
        """The tokens a (re)opened path commits before the tree's root: the prompt and
        the tokens emitted so far, but the last (the root). Stages and the draft look
        their prefix up in their prefix caches at open."""
        return [*self.prompt, *self.out.tokens][:-1]

    def _prefill_start(self, seq: Sequence[int]) -> int:
        """Where the prefill of `seq` starts: after the cached prefix (at most all but
        the root); at 0 while prompt logprobs are due (cached rows were never computed)."""
        if self.out.prompt_logprobs_due is not None:
            return 0
        return max(0, min(int(self.cached_prefix), len(seq) - 1))

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens this path does not prefill: they are in its prefix cache."""
        return self._prefill_start(self.prompt)

    @property
    def fills_pipeline(self) -> bool:
        """Whether the request keeps an activation at every stage, one per step (specpipe
        with a token source); pp and specinfer have one in the whole pipeline. Stages
        align such requests' phases more eagerly (common/runtime/alignment.py)."""
        return self.mode == Mode.SPECPIPE and self.grows_tree

    @property
    def tokens(self) -> list[int]:
        return self.out.tokens

    @property
    def max_width(self) -> int:
        """The width the request asked for (its caches are sized for it)."""
        return self.opts.width if self.grows_tree else 0

    def set_width(self, width: int) -> None:
        """Tree nodes per layer from the next growth on (elastic width under load);
        between 1 and the width asked for. Tokens do not depend on it."""
        if self.grows_tree:
            self.width = max(1, min(int(width), self.max_width))

    def rows_in_flight(self) -> int:
        """Tree rows the pipeline holds for this request now (executors weigh replicas'
        load by it)."""
        return 0

    def draft_is_late_for(self, v: Verified) -> bool:
        """Whether accepting this verification now would pass by a draft answer that
        lockstep would have had by then (an executor may hold it a while: the late-draft
        wait)."""
        return False

    # -- events ----------------------------------------------------------------------------
    def start(self) -> list[Command]:
        """The request's first commands: prefill, the draft's prompt, the first root; for
        a resumed request (`resume`), the re-open at its output so far, as a replay's."""
        if not self.out.tokens:
            return self._start()
        if self.out.finished:  # the client had every token but the end of the stream
            self.done = True
            self.stats.finish_reason = self.out.finish_reason
            return [Finish(self.out.finish_reason)]
        return self._reopen(None)

    @abstractmethod
    def _start(self) -> list[Command]:
        """A fresh request's first commands: prefill, the draft's prompt, the first root."""

    def resume(self, tokens: Sequence[int]) -> None:
        """Before `start`: the client already holds `tokens`, the output's first tokens
        (from a router that died mid-request). They become the output as if emitted
        here, and `start` re-opens the request at them as `replay` does after a fault (a
        resume is a replay whose emitted tokens came from the client): prefill of prompt
        + tokens, the root at the last one, so the next draw is at output position
        len(tokens) and, by (seed, position), the one the first router would have made.
        The n-gram source and the grammar consume them; `stats.resumed_tokens` counts
        them (`new_tokens` counts those drawn here)."""
        tokens = [int(t) for t in tokens]
        if self.out.tokens or self._feeds:
            raise RuntimeError("resume() must come before start()")
        if not tokens:
            return
        self.out.resume(tokens)
        if self.ngram is not None:
            self.ngram.extend(tokens)
        if self._grammar is not None and not self._grammar.follows(tokens):
            self._grammar = None  # the router's tokenizer disagrees: stop pruning with it
        self.stats.resumed_tokens = len(tokens)

    @abstractmethod
    def on_verified(self, v: Verified) -> list[Command]:
        """The last stage drew tokens along the tree (`Verified`); a verification that is
        not of the current root (a stale one) changes nothing."""

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
            self._lose_draft()  # the old path's work is dropped below: nothing to go on with
        elif uses_draft and needs_draft(self.mode, self.opts):
            self._uses_draft = True  # a draft again (one dropped before is replaced)
        self.stats.replays += 1
        return self._reopen(max(self._last_enter, self._last_verify) + 1)

    def _reopen(self, start: int | None) -> list[Command]:
        """Open the request on a fresh path at its output so far (a replay, a resume):
        the prefill chunks of prompt + output (all but the root), a `DraftOpen` of the
        whole sequence when the path has a draft, the root's feed. `start`: the step the
        first chunk enters (a replay: after the old path's last); None: a resume, whose
        chunks are the request's prefill (before step 0, as `_prefill`'s)."""
        seq = [*self.prompt, *self.out.tokens]
        self._feeds = self._prunes = 0
        self._node_step = {}
        chunks = prefill_chunks(
            self.request_id,
            seq,
            self.opts.prefill_chunk,
            self._prefill_start(seq),
            self.opts.prefill_cells,
        )
        if start is None:
            start = -len(chunks)
            self.stats.prefill_steps = len(chunks)
        cmds: list[Command] = []
        if self.uses_draft:
            cmds.append(DraftOpen(seq, self.capacity, self.opts.prefill_chunk))
        cmds += [self._feed(c, start + i) for i, c in enumerate(chunks)]
        self._last_enter = max(self._last_enter, start + len(chunks) - 1)
        return cmds + self._restart_at(seq)

    def drop_draft(self) -> list[Command]:
        """The draft is lost and the stages are not: go on without it from now on (with
        the n-gram source alone in hybrid, else width 0, as pp); what is in the pipeline
        is verified as usual. `stats.draft_drops` counts it."""
        if self.done or not self._uses_draft:
            return []
        self._lose_draft()
        return self._without_draft()

    def _lose_draft(self) -> None:
        self._uses_draft = False
        self._local = {}
        self.stats.draft_drops += 1

    @abstractmethod
    def _restart_at(self, seq: list[int]) -> list[Command]:
        """Replay: a fresh tree rooted at `seq[-1]` (position len(seq) - 1), the commands
        that put that root into the pipeline."""

    @abstractmethod
    def _without_draft(self) -> list[Command]:
        """Forget the draft's outstanding work; commands needed to go on without it."""

    def _desynchronized(self, v: Verified, why: str) -> list[Command]:
        """A verification the tree cannot have given (a bug, never a race): fail."""
        return self.on_failure(
            f"the last stage's verification of nodes {list(v.node_ids)} disagrees with the "
            f"request's tree: {why}"
        )

    def _logprobs_of(self, v: Verified, i: int) -> TokenLogprobs | None:
        if i == 0:  # an accepted verification: the first brings the prompt's (when asked)
            self.out.take_prompt_logprobs(v.prompt_logprobs, len(self.prompt))
        return None if v.logprobs is None else v.logprobs[i]

    def on_failure(self, message: str) -> list[Command]:
        """A stage or the draft failed the request."""
        if self.done:
            return []
        self.done = True
        self.stats.finish_reason = "error"
        return [Finish("error", message)]

    # -- token sources ---------------------------------------------------------------------
    @abstractmethod
    def _asked_for(self, ticket: int, step: int | None) -> None:
        """Record an ask (before any answer to it can come)."""

    def _ask(self, layer: RowArrays, nodes: Indices, step: int | None) -> list[Command]:
        """Ask the token sources for the children of `layer` (tree nodes `nodes`): a
        `Propose` to the draft (with the n-gram proposals kept for its answer, hybrid),
        or the n-gram source's answer at once."""
        ticket = next(self._tickets)
        self._asked_for(ticket, step)
        top_k = min(self.opts.top_k_children, max(self.width, 1))
        local = self._ngram_children(nodes, top_k)
        if not self.uses_draft:
            return self.on_candidates(ticket, local)
        if len(local):
            self._local[ticket] = local
        return [Propose(layer, top_k, self.opts.sampling.temperature, ticket, step)]

    def _answer(self, ticket: int, cand: Candidates) -> Pool:
        """The draft's answer to `ticket` joined by the n-gram proposals for that layer,
        which share what the draft's best proposal leaves (`growth.beside`)."""
        local = self._local.pop(ticket, None)
        pool = pool_of(cand)
        return pool if local is None else concat_pools(pool, beside(pool_of(local), pool))

    def _ngram_children(self, nodes: Indices, top_k: int | None = None) -> Candidates:
        """The n-gram source's children of tree nodes `nodes` (none without the source)."""
        if self.ngram is None or len(nodes) == 0:
            return candidates_of(EMPTY_POOL)
        k = top_k or min(self.opts.top_k_children, max(self.width, 1))
        # the index holds the verified text (prompt + output): no copy of it per ask
        return ngram_candidates(self.ngram, self.ngram.tokens, self.tree, nodes, k)

    def _extend(self, pool: Pool) -> Indices:
        """Grow the tree's frontier from the candidates `pool` under the request's
        ranking; with a grammar, only from the candidates it allows after their paths
        (the one place both executors' growth goes through), and where it allows one
        token only, that token whatever the sources proposed (`opts.forced_tokens`)."""
        opts = self.opts
        if self._grammar is not None or self._growth_rules is not None:
            cand = candidates_of(pool)
            if self._grammar is not None:
                cand = allowed_by_grammar(self.tree, cand, self._grammar)
                if opts.forced_tokens:
                    cand = with_forced_tokens(self.tree, cand, self._grammar)
            if self._growth_rules is not None:
                cand = self._growth_rules.apply(self.tree, cand)
            pool = pool_of(cand)
        return extend_frontier(self.tree, pool, self.width, opts.ranking, opts.sampling)

    def _extend_lists(self, pool: ListPool) -> tuple[int, int]:
        """`_extend` of a pool of lists (float32 probabilities: `growth.pool_lists`):
        (the first new node's index, how many). Without a grammar or logits rules, the
        growth stays on lists (the router's step: `growth.grow_frontier`)."""
        if self._grammar is not None or self._growth_rules is not None:
            new = self._extend(array_pool(pool))
            return (int(new[0]), int(new.size)) if new.size else (len(self.tree), 0)
        opts = self.opts
        return grow_frontier(self.tree, pool, self.width, opts.ranking, opts.sampling)

    def _count_hit(self, source: int) -> None:
        """A verified token was a tree node proposed by `source` (bits)."""
        if source & SOURCE_DRAFT:
            self.stats.draft_hits += 1
        if source & SOURCE_NGRAM:
            self.stats.ngram_hits += 1
        if source & SOURCE_GRAMMAR:
            self.stats.forced_hits += 1

    # -- helpers for the modes -------------------------------------------------------------
    def _prefill(self) -> list[Command]:
        """Verified prompt tokens (all but the last, the first root) into stage 1, one chunk
        per step before step 0; the draft caches the prompt at the same time."""
        chunks = prefill_chunks(
            self.request_id,
            self.prompt,
            self.opts.prefill_chunk,
            self._prefill_start(self.prompt),
            self.opts.prefill_cells,
        )
        self.stats.prefill_steps = len(chunks)
        cmds: list[Command] = []
        if self.uses_draft:
            cmds.append(DraftOpen(self.prompt, self.capacity, self.opts.prefill_chunk))
        cmds += [self._feed(c, i - len(chunks)) for i, c in enumerate(chunks)]
        return cmds

    def _feed(self, rows: RowArrays, step: int) -> Feed:
        feed = Feed(rows, self._feeds, self._prunes, step)
        self._feeds += 1
        return feed

    def _entry_step(self, layer: RowArrays) -> int:
        """Lockstep step at which `layer` enters stage 1: after the previous layer, after
        the last verification (it was decided after it) and after its parents' layer."""
        entered = self._node_step
        step = max(self._last_enter, self._last_verify) + 1
        for p in set(layer.parent_ids.tolist()):
            s = entered.get(p)
            if s is not None and s >= step:
                step = s + 1
        self._last_enter = step
        entered.update(dict.fromkeys(layer.node_ids.tolist(), step))
        return step

    def _root_due(self, root_id: int) -> int:
        """Lockstep step at which the root's logits leave the last stage (a root not fed
        yet enters at the earliest step it can)."""
        entered = self._node_step.get(root_id, max(self._last_enter, self._last_verify) + 1)
        return max(entered + self.num_stages - 1, self._last_verify + 1)

    def _verified(self, root_id: int) -> None:
        self._last_verify = self._root_due(root_id)
        self.stats.decode_steps = self._last_verify + 1
        self.stats.verifications += 1

    def _forget_nodes(self, live_ids: Sequence[int]) -> None:
        """Keep step accounting only for nodes still in the tree (bounded memory)."""
        self._node_step = {i: self._node_step[i] for i in live_ids if i in self._node_step}

    def _prune(self, prune: PruneArrays, draft_prune: PruneArrays | None = None) -> list[Command]:
        self._prunes += 1
        cmds: list[Command] = [BroadcastPrune(prune, self._prunes)]
        if self.uses_draft:
            cmds.append(DraftPrune(draft_prune or prune, self._prunes))
        return cmds

    def _emit(
        self,
        tokens: list[int],
        done: bool,
        logprobs: list[TokenLogprobs | None] | None = None,
    ) -> list[Command]:
        """Record verified tokens (already added to `out`); finish when done."""
        st = self.stats
        if self.ngram is not None:
            self.ngram.extend(tokens)
        if self._grammar is not None and not self._grammar.follows(tokens):
            self._grammar = None  # the router's tokenizer disagrees: stop pruning with it
        if self._growth_rules is not None:
            self._growth_rules.emitted(tokens)
        st.new_tokens += len(tokens)
        st.emit_steps += [st.decode_steps] * len(tokens)
        st.hits = self.out.hits
        st.finish_reason = self.out.finish_reason
        lp = None
        if logprobs is not None and self.opts.logprobs is not None:
            lp = [x for x in logprobs if x is not None]
            lp = lp if len(lp) == len(tokens) else None
        cmds: list[Command] = [Emit(tokens, lp)]
        if self.out.prompt_logprobs_due is not None:  # the first verification brought none
            return cmds + self.on_failure("the last stage did not report the prompt logprobs")
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
