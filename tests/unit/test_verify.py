"""Verification at the last stage: the walk down the tree, the last stage's own
view of which row is the root (no round trip to the router), and logprobs equal to the
target's own forward."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
from specpipe.common.runtime.lockstep import LockstepEngine, LockstepGeneration
from specpipe.common.runtime.verifier import RequestVerifier, verify_many
from specpipe.common.spec.messages import Activation, Prune
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.sampling import SamplingParams
from specpipe.common.spec.verify import VerifySpec
from transformers import AutoModelForCausalLM

VOCAB = 16
GREEDY = VerifySpec(SamplingParams(), output_start=3)
PROMPT = [5, 17, 33, 2, 8, 90, 41, 12, 60]


# -- the last stage's verifier, with hidden states that are their own logits -----------------
def rows(ids, parents, tokens, draws, position=2) -> Activation:
    """Tree rows whose 'final hidden state' is a one-hot of the token to draw there."""
    hidden = torch.zeros(len(ids), VOCAB, dtype=torch.float64)
    hidden[torch.arange(len(ids)), torch.tensor(draws)] = 1.0
    depth = {-1: -1}
    pos = []
    for i, p in zip(ids, parents, strict=True):
        depth[i] = depth.get(p, depth[-1]) + 1
        pos.append(position + depth[i])
    return Activation(
        "r",
        torch.tensor(pos),
        node_ids=torch.tensor(ids),
        parent_ids=torch.tensor(parents),
        hidden=hidden,
        row_tokens=torch.tensor(tokens),
    )


def verifier(spec: VerifySpec = GREEDY) -> RequestVerifier:
    return RequestVerifier("r", spec, lambda h: h)


def walked(found) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(v.node_ids, v.tokens) for v in found]


def test_next_root_is_the_drawn_child_without_waiting_for_the_prune() -> None:
    v = verifier()
    assert walked(v.on_output(rows([0], [-1], [9], [4]))) == [((0,), (4,))]
    # the root's children arrive before any prune: the child with token 4 is the root
    out = v.on_output(rows([1, 2], [0, 0], [4, 5], [7, 3], position=3))
    assert walked(out) == [((1,), (7,))]
    assert out[0].position == 3
    # grandchildren: under node 1 the one with token 7 is next; under dead node 2, dead
    out = v.on_output(rows([3, 4, 5], [1, 1, 2], [7, 8, 7], [1, 1, 1], position=4))
    assert walked(out) == [((3,), (1,))]
    assert v.held_rows == 0


def test_a_group_of_layers_is_walked_in_one_output() -> None:
    v = verifier()
    group = rows([0, 1, 2, 3, 4], [-1, 0, 0, 1, 2], [9, 4, 5, 6, 6], [5, 0, 6, 0, 7])
    assert walked(v.on_output(group)) == [((0, 2, 4), (5, 6, 7))]


def test_rows_below_a_dead_node_are_dead_whenever_they_arrive() -> None:
    v = verifier()
    # the root draws 5 (node 2): node 1 is dead, and so is node 3 below it, which
    # arrives with the next group before the router's prune
    v.on_output(rows([0, 1, 2], [-1, 0, 0], [9, 4, 5], [5, 0, 0]))
    assert v.on_output(rows([3], [1], [6], [0], position=4)) == []
    assert v.held_rows == 0
    # once the router's prune passes them, the stage's own filter takes over
    v.on_prune(Prune(torch.tensor([0]), torch.tensor([2]), horizon=3))
    assert v._dead.size == 0 and v._drawn.size == 0


def test_a_prune_that_lags_behind_the_stage_does_not_revive_dead_nodes() -> None:
    """The router decides after the stage: its prune may keep nodes the stage already
    knows are dead. A row below one of them is still dead, not a root."""
    v = verifier()
    v.on_output(rows([0], [-1], [9], [4]))  # 0 draws 4
    v.on_output(rows([1], [0], [4], [5], position=3))  # 1 draws 5
    out = v.on_output(rows([2, 3], [1, 1], [5, 6], [7, 0], position=4))
    assert walked(out) == [((2,), (7,))]  # node 3 (token 6) is dead
    # the router's verification of node 0 (it lags two steps) keeps 1's whole subtree
    v.on_prune(Prune(torch.tensor([0]), torch.tensor([1, 2, 3, 4, 5]), horizon=5))
    # node 3's child arrives: dead, not a root (the stage does not forget node 3);
    # node 2's child with the token drawn there is the next root
    out = v.on_output(rows([4, 5], [3, 2], [1, 7], [0, 8], position=5))
    assert walked(out) == [((5,), (8,))]
    # once a prune drops node 3 the stage forgets it (its own filter drops the rest)
    v.on_prune(Prune(torch.tensor([1, 2]), torch.tensor([5]), horizon=5))
    assert v._dead.size == 0


def test_a_miss_then_the_new_root_after_the_routers_prune() -> None:
    v = verifier()
    v.on_output(rows([0, 1], [-1, 0], [9, 4], [8, 0]))  # draws 8: no child has it (a miss)
    assert v.held_rows == 0
    v.on_prune(Prune(torch.tensor([0]), torch.empty(0, dtype=torch.int64), horizon=1))
    # the router's new root (token 8, parent -1) and its children
    out = v.on_output(rows([2, 3], [-1, 2], [8, 3], [3, 1], position=3))
    assert walked(out) == [((2, 3), (3, 1))]


def test_a_late_child_of_the_tip_after_the_prune_is_verified_once() -> None:
    v = verifier()
    v.on_output(rows([0], [-1], [9], [4]))
    # the router grew node 1 (token 4) late, took the hit, pruned, then fed it
    v.on_prune(Prune(torch.tensor([0]), torch.tensor([1]), horizon=1))
    assert walked(v.on_output(rows([1], [0], [4], [2], position=3))) == [((1,), (2,))]
    assert v.on_output(rows([2], [0], [6], [2], position=3)) == []  # no second root


def test_seeded_draws_use_the_output_position() -> None:
    spec = VerifySpec(SamplingParams(temperature=1.0, seed=3), output_start=3)
    logits = torch.randn(1, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    draws = []
    for position in (2, 5, 9):  # output positions 0, 3, 7
        act = Activation(
            "r",
            torch.tensor([position]),
            node_ids=torch.tensor([position]),
            parent_ids=torch.tensor([-1]),
            hidden=logits,
            row_tokens=torch.tensor([0]),
        )
        (v,) = RequestVerifier("r", spec, lambda h: h).on_output(act)
        draws.append(v.tokens[0])
    from specpipe.common.spec.sampling import draw_index

    assert draws == [int(draw_index(logits[0], spec.sampling, i)) for i in (0, 3, 7)]


def test_a_rounds_walks_share_one_head_call_and_walk_as_one_at_a_time() -> None:
    """verify_many: the logits of every row the requests' first walks can reach in one
    LM head call; every walk equal to that request's own on_output; a bad output fails
    alone."""
    calls: list[int] = []

    def head(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h

    def round_of(make) -> list:
        outs = [
            rows([0], [-1], [9], [4]),
            rows([0, 1, 2, 3, 4], [-1, 0, 0, 1, 2], [9, 4, 5, 6, 6], [5, 0, 6, 0, 7]),
            rows([0, 1], [-1, 0], [9, 4], [8, 0]),
        ]
        return [(make(), out) for out in outs]

    alone = [walked(v.on_output(out)) for v, out in round_of(verifier)]
    together = verify_many(round_of(lambda: RequestVerifier("r", GREEDY, head)), head)
    assert [walked(found) for found in together] == alone
    # one call: the three roots and the 4 + 1 rows below them, walked 3 levels deep
    assert calls == [8]

    calls.clear()
    bad = Activation("r", torch.tensor([2]), node_ids=torch.tensor([0]),
                     parent_ids=torch.tensor([-1]), hidden=None, row_tokens=torch.tensor([9]))  # fmt: skip
    mixed = [(RequestVerifier("r", GREEDY, head), a) for a in (bad, rows([0], [-1], [9], [4]))]
    error, found = verify_many(mixed, head)
    assert isinstance(error, ValueError) and "hidden states" in str(error)
    assert walked(found) == [((0,), (4,))] and calls == [1]


def test_a_request_with_two_outputs_in_a_round_walks_them_in_order() -> None:
    """The second output's root depends on what the first drew (here node 2, not node 1,
    which is the first root the verifier would see before the first walk)."""
    v = verifier()
    first, second = rows([0], [-1], [9], [5]), rows([1, 2], [0, 0], [4, 5], [7, 3], position=3)
    found = verify_many([(v, first), (v, second)], lambda h: h)
    assert [walked(f) for f in found] == [[((0,), (5,))], [((2,), (3,))]]


# -- through the in-process pipeline: the last stage verifies ---------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_in_process_last_stage_sends_verifications_not_logits(llama_dir, k) -> None:
    dep = build_local(llama_dir, 3, ORACLE_DRAFT, torch.float64)
    engine = LockstepEngine(dep.pipeline, dep.draft)
    opts = DecodeOptions(20, width=3, layers_per_step=k)
    run = engine.add(PROMPT, Mode.SPECPIPE, opts)
    seen = []
    step_many = dep.pipeline.step_many

    def spy(inputs):
        results = step_many(inputs)
        seen.extend(results.values())
        return results

    dep.pipeline.step_many = spy  # type: ignore[method-assign]
    while engine.runs:
        engine.step()
    assert sum(len(r.verified) for r in seen) == run.stats.verifications
    ref = LockstepGeneration(
        dep.pipeline, None, PROMPT, Mode.AUTOREGRESSIVE, DecodeOptions(20)
    ).run()
    assert run.tokens == ref


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("mode", [Mode.SPECPIPE, Mode.SPECINFER, Mode.PP])
def test_logprobs_are_the_targets_own(llama_dir, mode, temperature) -> None:
    """Each token's logprob and top 5 are log_softmax of the target's raw logits at its
    position (transformers' own forward of the emitted sequence, fp64)."""
    dep = build_local(llama_dir, 3, ORACLE_DRAFT, torch.float64)
    sampling = SamplingParams(temperature=temperature, seed=4)
    opts = DecodeOptions(12, sampling=sampling, width=3, logprobs=5)
    gen = LockstepGeneration(dep.pipeline, dep.draft, PROMPT, mode, opts)
    gen.run()
    lps = gen.controller.out.logprobs
    assert len(lps) == len(gen.output) == 12
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + gen.output])).logits[0]
    want = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    for i, (lp, token) in enumerate(zip(lps, gen.output, strict=True)):
        assert lp.logprob == pytest.approx(float(want[i, token]), abs=1e-9)
        top = torch.topk(want[i], 5)
        assert list(lp.top_ids) == top.indices.tolist()
        assert list(lp.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-9)


# -- prompt logprobs (echo with logprobs) ------------------------------------------------------
LONG_PROMPT = [(7 * i + 3) % 90 + 1 for i in range(40)]  # two whole cache blocks of 16, and more


def hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' own fp64 forward of `ids`: row p scores token p + 1."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)


@pytest.mark.parametrize("mode", [Mode.SPECPIPE, Mode.SPECINFER, Mode.PP])
def test_prompt_logprobs_are_the_targets_own_even_after_a_prefix_cache_hit(llama_dir, mode):
    """Every prompt token after the first gets log_softmax of the target's raw logits at
    the position before it, with its top 4: over several prefill chunks (the last chunk's
    last row waits for the first root's token), and for a request whose prompt the
    prefix cache holds (its prefill is then computed whole, not served from the cache)."""
    dep = build_local(llama_dir, 3, ORACLE_DRAFT, torch.float64)
    engine = LockstepEngine(dep.pipeline, dep.draft)
    plain = DecodeOptions(4, width=3, prefill_chunk=7)
    first = engine.add(LONG_PROMPT, mode, plain)
    while engine.runs:
        engine.step()
    opts = DecodeOptions(4, width=3, prefill_chunk=7, logprobs=2, prompt_logprobs=4)
    run = engine.add(LONG_PROMPT, mode, opts)
    assert run.controller.cached_prefix == 32  # the cache holds two blocks of the prompt
    while engine.runs:
        engine.step()
    assert run.tokens == first.tokens
    found = run.controller.out.prompt_logprobs
    want = hf_logprobs(llama_dir, LONG_PROMPT + run.tokens)
    assert found is not None and len(found) == len(LONG_PROMPT) - 1
    for p, lp in enumerate(found):
        assert lp.logprob == pytest.approx(float(want[p, LONG_PROMPT[p + 1]]), abs=1e-9)
        top = torch.topk(want[p], 4)
        assert list(lp.top_ids) == top.indices.tolist()
        assert list(lp.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-9)
    # The output's own logprobs go on after the prompt's.
    for i, lp in enumerate(run.controller.out.logprobs):
        token = run.tokens[i]
        assert lp.logprob == pytest.approx(float(want[len(LONG_PROMPT) - 1 + i, token]), abs=1e-9)


def test_a_one_token_prompt_has_no_prompt_logprobs(llama_dir) -> None:
    dep = build_local(llama_dir, 2, None, torch.float64)
    opts = DecodeOptions(3, prompt_logprobs=0)
    gen = LockstepGeneration(dep.pipeline, None, [5], Mode.PP, opts)
    gen.run()
    assert gen.controller.out.prompt_logprobs == () and len(gen.output) == 3


def test_the_verifier_refuses_prompt_logprobs_of_rows_it_never_computed() -> None:
    """A prefill that started after a cached prefix left rows with no logits here: a
    clear error, not logprobs with holes."""
    spec = VerifySpec(SamplingParams(), output_start=4, prompt_logprobs=1)
    v = RequestVerifier("r", spec, lambda h: h, prefix_tokens=[1, 2, 3])
    hidden = torch.zeros(1, VOCAB, dtype=torch.float64)
    v.on_output(Activation("r", torch.tensor([2]), committed=True, hidden=hidden))  # row 2 only
    with pytest.raises(ValueError, match=r"positions 0\.\.1 were not computed"):
        v.on_output(rows([0], [-1], [9], [4], position=3))
