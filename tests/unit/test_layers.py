"""Several tree layers per step, ranking by the target's own rule, and the n-gram and
hybrid token sources: the controller over the model-free rule pipeline of
`test_controller` (target and draft are rules on tokens)."""

from __future__ import annotations

import math

import pytest
import torch
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.commands import BroadcastPrune, Emit, Feed, Propose
from specpipe.common.spec.controller import make_controller
from specpipe.common.spec.messages import Activation, Candidates
from specpipe.common.spec.options import DecodeOptions, Growth, Mode
from specpipe.common.spec.sampling import SamplingParams

from .test_controller import (
    PROMPT,
    VOCAB,
    FaultHarness,
    RuleDraft,
    RulePipeline,
    SoftRulePipeline,
    cand,
    cmds_of,
    plain_decoding,
    rule,
    verified,
)


def copy_rule(seq) -> int:
    """A target that repeats itself (period 4): what the n-gram source is good at."""
    return seq[-4]


def draft_for(source: str, rule=rule):
    return {"oracle": RuleDraft(True, rule), "blind": RuleDraft(False, rule)}.get(source)


def token_source(source: str) -> str:
    return {"ngram": "ngram", "hybrid": "hybrid"}.get(source, "draft")


def run(
    stages, source="oracle", n=24, pipeline=RulePipeline, rule=rule, **opts
) -> LockstepGeneration:
    draft = draft_for("blind" if source == "hybrid" else source, rule)
    opts = DecodeOptions(n, token_source=token_source(source), **opts)
    gen = LockstepGeneration(pipeline(stages, rule), draft, PROMPT, Mode.SPECPIPE, opts)
    gen.run()
    return gen


def ideal_steps(stages: int, n: int, k: int) -> int:
    """Every token a hit: the root crosses the empty pipeline with the K - 1 layers grown
    below it (S steps, K tokens), then each step's group of K layers is verified whole."""
    return stages - 1 + math.ceil(n / k)


# -- lossless -------------------------------------------------------------------------------


@pytest.mark.parametrize("growth", list(Growth))
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("source", ["oracle", "blind", "ngram", "hybrid"])
@pytest.mark.parametrize("target", [rule, copy_rule])
def test_several_layers_per_step_emit_plain_decoding(k, stages, source, target, growth) -> None:
    gen = run(stages, source, rule=target, width=3, layers_per_step=k, prefill_chunk=4,
              growth=growth)  # fmt: skip
    assert gen.output == plain_decoding(PROMPT, 24, target)
    assert gen.stats.new_tokens == 24 and gen.stats.layers_per_step == k


@pytest.mark.parametrize("growth", list(Growth))
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("source", ["oracle", "blind", "ngram", "hybrid"])
def test_seeded_sampling_with_several_layers_equals_autoregressive(k, source, growth) -> None:
    sampling = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=11)
    ref = LockstepGeneration(SoftRulePipeline(1), None, PROMPT, Mode.AUTOREGRESSIVE,
                     DecodeOptions(20, sampling)).run()  # fmt: skip
    for stages in (2, 4):
        gen = run(stages, source, n=20, pipeline=SoftRulePipeline, sampling=sampling,
                  width=4, layers_per_step=k, growth=growth)  # fmt: skip
        assert gen.output == ref, f"S={stages}"


@pytest.mark.parametrize("growth", list(Growth))
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("source", ["oracle", "hybrid"])
@pytest.mark.parametrize("seed", range(3))
def test_replays_and_draft_losses_with_several_layers(k, source, seed, growth) -> None:
    import random

    rng = random.Random(seed)
    faults = {
        rng.randrange(0, 40): rng.choice(["path", "path-no-draft", "draft"]) for _ in range(3)
    }
    h = FaultHarness(Mode.SPECPIPE, 3, n=24, faults=faults, oracle=source == "oracle",
                     width=3, layers_per_step=k, token_source=token_source(source),
                     growth=growth)  # fmt: skip
    assert h.run().emitted == plain_decoding(PROMPT, 24)


# -- tokens per step ------------------------------------------------------------------------


@pytest.mark.parametrize("growth", list(Growth))
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("stages", [2, 4, 7])
def test_an_oracle_draft_gives_k_tokens_per_step(k, stages, growth) -> None:
    st = run(stages, "oracle", n=40, width=2, layers_per_step=k, growth=growth).stats
    assert st.hits == st.new_tokens == 40 and st.regrowths == 0
    assert st.decode_steps == ideal_steps(stages, 40, k)
    # The draft grows K layers a step, one forward of at most `width` rows each.
    assert max(len(f) for f in st.draft_forwards) == k
    assert all(rows <= 2 for f in st.draft_forwards for rows in f)


class CountingDraft(RuleDraft):
    """A rule draft that records the rows of every forward it runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forwards: list[int] = []

    def propose(self, layer: Activation, top_k: int, temperature: float = 0.0) -> Candidates:
        self.forwards.append(layer.node_ids.numel())
        return super().propose(layer, top_k, temperature)


@pytest.mark.parametrize("source", ["oracle", "blind"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_every_draft_forward_is_in_the_step_trace(k, source) -> None:
    """Cost projections price a step's draft work from the trace: a forward missing from
    it would be free (K > 1 grows a chain of layers after a verification, between two
    steps)."""
    draft = CountingDraft(source == "oracle")
    opts = DecodeOptions(40, width=2, layers_per_step=k)
    gen = LockstepGeneration(RulePipeline(4, rule), draft, PROMPT, Mode.SPECPIPE, opts)
    gen.run()
    st = gen.stats
    assert sorted(r for f in st.draft_forwards for r in f) == sorted(draft.forwards)
    assert sum(row[-1] for row in st.trace) == sum(draft.forwards)
    if source == "oracle":  # steady state: the K layers of each step's group, one by one
        steady = st.draft_forwards[st.prefill_steps + 4 : -4]
        assert steady and all(len(f) == k for f in steady)


def test_the_repeating_target_is_all_hits_for_the_ngram_source_without_a_draft() -> None:
    gen = run(4, "ngram", n=40, rule=copy_rule, width=2, layers_per_step=2)
    st = gen.stats
    assert gen.draft is None and st.token_source == "ngram"
    # Only the first token (no 4-gram of the prompt is followed yet) can miss.
    assert st.hits >= 39 and st.ngram_hits == st.hits and st.draft_hits == 0
    assert st.decode_steps <= ideal_steps(4, 40, 2) + 4
    assert st.trace and all(row[-1] == 0 for row in st.trace)  # no draft forward ever


def test_hybrid_counts_hits_per_source() -> None:
    # A draft that is sure and always wrong: every hit is the n-gram source's (its tokens
    # rank below the draft's best, so only the rest of the width holds them).
    blind = run(3, "hybrid", n=30, rule=copy_rule, width=3).stats
    assert run(3, "blind", n=30, rule=copy_rule, width=3).stats.hits == 0
    assert blind.draft_hits == 0 and blind.ngram_hits == blind.hits >= 10
    assert blind.record()["ngram_hit_rate"] == round(blind.hits / 30, 6)
    both = LockstepGeneration(RulePipeline(3, copy_rule), RuleDraft(True, copy_rule), PROMPT,
                      Mode.SPECPIPE, DecodeOptions(30, width=3, token_source="hybrid"))  # fmt: skip
    both.run()
    st = both.stats
    assert st.hits == st.draft_hits == 30 and st.ngram_hits >= 25  # both proposed most


# -- the controller alone: a K = 2 script ---------------------------------------------------


def test_two_layers_enter_together_and_are_verified_in_one_step() -> None:
    """K = 2: the root waits for the layer below it and enters with it; every group after
    has two layers, and a step verifies down both."""
    c = make_controller(Mode.SPECPIPE, "r", [5, 6], DecodeOptions(8, width=1, layers_per_step=2), 2)
    start = c.start()
    assert not [f for f in cmds_of(start, Feed) if not f.act.committed]  # the root waits
    (p0,) = cmds_of(start, Propose)
    assert p0.layer.node_ids.tolist() == [0]
    out = c.on_candidates(p0.ticket, cand([(0, 7, 0.9)]))
    (group,) = cmds_of(out, Feed)
    assert group.step == 0 and group.act.node_ids.tolist() == [0, 1]
    assert group.act.parent_ids.tolist() == [-1, 0] and group.act.tokens.tolist() == [6, 7]
    (p1,) = cmds_of(out, Propose)
    assert p1.step == 0 and p1.layer.node_ids.tolist() == [1]  # the draft works in step 0
    out = c.on_candidates(p1.ticket, cand([(1, 9, 0.9)]))
    assert not cmds_of(out, Feed)  # layer 2 waits for layer 3
    (p2,) = cmds_of(out, Propose)
    out = c.on_candidates(p2.ticket, cand([(2, 11, 0.9)]))
    (g1,) = cmds_of(out, Feed)
    assert g1.step == 1 and g1.act.node_ids.tolist() == [2, 3]
    assert g1.act.parent_ids.tolist() == [1, 2] and g1.act.tokens.tolist() == [9, 11]
    (p3,) = cmds_of(out, Propose)
    assert c.on_candidates(p3.ticket, cand([(3, 13, 0.9)])) == []  # held: root due at 1
    out = c.on_verified(verified(c, [0, 1], [7, 9]))
    assert cmds_of(out, Emit)[0].tokens == [7, 9]  # the root, then node 1 in the same step
    prune = cmds_of(out, BroadcastPrune)[0].prune
    assert prune.commit_ids.tolist() == [0, 1] and prune.keep_ids.tolist() == [2, 3]
    (p4,) = cmds_of(out, Propose)  # grown from the held answer: node 4 (token 13)
    (g2,) = cmds_of(c.on_candidates(p4.ticket, cand([(4, 15, 0.9)])), Feed)
    assert g2.step == 2 and g2.act.tokens.tolist() == [13, 15]
    out = c.on_verified(verified(c, [2, 3], [11, 13]))
    assert cmds_of(out, Emit)[0].tokens == [11, 13]
    assert c.stats.hits == 4 and c.stats.decode_steps == 3 and c.tree.root_id == 4


@pytest.mark.parametrize("growth", list(Growth))
def test_eager_growth_feeds_the_next_layer_before_the_verification(growth) -> None:
    """The draft answers for the layer entering at step 2 while the root (due at step 1)
    is not verified yet: eager growth feeds that layer at once, and the verification
    keeps it; verified growth holds the answer until the verification, then grows it."""
    opts = DecodeOptions(8, width=1, growth=growth)
    c = make_controller(Mode.SPECPIPE, "r", [5, 6], opts, 2)
    p0 = cmds_of(c.start(), Propose)[0]
    out = c.on_candidates(p0.ticket, cand([(0, 7, 0.9)]))
    assert [f.step for f in cmds_of(out, Feed)] == [1]
    (p1,) = cmds_of(out, Propose)
    assert p1.step == 1
    early = cmds_of(c.on_candidates(p1.ticket, cand([(1, 9, 0.9)])), Feed)
    out = c.on_verified(verified(c, [0], [7]))  # a hit: node 1
    late = cmds_of(out, Feed)
    (layer2,) = early + late
    assert layer2.step == 2 and layer2.act.tokens.tolist() == [9]
    prune = cmds_of(out, BroadcastPrune)[0].prune
    assert prune.commit_ids.tolist() == [0]
    if growth == Growth.EAGER:
        assert early and layer2.after_prune == 0  # created before the verification's prune
        assert prune.keep_ids.tolist() == [1, 2]
    else:
        assert late and layer2.after_prune == 1
        assert prune.keep_ids.tolist() == [1]
    assert c.stats.late_draft_answers == 0


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("source", ["oracle", "blind", "ngram"])
def test_eager_growth_takes_the_steps_of_verified_growth(k, source) -> None:
    """A layer grown ahead that the verification drops whole (every miss, with a blind
    draft) gives its step back: the root after the miss enters in it, as a stage that
    drops those rows on arrival lets it."""
    steps = {
        g: run(3, source, n=24, width=3, layers_per_step=k, growth=g).stats.decode_steps
        for g in Growth
    }
    assert steps[Growth.EAGER] == steps[Growth.VERIFIED]


def test_a_miss_inside_the_group_restarts_from_the_drawn_token() -> None:
    c = make_controller(Mode.SPECPIPE, "r", [5, 6], DecodeOptions(8, width=1, layers_per_step=2), 2)
    p0 = cmds_of(c.start(), Propose)[0]
    p1 = cmds_of(c.on_candidates(p0.ticket, cand([(0, 7, 0.9)])), Propose)[0]
    p2 = cmds_of(c.on_candidates(p1.ticket, cand([(1, 9, 0.9)])), Propose)[0]
    c.on_candidates(p2.ticket, cand([(2, 11, 0.9)]))
    out = c.on_verified(verified(c, [0, 1], [7, 30]))  # node 1's token is not 9
    assert cmds_of(out, Emit)[0].tokens == [7, 30]
    prune = cmds_of(out, BroadcastPrune)[0].prune
    assert prune.commit_ids.tolist() == [0, 1] and prune.keep_ids.numel() == 0
    assert not cmds_of(out, Feed)  # the new root waits for the layer below it
    (p3,) = cmds_of(out, Propose)
    assert p3.layer.tokens.tolist() == [30] and p3.layer.positions.tolist() == [3]
    (restart,) = cmds_of(
        c.on_candidates(p3.ticket, cand([(p3.layer.node_ids.item(), 8, 0.9)])), Feed
    )
    assert restart.act.tokens.tolist() == [30, 8] and restart.act.positions.tolist() == [3, 4]
    assert restart.step == 2  # right after the verification of step 1


def test_the_walk_stops_at_the_last_token() -> None:
    c = make_controller(Mode.SPECPIPE, "r", [5, 6], DecodeOptions(2, width=1, layers_per_step=2), 2)
    p0 = cmds_of(c.start(), Propose)[0]
    p1 = cmds_of(c.on_candidates(p0.ticket, cand([(0, 7, 0.9)])), Propose)[0]
    c.on_candidates(p1.ticket, cand([(1, 9, 0.9)]))
    c.on_verified(verified(c, [0], [7]))
    out = c.on_verified(verified(c, [1, 2], [9, 11]))
    assert cmds_of(out, Emit)[0].tokens == [9] and c.done and c.tokens == [7, 9]


# -- ranking by the target's rule ------------------------------------------------------------


class MisleadingDraft(RuleDraft):
    """An oracle whose best proposal is always the target's token, but unsure of it on the
    target's path (0.4 against 0.35 and 0.25), while off the path two children share
    nearly all the mass (0.5, 0.49): off-path branches multiply, and by cumulative
    probability they crowd out the path the target takes."""

    def propose(self, layer, top_k, temperature=0.0) -> Candidates:
        req = self.requests[layer.request_id]
        req.add(layer)
        truth = PROMPT + plain_decoding(PROMPT, 80)
        parents, tokens, probs = [], [], []
        for nid in layer.node_ids.tolist():
            seq = req.path(nid)
            on_path = seq == truth[: len(seq)]
            best = rule(seq)
            others = [t for t in range(VOCAB) if t != best][:2]
            weights = [0.4, 0.35, 0.25] if on_path else [0.5, 0.49, 0.01]
            for t, w in zip([best, *others], weights, strict=True):
                parents.append(nid)
                tokens.append(t)
                probs.append(w)
        return Candidates(torch.tensor(parents), torch.tensor(tokens), torch.tensor(probs))


def test_target_ranking_keeps_the_path_the_beam_drops() -> None:
    def steps(ranking: str) -> int:
        opts = DecodeOptions(40, width=3, ranking=ranking)
        gen = LockstepGeneration(RulePipeline(6), MisleadingDraft(), PROMPT, Mode.SPECPIPE, opts)
        assert gen.run() == plain_decoding(PROMPT, 40)
        return gen.stats.decode_steps

    assert steps("target") == ideal_steps(6, 40, 1)
    assert steps("beam") > ideal_steps(6, 40, 1) + 5  # the beam loses the target's path


def test_hybrid_ngram_proposals_share_what_the_drafts_best_leaves() -> None:
    from specpipe.common.spec.growth import beside, pool_of

    draft = pool_of(cand([(1, 7, 0.8), (1, 8, 0.1)]))
    ngram = pool_of(cand([(1, 9, 0.875), (2, 4, 0.5)]))
    scaled = beside(ngram, draft)
    # Node 1's draft keeps its best (0.8); the n-gram token shares the 0.2 left. Node 2
    # had no draft proposal: the n-gram's own probability.
    assert scaled[2].tolist() == pytest.approx([0.875 * 0.2, 0.5])
