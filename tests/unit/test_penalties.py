"""The logits rules one draw applies (`common/spec/penalties.py`): equal to transformers'
own logits processors where it has them (repetition penalty, min new tokens, a bias per
token), to the dense reference of the decoding tests for every combination, sparse
counts that grow with the output, and the checks of the parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from specpipe.common.runtime.verifier import RequestVerifier
from specpipe.common.spec.messages import Activation
from specpipe.common.spec.options import DecodeOptions, check_logit_bias
from specpipe.common.spec.penalties import LogitsRules, TokenCounts
from specpipe.common.spec.sampling import SamplingParams
from specpipe.common.spec.verify import VerifySpec
from specpipe.services.control import verify_spec_from_proto, verify_spec_to_proto
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from tests.penalty_reference import rules_applied

VOCAB = 211


def history(seed: int, n_prompt: int = 30, n_output: int = 40) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, n_prompt).tolist(), rng.integers(0, 60, n_output).tolist()


def logits(seed: int, dtype=torch.float64) -> torch.Tensor:
    return (torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)


def rules_of(sampling: SamplingParams, prompt, output, min_tokens=0, stops=()) -> LogitsRules:
    spec = VerifySpec(sampling, len(prompt), min_tokens=min_tokens, stop_token_ids=tuple(stops))
    return spec.rules([*prompt, *output])


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_transformers(penalty) -> None:
    prompt, output = history(1)
    x = logits(2)
    got = rules_of(SamplingParams(repetition_penalty=penalty), prompt, output).apply(x, 40)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    want = hf(torch.tensor([prompt + output]), x[None].clone())[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_min_tokens_is_transformers_min_new_tokens() -> None:
    prompt, _ = history(3, n_output=0)
    stops = [7, 96, 150]
    x = logits(4)
    hf = MinNewTokensLengthLogitsProcessor(len(prompt), 5, stops)
    for produced in range(8):
        out = list(range(produced))
        got = rules_of(SamplingParams(), prompt, out, 5, stops).apply(x, produced)
        want = hf(torch.tensor([prompt + out]), x[None].clone())[0]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert math.isinf(got[96]) == (produced < 5)


def test_logit_bias_is_transformers_sequence_bias_of_single_tokens() -> None:
    bias = {3: 2.5, 10: -100.0, 200: 7.25}
    x = logits(5)
    got = rules_of(SamplingParams(logit_bias=bias), [1, 2], []).apply(x, 0)
    hf = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    want = hf(torch.tensor([[1, 2]]), x[None].clone())[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_frequency_and_presence_follow_openai_formula() -> None:
    prompt, output = [5, 6], [9, 9, 9, 4, 5]
    x = logits(6)
    got = rules_of(SamplingParams(frequency_penalty=0.5, presence_penalty=1.25), prompt, output)
    y = got.apply(x, len(output))
    expect = x.clone()
    expect[9] -= 0.5 * 3 + 1.25
    expect[4] -= 0.5 + 1.25
    expect[5] -= 0.5 + 1.25  # in the output (the prompt's alone would not count)
    torch.testing.assert_close(y, expect, rtol=0, atol=0)
    assert y[6] == x[6]  # a prompt-only token: no frequency or presence penalty


COMBINATIONS = [
    dict(repetition_penalty=1.7, frequency_penalty=-0.8, presence_penalty=2.0),
    dict(repetition_penalty=0.3, logit_bias={0: 1.0, 59: -5.5, 100: 100.0}),
    dict(frequency_penalty=2.0, logit_bias={7: 3.0}),
    dict(repetition_penalty=1.1, frequency_penalty=0.4, presence_penalty=-1.0,
         logit_bias={12: 4.0}),
]  # fmt: skip


@pytest.mark.parametrize("params", COMBINATIONS)
@pytest.mark.parametrize("min_tokens", [0, 45])
def test_sparse_rules_along_a_path_equal_the_dense_reference(params, min_tokens) -> None:
    """Drawing along a path: the state advanced by every drawn token gives what the
    dense reference computes from the whole history, at every step (the counts outgrow
    their first slots)."""
    sampling = SamplingParams(**params)
    prompt, output = history(7, n_output=5)
    stops = (8, 33)
    rules = rules_of(sampling, prompt, output, min_tokens, stops)
    rng = np.random.default_rng(8)
    for step in range(120):
        x = logits(100 + step)
        got = rules.apply(x, len(output))
        want = rules_applied(x, sampling, prompt, output, min_tokens, stops)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        token = int(rng.integers(0, VOCAB))  # every token: more than the first 64 slots
        rules.drawn(token)
        output.append(token)
    counts = rules.counts
    assert counts is not None and len(counts) > 64
    # bounded by the tokens seen (at most the context), never by the vocabulary per node
    assert len(counts) <= len(set(prompt + output)) and counts._ids.numel() <= 2 * len(counts)


def test_low_precision_logits_are_penalized_in_float32() -> None:
    x = logits(9, torch.bfloat16)
    prompt, output = history(10)
    got = rules_of(SamplingParams(repetition_penalty=1.5), prompt, output).apply(x, 40)
    assert got.dtype == torch.float32 and x.dtype == torch.bfloat16
    want = rules_applied(x.float(), SamplingParams(repetition_penalty=1.5), prompt, output)
    torch.testing.assert_close(got, want.float())


def test_without_rules_the_logits_are_untouched() -> None:
    rules = rules_of(SamplingParams(temperature=0.7, top_k=5), [1, 2, 3], [4])
    x = logits(11)
    assert not rules.active and rules.counts is None and rules.apply(x, 0) is x


def test_min_tokens_under_a_grammar_gives_way_when_only_stops_are_allowed() -> None:
    rules = rules_of(SamplingParams(), [1], [], min_tokens=3, stops=(96,))
    allowed = np.zeros(VOCAB, dtype=bool)
    allowed[[5, 96]] = True
    masked = rules.allowed(allowed, 0)
    assert masked[5] and not masked[96]
    only_eos = np.zeros(VOCAB, dtype=bool)
    only_eos[96] = True
    assert rules.allowed(only_eos, 0)[96]  # a complete output still ends
    assert rules.allowed(allowed, 3)[96]  # min_tokens reached


def test_token_counts_count_the_output_only() -> None:
    counts = TokenCounts([1, 1, 2], [2, 3, 3])
    counts.add(1, output=False)
    counts.add(4)
    assert len(counts) == 4
    x = torch.zeros(6, dtype=torch.float64)
    got = counts.penalize(x, SamplingParams(frequency_penalty=1.0))
    assert got.tolist() == [0.0, 0.0, -1.0, -2.0, -1.0, 0.0]


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (dict(repetition_penalty=0.0), "repetition_penalty must be in"),
        (dict(repetition_penalty=2.01), "repetition_penalty must be in"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty must be in"),
        (dict(frequency_penalty=-2.5), "frequency_penalty must be in"),
        (dict(presence_penalty=float("nan")), "presence_penalty must be in"),
        (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={True: 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={1: float("nan")}), "logit_bias of token 1"),
        (dict(logit_bias={i: 1.0 for i in range(301)}), "at most 300"),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(params, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params)


def test_logit_bias_is_clamped_read_only_and_checked_against_the_vocabulary() -> None:
    sp = SamplingParams(logit_bias={3: 250.0, 4: -1e9, 5: 1.5})
    assert sp.logit_bias == {3: 100.0, 4: -100.0, 5: 1.5}
    with pytest.raises(TypeError):
        sp.logit_bias[3] = 1.0  # type: ignore[index]
    assert hash(sp) == hash(SamplingParams(logit_bias={5: 0.0}))  # hashable all the same
    check_logit_bias(sp, 6)
    with pytest.raises(ValueError, match=r"logit_bias token ids \[5\] are outside"):
        check_logit_bias(sp, 5)


def test_min_tokens_is_bounded_by_max_new_tokens() -> None:
    DecodeOptions(max_new_tokens=4, min_tokens=4)
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="min_tokens must be in"):
            DecodeOptions(max_new_tokens=4, min_tokens=bad)


def test_the_rules_travel_to_the_last_stage_and_back() -> None:
    sampling = SamplingParams(0.5, 3, 0.9, 4, 1.25, -0.5, 0.75, {3: 2.0, 9: -100.0})
    spec = VerifySpec(sampling, 7, min_tokens=5, stop_token_ids=(96, 3))
    back = verify_spec_from_proto(verify_spec_to_proto(spec))
    assert back == spec and back.sampling.logit_bias == {3: 2.0, 9: -100.0}
    plain = VerifySpec(SamplingParams(), 7)
    assert verify_spec_from_proto(verify_spec_to_proto(plain)) == plain


def test_a_verifier_without_the_committed_tokens_refuses_to_penalize() -> None:
    """The penalties need the prompt: a stage opened without the prefix tokens (the
    first root then lies beyond them) fails the request instead of drawing wrong."""
    spec = VerifySpec(SamplingParams(repetition_penalty=1.2), 4)
    verifier = RequestVerifier("r", spec, lambda h: h, prefix_tokens=())
    act = Activation(
        request_id="r",
        hidden=torch.zeros(1, VOCAB, dtype=torch.float64),
        positions=torch.tensor([3]),
        node_ids=torch.tensor([1]),
        parent_ids=torch.tensor([-1]),
    )
    act.row_tokens = torch.tensor([5])
    with pytest.raises(ValueError, match="prefix_token_ids"):
        verifier.on_output(act)


def test_growth_rules_reweight_proposals_along_their_paths() -> None:
    """The tree: root (last output token 5), child a = 7 below it. Candidates below a:
    7 (already on the path: frequency), 9 (biased), 96 (a stop token min_tokens holds
    back at this depth) and 11; below the root: 7 and 11. Each parent's mass is kept."""
    from specpipe.common.spec.penalties import GrowthRules
    from specpipe.common.spec.tree import TokenTree

    tree = TokenTree(5)
    tree.append_layer(np.array([0]), np.array([7]), np.array([0.5]), 4)
    sampling = SamplingParams(frequency_penalty=1.0, logit_bias={9: 1.0})
    rules = GrowthRules(sampling, prompt=[1, 2], min_tokens=4, stop_token_ids=(96,))
    rules.emitted([4, 5])  # two output tokens: the root's draw is output token 2
    parents = np.array([1, 1, 1, 1, 0, 0])
    tokens = np.array([7, 9, 96, 11, 7, 11])
    probs = np.array([0.4, 0.2, 0.2, 0.1, 0.5, 0.3])
    got = rules.reweighted(tree, parents, tokens, probs)
    assert got[2] == 0.0  # output token 3 would be the stop token: min_tokens is 4
    assert np.isclose(got[:4].sum(), 0.9) and np.isclose(got[4:].sum(), 0.8)
    w = np.array([0.4 * math.exp(-1), 0.2 * math.e, 0.0, 0.1])  # 7 once on the path
    assert np.allclose(got[:4], w * 0.9 / w.sum())
    assert np.allclose(got[4:], probs[4:])  # below the root: 7 not counted yet
    assert GrowthRules.of(SamplingParams(temperature=0.5), [1], 0, (96,)) is None
