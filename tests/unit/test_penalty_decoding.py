"""The logits rules (repetition, frequency and presence penalties, logit bias,
min_tokens) are exact in every mode: specpipe at K = 1-3 with the draft, n-gram and
hybrid sources, pp, specinfer and autoregressive emit exactly the plain reference loop's
tokens (`tests/penalty_reference.py`: transformers' model in fp64, vLLM's definitions
written out densely), greedy and seeded sampling, with and without a grammar, and
across a replay onto a fresh path. The rules depend on the path down the tree, so a
mode that applied them with the committed output's counts only would differ here."""

from __future__ import annotations

import functools
import json
import shutil
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
from specpipe.common.runtime.lockstep import LockstepEngine, LockstepGeneration, Run, new_controller
from specpipe.common.spec.grammar import Grammar, ResponseFormat, load_grammar_tokenizer
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.sampling import SamplingParams

from tests.integration.conftest import add_char_tokenizer
from tests.penalty_reference import plain_decode

PROMPT = [5, 17, 33, 2, 8, 90, 41, 12, 60, 17, 5, 33]
MAX_TOKENS = 24
# the rules, each alone and all together (logit bias on tokens the plain greedy output
# of the test model takes, so that it changes the output)
RULES = {
    "repetition": dict(repetition_penalty=1.6),
    "repetition<1": dict(repetition_penalty=0.6),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=-1.2),
    "bias": dict(logit_bias={10: 6.0, 63: -100.0, 40: 3.5}),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.9,
                logit_bias={10: 4.0, 63: -3.0}),
}  # fmt: skip
SAMPLING = {"greedy": {}, "T0.9": dict(temperature=0.9, seed=3),
            "T1.2k20p0.9": dict(temperature=1.2, top_k=20, top_p=0.9, seed=8)}  # fmt: skip
# (mode, stages, token source, layers per step)
RUNS = [
    (Mode.AUTOREGRESSIVE, 1, None, 1),
    (Mode.PP, 2, None, 1),
    (Mode.SPECPIPE, 3, "oracle", 1),
    (Mode.SPECPIPE, 2, "unrelated", 2),
    (Mode.SPECPIPE, 3, "ngram", 3),
    (Mode.SPECPIPE, 2, "hybrid", 2),
    (Mode.SPECPIPE, 2, "oracle", 3),
    (Mode.SPECINFER, 2, "unrelated", 1),
    (Mode.SPECINFER, 3, "oracle", 1),
]


def sampling_of(rules: str, sampling: str) -> SamplingParams:
    return SamplingParams(**SAMPLING[sampling], **RULES.get(rules, {}))


@functools.cache
def reference(target: Path, sampling: SamplingParams, stops=(), min_tokens=0) -> list[int]:
    return plain_decode(target, PROMPT, sampling, MAX_TOKENS, stops, min_tokens)


def draft_of(source: str | None, request) -> str | Path | None:
    if source in (None, "ngram"):
        return None
    if source in ("oracle", "hybrid"):
        return ORACLE_DRAFT
    return request.getfixturevalue("unrelated_draft_dir")


def run_every_mode(target, request, expect, **opts) -> None:
    for mode, stages, source, k in RUNS:
        dep = build_local(target, stages, draft_of(source, request), torch.float64)
        token_source = source if source in ("ngram", "hybrid") else "draft"
        o = DecodeOptions(max_new_tokens=MAX_TOKENS, width=4, prefill_chunk=5,
                          layers_per_step=k, token_source=token_source, **opts)  # fmt: skip
        gen = LockstepGeneration(dep.pipeline, dep.draft, PROMPT, mode, o)
        assert gen.run() == expect, f"{mode} S={stages} {source} K={k}"


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("rules", list(RULES))
def test_every_mode_emits_the_plain_loop_with_the_rules(llama_dir, rules, sampling, request):
    params = sampling_of(rules, sampling)
    expect = reference(llama_dir, params)
    assert expect != reference(llama_dir, sampling_of("", sampling))  # the rules matter
    run_every_mode(llama_dir, request, expect, sampling=params)


@pytest.mark.parametrize("sampling", ["greedy", "T0.9"])
def test_min_tokens_holds_the_stop_tokens_back_in_every_mode(llama_dir, sampling, request):
    """A stop token the plain output takes early is masked until min_tokens are out:
    the output then stops at its next occurrence, or runs to max_tokens."""
    params = sampling_of("", sampling)
    plain = reference(llama_dir, params)
    stops = (plain[2], plain[4])
    early = reference(llama_dir, params, stops)
    assert len(early) <= 5
    expect = reference(llama_dir, params, stops, 9)
    assert len(expect) >= 9 and not set(expect[:8]) & set(stops)
    run_every_mode(llama_dir, request, expect, sampling=params, stop_token_ids=stops,
                   min_tokens=9)  # fmt: skip


def test_min_tokens_with_the_other_rules(llama_dir, request):
    params = sampling_of("all", "T0.9")
    plain = reference(llama_dir, params)
    stops = (plain[1],)
    expect = reference(llama_dir, params, stops, 6)
    assert expect != reference(llama_dir, params, stops)
    run_every_mode(llama_dir, request, expect, sampling=params, stop_token_ids=stops,
                   min_tokens=6)  # fmt: skip


@pytest.mark.parametrize("sampling", ["greedy", "T0.9"])
@pytest.mark.parametrize("rules", ["all", "repetition"])
@pytest.mark.parametrize("replay_after", [0, 5, 13])
def test_a_replay_stays_exact_with_the_rules(llama_dir, rules, sampling, replay_after):
    """The path is lost after some tokens; the fresh path's last stage is opened with
    the prompt and the output so far (the Open's prefix tokens and the first root) and
    goes on exactly as the plain loop."""
    params = sampling_of(rules, sampling)
    expect = reference(llama_dir, params)
    dep = build_local(llama_dir, 3, ORACLE_DRAFT, torch.float64)
    opts = DecodeOptions(max_new_tokens=MAX_TOKENS, sampling=params, width=4, layers_per_step=2)
    engine = LockstepEngine(dep.pipeline, dep.draft)
    ctrl = new_controller(dep.pipeline, PROMPT, Mode.SPECPIPE, opts)
    run = engine.add_controller(ctrl)
    while len(ctrl.tokens) < replay_after:
        engine.step()
    engine.release(run)  # the old path is gone
    fresh = build_local(llama_dir, 3, ORACLE_DRAFT, torch.float64)
    again = LockstepEngine(fresh.pipeline, fresh.draft)
    ctrl.cached_prefix = fresh.pipeline.open(
        ctrl.request_id, ctrl.capacity, ctrl.committed_before_root, verify=ctrl.verify_spec
    )
    again.runs[ctrl.request_id] = Run(ctrl, deque(ctrl.replay(uses_draft=True)))
    while again.runs:
        again.step()
    assert ctrl.tokens == expect and ctrl.stats.replays == 1


# -- with a grammar ------------------------------------------------------------------------
EOS, VOCAB = 96, 97  # the char tokenizer's </s> and vocabulary
GRAMMAR_PROMPT = [ord(c) - 31 for c in "JSON please: "]
ARRAY = {
    "type": "array",
    "items": {"enum": ["red", "green", "blue", "cyan"]},
    "minItems": 1,
    "maxItems": 4,
    "x-guidance": {"whitespace_flexible": False},
}


@pytest.fixture(scope="module")
def text_target(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("llama_penalties")
    for f in llama_dir.iterdir():
        shutil.copy(f, d / f.name)
    return add_char_tokenizer(d)


def grammar_of(target: Path) -> Grammar:
    text = ResponseFormat("json_schema", json.dumps(ARRAY)).grammar_text()
    assert text is not None
    return Grammar(text, load_grammar_tokenizer(str(target), VOCAB, (EOS,)))


@functools.cache
def grammar_reference(target: Path, sampling: SamplingParams, min_tokens: int) -> list[int]:
    g = grammar_of(target)

    def allowed(output: list[int]) -> np.ndarray:
        return g.state(output).allowed(VOCAB)

    return plain_decode(target, GRAMMAR_PROMPT, sampling, 40, (EOS,), min_tokens, allowed)


@pytest.mark.parametrize("sampling", ["greedy", "T1.2k20p0.9"])
@pytest.mark.parametrize("min_tokens", [0, 30])
def test_the_rules_with_a_grammar_in_every_mode(text_target, sampling, min_tokens, request):
    """Under a grammar the rules apply to the tokens it allows; min_tokens holds the
    end-of-sequence token back only while the grammar allows another (a complete
    output still ends: the grammar wins)."""
    bias = {ord('"') - 31: -2.0, ord("c") - 31: 3.0}
    params = SamplingParams(**SAMPLING[sampling], repetition_penalty=1.4,
                            frequency_penalty=0.5, logit_bias=bias)  # fmt: skip
    expect = grammar_reference(text_target, params, min_tokens)
    assert expect[-1] == EOS
    json.loads(bytes(t + 31 for t in expect[:-1]).decode())
    assert expect != grammar_reference(text_target, SamplingParams(**SAMPLING[sampling]), 0)
    for mode, stages, source, k in RUNS:
        dep = build_local(text_target, stages, draft_of(source, request), torch.float64)
        token_source = source if source in ("ngram", "hybrid") else "draft"
        o = DecodeOptions(max_new_tokens=40, sampling=params, width=4, layers_per_step=k,
                          token_source=token_source, grammar=grammar_of(text_target),
                          min_tokens=min_tokens)  # fmt: skip
        gen = LockstepGeneration(dep.pipeline, dep.draft, GRAMMAR_PROMPT, mode, o)
        assert gen.run() == expect, f"{mode} S={stages} {source} K={k}"
        assert gen.stats.finish_reason == "stop"


# -- the tree's growth under the rules -------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2])
def test_with_frequency_and_presence_the_target_as_its_own_draft_always_hits(llama_dir, k):
    """Frequency and presence penalties shift a log-probability as they shift a logit, so
    the controller's growth, reweighting the draft's proposals by the rules along each
    path, keeps first the child the target's rules choose: with the target as its own
    draft every token is a hit (without the reweighting the draft's own best child is
    kept first, which the target's rules may turn down: a miss at K = 1 here). A token
    the rules lift from beyond the draft's proposals (its top `width`), e.g. by a large
    bias, is a miss still. Exact all the same."""
    params = SamplingParams(frequency_penalty=0.8, presence_penalty=0.6)
    dep = build_local(llama_dir, 3, ORACLE_DRAFT, torch.float64)
    o = DecodeOptions(max_new_tokens=MAX_TOKENS, sampling=params, width=4, layers_per_step=k)
    gen = LockstepGeneration(dep.pipeline, dep.draft, PROMPT, Mode.SPECPIPE, o)
    assert gen.run() == reference(llama_dir, params)
    assert gen.stats.hits == gen.stats.new_tokens
