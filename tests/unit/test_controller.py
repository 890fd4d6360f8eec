"""The request controller without a model: scripted events in, commands out; and the
lockstep executor over a model-free pipeline whose target and draft are rules on tokens.

The target's next token after a sequence is `rule(seq)`; a stage computes nothing, the
last one gives every tree row a one-hot of the rule's token as its final hidden state
and verifies them as the real last stage does (`IdentityHeadStage`: the real verifier
with an identity LM head). The oracle draft proposes the rule's token first; the blind
draft never does.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.runtime.pipeline import StepResult
from specpipe.common.runtime.scripted import IdentityHeadStage
from specpipe.common.spec.commands import (
    BroadcastPrune,
    DraftOpen,
    DraftPrefill,
    DraftPrune,
    Emit,
    Feed,
    Finish,
    Propose,
)
from specpipe.common.spec.controller import make_controller
from specpipe.common.spec.messages import Activation, Candidates, Prune, Verified, after_prunes
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.sampling import SamplingParams

VOCAB = 50
PROMPT = [3, 14, 15, 9, 2, 6]


def rule(seq: Sequence[int]) -> int:
    """The target: a deterministic next token with long-range dependence."""
    return (7 * seq[-1] + 3 * len(seq) + (seq[-2] if len(seq) > 1 else 0)) % VOCAB


def one_hot(token: int) -> torch.Tensor:
    x = torch.zeros(VOCAB)
    x[token] = 20.0
    return x


def plain_decoding(prompt: list[int], n: int, rule=rule) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(rule(seq))
    return seq[len(prompt) :]


class RuleRequest:
    """Tokens a request's stages know: committed ones, and tree nodes (id -> token, parent)."""

    def __init__(self) -> None:
        self.committed: list[int] = []
        self.nodes: dict[int, tuple[int, int]] = {}

    def path(self, node: int) -> list[int]:
        out = []
        while node >= 0 and node in self.nodes:
            token, node = self.nodes[node]
            out.append(token)
        return self.committed + out[::-1]

    def add(self, act: Activation) -> None:
        assert act.tokens is not None
        if act.committed:
            self.committed += act.tokens.tolist()
            return
        for nid, pid, tok in zip(
            act.node_ids.tolist(), act.parent_ids.tolist(), act.tokens.tolist(), strict=True
        ):
            self.nodes[nid] = (tok, pid)

    def prune(self, p: Prune) -> None:
        for nid in p.commit_ids.tolist():
            self.committed.append(self.nodes[nid][0])
        keep = set(p.keep_ids.tolist())
        self.nodes = {i: v for i, v in self.nodes.items() if i in keep or i > p.horizon}


class RulePipeline:
    """S stages that pass rows along; the last verifies the rule's one-hot rows."""

    def __init__(self, num_stages: int, rule=rule) -> None:
        self.num_stages, self.vocab_size, self.max_context = num_stages, VOCAB, 10_000
        self.rule = rule
        self.requests: dict[str, RuleRequest] = {}
        self.flight: dict[str, list[Activation | None]] = {}
        self.last = IdentityHeadStage()

    def open(self, request_id: str, capacity: int, prefix_tokens, verify) -> int:
        self.requests[request_id] = RuleRequest()
        self.flight[request_id] = [None] * self.num_stages
        self.last.open(request_id, verify, prefix_tokens)
        return 0  # no prefix cache

    def open_for(self, c) -> None:
        """Open controller `c`'s request, as an executor does."""
        self.open(c.request_id, c.capacity, c.committed_before_root, c.verify_spec)

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.flight.pop(request_id, None)
        self.last.release(request_id)

    def in_flight(self, request_id: str) -> bool:
        return any(a is not None for a in self.flight[request_id][:-1])

    def step_many(self, inputs) -> dict[str, StepResult]:
        return {rid: self.step(rid, *args) for rid, args in inputs.items()}

    def step(self, request_id, prunes, entering) -> StepResult:
        req, flight = self.requests[request_id], self.flight[request_id]
        for p in prunes:
            req.prune(p)
            self.last.prune(request_id, p)
            flight = [p.filter(a) for a in flight]
            entering = p.filter(entering)  # as a stage drops rows its last prune rules out
        flight = [entering, *flight[:-1]]
        self.flight[request_id] = flight
        if entering is not None:
            req.add(entering)
        last = flight[-1]
        verified: tuple[Verified, ...] = ()
        if last is not None and not last.committed:
            out = Activation(request_id, last.positions, node_ids=last.node_ids,
                             parent_ids=last.parent_ids, hidden=self.rows(req, last),
                             row_tokens=last.tokens)  # fmt: skip
            verified = self.last.verify({request_id: out})[request_id]
        return StepResult([len(a) if a is not None else 0 for a in flight], verified)

    def rows(self, req: RuleRequest, act: Activation) -> torch.Tensor:
        """The last stage's final hidden states of `act`'s tree rows (their logits)."""
        return torch.stack([one_hot(self.rule(req.path(n))) for n in act.node_ids.tolist()])


class RuleDraft:
    """Proposes `k` children per node: the rule's token first (oracle) or never (blind)."""

    def __init__(self, oracle: bool = True, rule=rule) -> None:
        self.oracle, self.rule = oracle, rule
        self.requests: dict[str, RuleRequest] = {}

    def open(self, request_id: str, capacity: int, prompt=()) -> int:
        self.requests[request_id] = RuleRequest()
        return 0  # no prefix cache

    def release(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def prefill(self, request_id, tokens, start_position, chunk_size) -> None:
        req = self.requests[request_id]
        assert start_position == len(req.committed)
        req.committed += tokens.tolist()

    def prune(self, request_id: str, prune: Prune) -> None:
        self.requests[request_id].prune(prune)

    def propose(self, layer: Activation, top_k: int, temperature: float = 0.0) -> Candidates:
        req = self.requests[layer.request_id]
        req.add(layer)
        parents, tokens, probs = [], [], []
        for nid in layer.node_ids.tolist():
            best = self.rule(req.path(nid))
            picks = [best] if self.oracle else []
            picks += [t for t in range(VOCAB) if t != best][: top_k - len(picks)]
            for rank, t in enumerate(picks):
                parents.append(nid)
                tokens.append(t)
                probs.append(0.9 if rank == 0 else 0.1 / top_k)
        return Candidates(torch.tensor(parents), torch.tensor(tokens), torch.tensor(probs))


class SoftRulePipeline(RulePipeline):
    """The rule's logits softened (with a tilt): a sampled draw really depends on the seed."""

    def rows(self, req: RuleRequest, act: Activation) -> torch.Tensor:
        return super().rows(req, act) / 8 + torch.arange(VOCAB) / VOCAB


def run(mode, stages, draft=None, n=24, prompt=PROMPT, **opts) -> LockstepGeneration:
    gen = LockstepGeneration(RulePipeline(stages), draft, prompt, mode, DecodeOptions(n, **opts))
    gen.run()
    return gen


# -- whole requests through the lockstep executor --------------------------------------


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("oracle", [True, False])
def test_every_mode_emits_plain_decoding(mode, stages, oracle) -> None:
    gen = run(mode, stages, RuleDraft(oracle), width=3, prefill_chunk=4)
    assert gen.output == plain_decoding(PROMPT, 24)
    assert gen.stats.new_tokens == 24 and gen.stats.finish_reason == "length"


def test_pp_takes_one_pass_per_token_and_autoregressive_one_step() -> None:
    pp = run(Mode.PP, 4)
    assert pp.stats.decode_steps == 4 * 24 and pp.stats.stages == 4
    ar = run(Mode.AUTOREGRESSIVE, 4)
    assert ar.stats.decode_steps == 24 and ar.stats.stages == 1
    assert ar.output == pp.output


def test_oracle_draft_emits_one_token_per_step_after_the_pipeline_fills() -> None:
    gen = run(Mode.SPECPIPE, 4, RuleDraft(oracle=True), n=40, width=2)
    st = gen.stats
    assert st.hits == st.new_tokens  # every token was in the tree when verified
    assert st.decode_steps == 40 + 3  # S - 1 steps to fill, then one token per step
    assert st.regrowths == 0


def test_blind_draft_misses_every_token() -> None:
    gen = run(Mode.SPECPIPE, 3, RuleDraft(oracle=False), n=10, width=2)
    assert gen.stats.hits == 0 and gen.stats.decode_steps == 3 * 10


def test_specinfer_accepts_the_whole_depth_plus_one() -> None:
    gen = run(Mode.SPECINFER, 3, RuleDraft(oracle=True), n=20, width=2, depth=4)
    assert gen.stats.accepted_lengths == [5, 5, 5, 5]
    assert gen.stats.decode_steps == 3 * 4
    assert gen.stats.draft_layers == [[1, 2, 2, 2]] * 4  # the root, then `width` nodes a layer


def test_stops_at_a_stop_token() -> None:
    full = plain_decoding(PROMPT, 24)
    stop = full[7]
    for mode in Mode:
        gen = run(mode, 3, RuleDraft(), stop_token_ids=(stop,))
        assert gen.output == full[: full.index(stop) + 1]
        assert gen.stats.finish_reason == "stop"


def test_seeded_sampling_is_the_same_in_every_mode() -> None:
    """With soft logits the draw matters; it depends only on (seed, position)."""
    outs = set()
    for mode in Mode:
        for stages in (1, 3):
            opts = DecodeOptions(20, SamplingParams(temperature=1.0, seed=5), width=3)
            gen = LockstepGeneration(SoftRulePipeline(stages), RuleDraft(), PROMPT, mode, opts)
            outs.add(tuple(gen.run()))
    assert len(outs) == 1


# -- the controller alone, events scripted ----------------------------------------------


def cmds_of(cmds, kind):
    return [c for c in cmds if isinstance(c, kind)]


def verified(c, nodes: list[int], tokens: list[int]) -> Verified:
    """What the last stage verified of `c`'s tree: the nodes drawn at, root first, and
    the token drawn at each."""
    return Verified(c.request_id, tuple(nodes), tuple(tokens), c.root_pos)


def cand(pairs: list[tuple[int, int, float]]) -> Candidates:
    p, t, q = zip(*pairs, strict=True)
    return Candidates(torch.tensor(p), torch.tensor(t), torch.tensor(q))


def test_pp_controller_script() -> None:
    c = make_controller(Mode.PP, "r", [5, 6, 7], DecodeOptions(2, prefill_chunk=1), 3)
    start = c.start()
    feeds = cmds_of(start, Feed)
    assert [f.step for f in feeds] == [-2, -1, 0] and not cmds_of(start, Propose)
    assert c.capacity == 3 + 2 + 2
    out = c.on_verified(verified(c, [0], [11]))
    assert cmds_of(out, Emit)[0].tokens == [11]
    prune = cmds_of(out, BroadcastPrune)[0]
    assert (
        prune.seq == 1
        and prune.prune.commit_ids.tolist() == [0]
        and not prune.prune.keep_ids.numel()
    )
    (restart,) = cmds_of(out, Feed)
    assert restart.step == 3 and restart.after_prune == 1 and restart.act.tokens.tolist() == [11]
    out = c.on_verified(verified(c, [1], [12]))
    assert isinstance(out[-1], Finish) and out[-1].reason == "length"
    assert c.stats.decode_steps == 6 and c.tokens == [11, 12]
    assert c.on_verified(verified(c, [2], [13])) == []  # done: later events change nothing


def _specpipe(stages=2, width=2, n=8):
    c = make_controller(Mode.SPECPIPE, "r", [5, 6], DecodeOptions(n, width=width), stages)
    start = c.start()
    assert isinstance(start[0], DraftOpen) and start[0].prompt == [5, 6]
    return c, cmds_of(start, Propose)[0]


def test_specpipe_holds_the_draft_answer_until_the_verification_due_first() -> None:
    c, p0 = _specpipe()
    out = c.on_candidates(p0.ticket, cand([(0, 7, 0.6), (0, 8, 0.4)]))
    (l1,) = cmds_of(out, Feed)
    assert l1.step == 1 and l1.act.node_ids.tolist() == [1, 2]
    p1 = cmds_of(out, Propose)[0]
    # Children of both layer-1 nodes; the root's verification is due at step 1 = l1.step.
    assert c.on_candidates(p1.ticket, cand([(1, 9, 0.9), (2, 10, 0.9)])) == []
    out = c.on_verified(verified(c, [0], [7]))  # hit on node 1 (token 7)
    assert cmds_of(out, Emit)[0].tokens == [7]
    assert cmds_of(out, BroadcastPrune)[0].prune.keep_ids.tolist() == [1]
    assert cmds_of(out, DraftPrune)[0].seq == 1
    (l2,) = cmds_of(out, Feed)
    # Grown after the prune, from node 1's children only: the width is not wasted.
    assert l2.step == 2 and l2.act.tokens.tolist() == [9] and l2.after_prune == 1
    assert c.stats.hits == 1 and c.stats.decode_steps == 2


def test_a_late_draft_answer_gives_the_same_decision() -> None:
    c, p0 = _specpipe()
    out = c.on_candidates(p0.ticket, cand([(0, 7, 0.6), (0, 8, 0.4)]))
    p1 = cmds_of(out, Propose)[0]
    out = c.on_verified(verified(c, [0], [7]))  # verification before the draft answered
    assert not cmds_of(out, Feed)  # the newest layer survived: wait for its children
    (l2,) = cmds_of(c.on_candidates(p1.ticket, cand([(1, 9, 0.9), (2, 10, 0.9)])), Feed)
    assert l2.step == 2 and l2.act.tokens.tolist() == [9]


def test_an_answer_outstanding_at_a_later_verification_is_counted_late() -> None:
    c, p0 = _specpipe()
    p1 = cmds_of(c.on_candidates(p0.ticket, cand([(0, 7, 0.6), (0, 8, 0.4)])), Propose)[0]
    c.on_verified(verified(c, [0], [7]))  # step 1: the answer for layer 1 may still come in time
    assert c.stats.late_draft_answers == 0
    out = c.on_verified(verified(c, [1], [9]))  # step 2: node 1 has no children yet, a miss
    assert c.stats.late_draft_answers == 1 and c.stats.hits == 1
    assert cmds_of(out, Feed)[0].act.tokens.tolist() == [9]  # restart
    assert c.on_candidates(p1.ticket, cand([(1, 9, 0.9)])) == []  # too late to use
    assert c.stats.late_draft_answers == 1


def test_miss_restarts_from_the_drawn_token() -> None:
    c, p0 = _specpipe()
    c.on_candidates(p0.ticket, cand([(0, 7, 0.6), (0, 8, 0.4)]))
    out = c.on_verified(verified(c, [0], [30]))
    prune = cmds_of(out, BroadcastPrune)[0].prune
    assert prune.keep_ids.numel() == 0 and prune.horizon == 2
    (restart,) = cmds_of(out, Feed)
    assert restart.act.tokens.tolist() == [30] and restart.act.node_ids.tolist() == [3]
    assert restart.step == 2 and c.stats.hits == 0


def test_regrowth_from_kept_proposals_when_the_newest_layer_is_pruned_away() -> None:
    c, p0 = _specpipe(stages=3, width=2)
    p1 = cmds_of(c.on_candidates(p0.ticket, cand([(0, 7, 0.5), (0, 8, 0.5)])), Propose)[0]
    # Layer 2 is all under node 1 (token 7); node 2's proposals are kept in reserve.
    kids = cand([(1, 20, 0.9), (1, 21, 0.9), (2, 30, 0.1), (2, 31, 0.1)])
    out = c.on_candidates(p1.ticket, kids)
    assert sorted(cmds_of(out, Feed)[0].act.tokens.tolist()) == [20, 21]
    p2 = cmds_of(out, Propose)[0]
    assert c.on_candidates(p2.ticket, cand([(3, 40, 0.9), (4, 41, 0.9)])) == []  # held
    out = c.on_verified(verified(c, [0], [8]))  # hit on node 2: layer 2 is pruned away
    assert cmds_of(out, BroadcastPrune)[0].prune.keep_ids.tolist() == [2]
    (regrown,) = cmds_of(out, Feed)
    assert sorted(regrown.act.tokens.tolist()) == [30, 31] and regrown.step == 3
    assert c.stats.regrowths == 1


def test_specinfer_controller_script() -> None:
    c = make_controller(Mode.SPECINFER, "r", [5, 6], DecodeOptions(4, width=2, depth=2), 3)
    p = cmds_of(c.start(), Propose)[0]
    assert p.step is None and p.layer.node_ids.tolist() == [0]
    p = cmds_of(c.on_candidates(p.ticket, cand([(0, 7, 0.9), (0, 8, 0.1)])), Propose)[0]
    (feed,) = cmds_of(c.on_candidates(p.ticket, cand([(1, 9, 0.9), (2, 10, 0.9)])), Feed)
    assert feed.step == 0 and feed.act.node_ids.tolist() == [0, 1, 2, 3, 4]
    out = c.on_verified(verified(c, [0, 1, 3], [7, 9, 42]))
    assert cmds_of(out, Emit)[0].tokens == [7, 9, 42]  # root -> 7 -> 9, then the bonus token
    assert c.stats.accepted_lengths == [3] and c.stats.decode_steps == 3
    draft_prune = cmds_of(out, DraftPrune)[0].prune
    assert draft_prune.commit_ids.tolist() == [0, 1]  # node 3 (token 9) the draft never ran
    assert cmds_of(out, DraftPrefill)[0].tokens == [9]


def test_failure_finishes_with_an_error() -> None:
    c, _ = _specpipe()
    (fin,) = c.on_failure("stage down")
    assert fin.reason == "error" and fin.error == "stage down" and c.done
    assert c.on_failure("again") == []


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_event_order_within_a_step_changes_neither_tokens_nor_steps(seed: int, k: int) -> None:
    """An asynchronous executor sees a step's draft answers and verifications in any order;
    while the draft keeps up, decisions and step counts are those of lockstep (with K
    layers per step, an answer asks again within the same step)."""
    rng = random.Random(seed)
    opts = DecodeOptions(30, width=2, layers_per_step=k)
    ref = LockstepGeneration(RulePipeline(3), RuleDraft(), PROMPT, Mode.SPECPIPE, opts)
    ref.run()
    c = make_controller(Mode.SPECPIPE, "r", PROMPT, opts, 3)
    pipe, draft = RulePipeline(3), RuleDraft()
    pipe.open_for(c)
    feeds: dict[int, Activation] = {}
    prunes: list[Prune] = []
    answers: dict[int, list] = {}  # step -> draft answers for the layer entering then
    done = False

    def execute(cmds) -> None:
        nonlocal done
        for cmd in cmds:
            if isinstance(cmd, Feed):
                feeds[cmd.step] = cmd.act
            elif isinstance(cmd, BroadcastPrune):
                prunes.append(cmd.prune)
            elif isinstance(cmd, DraftOpen):
                draft.open("r", 0)
                draft.prefill("r", torch.tensor(cmd.prompt[:-1]), 0, 128)
            elif isinstance(cmd, DraftPrune):
                draft.prune("r", cmd.prune)
            elif isinstance(cmd, Propose):
                answer = (cmd.ticket, draft.propose(cmd.layer, cmd.top_k))
                answers.setdefault(cmd.step, []).append(answer)
            elif isinstance(cmd, Finish):
                done = True

    execute(c.start())
    step = min(feeds)
    while not done:
        result = pipe.step("r", prunes, feeds.pop(step, None))
        prunes = []
        events = [("answer", a) for a in answers.pop(step, [])]
        events += [("verified", v) for v in result.verified]
        while events:
            rng.shuffle(events)
            kind, ev = events.pop()
            execute(c.on_candidates(*ev) if kind == "answer" else c.on_verified(ev))
            events += [("answer", a) for a in answers.pop(step, [])]
        step += 1
    assert c.tokens == ref.output
    assert c.stats.decode_steps == ref.stats.decode_steps
    assert c.stats.hits == ref.stats.hits


# -- faults: replay on a fresh path, going on without the draft ---------------------------


class FaultHarness:
    """Steps a RulePipeline in lockstep, every feed entering exactly at the step the
    controller counted for it. `faults` maps a step to what happens before it runs:
    "path" (the pipeline and the draft are lost: a fresh pair, `replay(True)`),
    "path-no-draft" (`replay(False)`), "draft" (only the draft is lost: `drop_draft`).
    After a replay the harness goes on at the replay's first step, as the accounting
    does (steps the old path spent between its last counted step and the fault are not
    counted)."""

    def __init__(self, mode, stages, n=24, faults=None, oracle=True, pipeline=None, **opts) -> None:
        self.c = make_controller(mode, "r", PROMPT, DecodeOptions(n, **opts), stages)
        self.pipeline = pipeline or RulePipeline
        self.stages, self.oracle = self.c.num_stages, oracle
        self.faults = dict(faults or {})
        self.has_draft = self.c.uses_draft
        self.emitted: list[int] = []
        self.done = False
        self.seqs: list[list[int]] = [[]]  # feed seqs per path
        self.prune_seqs: list[list[int]] = [[]]
        self.max_node_id = self.old_horizon = -1
        self._fresh_path()

    def _fresh_path(self) -> None:
        self.pipe, self.draft = self.pipeline(self.stages), RuleDraft(self.oracle)
        self.pipe.open_for(self.c)
        self.feeds: dict[int, Activation] = {}
        self.prunes: list[Prune] = []
        self.answers: dict[int, list] = {}

    def execute(self, cmds) -> None:
        queue = list(cmds)
        while queue:
            cmd = queue.pop(0)
            if isinstance(cmd, Feed):
                # A step's slot is free again when its feed (grown ahead, eager) was pruned
                # away whole: the stages drop such rows, the engine skips them.
                taken = (
                    cmd.step in self.feeds
                    and after_prunes(self.prunes, self.feeds[cmd.step]) is not None
                )
                assert cmd.step >= self.step and not taken, (cmd.step, self.step)
                self.feeds[cmd.step] = cmd.act
                self.seqs[-1].append(cmd.seq)
                if not cmd.act.committed:
                    # node ids keep growing: nothing of an old path is taken for the new one
                    assert int(cmd.act.node_ids.min()) > self.old_horizon
                    self.max_node_id = max(self.max_node_id, int(cmd.act.node_ids.max()))
            elif isinstance(cmd, BroadcastPrune):
                self.prunes.append(cmd.prune)
                self.prune_seqs[-1].append(cmd.seq)
            elif isinstance(cmd, Emit):
                self.emitted += cmd.tokens
            elif isinstance(cmd, Finish):
                assert not cmd.error
                self.done = True
            else:
                assert self.has_draft, f"{cmd} without a draft"
                if isinstance(cmd, DraftOpen):
                    self.draft.open("r", 0)
                    if len(cmd.prompt) > 1:
                        self.draft.prefill("r", torch.tensor(cmd.prompt[:-1]), 0, 4)
                elif isinstance(cmd, DraftPrune):
                    self.draft.prune("r", cmd.prune)
                elif isinstance(cmd, DraftPrefill):
                    tokens = torch.tensor(cmd.tokens)
                    self.draft.prefill("r", tokens, cmd.start_position, 4)
                elif isinstance(cmd, Propose):
                    answer = (cmd.ticket, self.draft.propose(cmd.layer, cmd.top_k))
                    if cmd.step is None:  # specinfer: the draft works between passes
                        queue = self.c.on_candidates(*answer) + queue
                    else:
                        self.answers.setdefault(cmd.step, []).append(answer)

    def run(self) -> FaultHarness:
        self.step = -(10**9)
        self.execute(self.c.start())
        self.step = min(self.feeds)
        while not self.done:
            kind = self.faults.pop(self.step, None)
            if kind == "draft":
                self.has_draft = False
                self.answers.clear()
                self.execute(self.c.drop_draft())
            elif kind is not None:
                self.old_horizon = self.max_node_id
                self._fresh_path()
                self.has_draft = kind == "path" and self.c.mode.uses_draft
                self.seqs.append([])
                self.prune_seqs.append([])
                self.step = -(10**9)
                self.execute(self.c.replay(uses_draft=kind == "path"))
                self.step = min(self.feeds)
                assert self.seqs[-1][0] == 0  # the new path's feeds are numbered afresh
            result = self.pipe.step("r", self.prunes, self.feeds.pop(self.step, None))
            self.prunes = []
            while self.answers.get(self.step):  # an answer may ask again in the same step
                for answer in self.answers.pop(self.step):
                    self.execute(self.c.on_candidates(*answer))
            for v in result.verified:
                self.execute(self.c.on_verified(v))
            self.step += 1
        assert self.c.stats.decode_steps == self.step  # the accounting is the real steps
        for seqs in self.seqs:
            assert seqs == list(range(len(seqs)))
        for seqs in self.prune_seqs:
            assert seqs == list(range(1, len(seqs) + 1))
        return self


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_replays_and_draft_losses_emit_plain_decoding(mode, stages, seed) -> None:
    rng = random.Random(seed)
    faults = {
        rng.randrange(0, 60): rng.choice(["path", "path-no-draft", "draft"]) for _ in range(3)
    }
    h = FaultHarness(mode, stages, n=24, faults=faults, width=3, prefill_chunk=4).run()
    assert h.emitted == plain_decoding(PROMPT, 24)
    st = h.c.stats
    assert st.new_tokens == 24 and st.replays <= 3 and st.draft_drops <= 3


def test_replay_before_the_first_token_and_on_every_step() -> None:
    ref = FaultHarness(Mode.SPECPIPE, 3, n=12, width=2).run()
    h = FaultHarness(Mode.SPECPIPE, 3, n=12, faults={s: "path" for s in range(-2, 30)},
                     width=2, prefill_chunk=4).run()  # fmt: skip
    assert h.emitted == ref.emitted == plain_decoding(PROMPT, 12)
    assert h.c.stats.replays >= 10 and h.c.stats.draft_drops == 0


def test_replay_reprefills_prompt_and_emitted_tokens_then_the_root() -> None:
    c = make_controller(
        Mode.SPECPIPE, "r", [5, 6, 7], DecodeOptions(8, width=2, prefill_chunk=2), 2
    )
    p0 = cmds_of(c.start(), Propose)[0]
    c.on_candidates(p0.ticket, cand([(0, 9, 0.9), (0, 8, 0.1)]))
    out = c.on_verified(verified(c, [0], [9]))  # hit: token 9 emitted
    assert cmds_of(out, Emit)[0].tokens == [9] and c.stats.hits == 1
    horizon = c.tree.last_id
    cmds = c.replay(uses_draft=True)
    (draft_open,) = cmds_of(cmds, DraftOpen)
    assert draft_open.prompt == [5, 6, 7, 9] and isinstance(cmds[0], DraftOpen)
    feeds = cmds_of(cmds, Feed)
    assert [f.act.tokens.tolist() for f in feeds] == [[5, 6], [7], [9]]
    assert [f.act.committed for f in feeds] == [True, True, False]
    assert [f.seq for f in feeds] == [0, 1, 2] and all(f.after_prune == 0 for f in feeds)
    root = feeds[-1].act
    assert root.positions.tolist() == [3] and int(root.node_ids[0]) > horizon
    assert [f.step for f in feeds] == [2, 3, 4]  # after the old path's last feed (step 1)
    (propose,) = cmds_of(cmds, Propose)
    assert propose.layer.node_ids.tolist() == root.node_ids.tolist()
    assert c.stats.replays == 1 and c.stats.prefill_steps == 1  # the first prefill
    # Answers and verifications of the old path change nothing.
    assert c.on_candidates(p0.ticket, cand([(1, 4, 0.9)])) == []
    assert c.on_verified(verified(c, [1], [4])) == []
    out = c.on_verified(verified(c, [int(root.node_ids[0])], [3]))
    assert cmds_of(out, Emit)[0].tokens == [3]
    assert cmds_of(out, BroadcastPrune)[0].seq == 1  # prunes numbered afresh too
    assert c.stats.decode_steps == 4 + 2  # the root entered at 4, crossed 2 stages


def test_after_losing_the_draft_a_specpipe_request_goes_on_as_pp() -> None:
    h = FaultHarness(Mode.SPECPIPE, 3, n=20, faults={4: "draft"}, width=2)
    h.run()
    assert h.emitted == plain_decoding(PROMPT, 20)
    st = h.c.stats
    assert st.draft_drops == 1 and st.replays == 0 and not h.c.uses_draft
    fast = FaultHarness(Mode.SPECPIPE, 3, n=20, width=2).run().c.stats.decode_steps
    pp = FaultHarness(Mode.PP, 3, n=20).run().c.stats.decode_steps
    assert fast < st.decode_steps < pp
    # A later replay onto a path with a draft takes one again.
    h = FaultHarness(Mode.SPECPIPE, 3, n=20, faults={4: "draft", 12: "path"}, width=2).run()
    assert h.emitted == plain_decoding(PROMPT, 20) and h.c.uses_draft
    assert h.c.stats.draft_drops == 1 and h.c.stats.replays == 1


def test_pp_and_autoregressive_never_need_a_draft() -> None:
    for mode in (Mode.PP, Mode.AUTOREGRESSIVE):
        h = FaultHarness(mode, 3, n=10, faults={3: "path", 7: "path"}).run()
        assert h.emitted == plain_decoding(PROMPT, 10) and h.c.stats.replays == 2
        assert not h.c.uses_draft and h.c.drop_draft() == []


def test_seeded_sampling_survives_replays() -> None:
    outs = set()
    for faults in ({}, {2: "path"}, {5: "draft", 9: "path-no-draft"}, {1: "path", 6: "path"}):
        for mode in (Mode.SPECPIPE, Mode.SPECINFER, Mode.PP):
            h = FaultHarness(mode, 3, n=16, faults=faults, width=3, pipeline=SoftRulePipeline,
                             sampling=SamplingParams(temperature=1.0, seed=5))  # fmt: skip
            outs.add(tuple(h.run().emitted))
    assert len(outs) == 1
