"""Structured output is lossless with respect to the constrained distribution: every mode
(specpipe with every token source and several layers per step, pp, specinfer,
autoregressive; greedy and seeded sampling) emits exactly the tokens of plain
constrained decoding of the target (transformers' model, the grammar library's mask
applied to each step's logits), also across a replay onto a fresh path; the output
validates against its schema; and no tree node the grammar forbids is ever grown."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
from collections import deque
from pathlib import Path

import jsonschema
import llguidance
import numpy as np
import pytest
import torch
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
from specpipe.common.runtime.lockstep import LockstepEngine, LockstepGeneration, Run, new_controller
from specpipe.common.spec.grammar import Grammar, ResponseFormat, load_grammar_tokenizer
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.sampling import SamplingParams, draw_index
from transformers import AutoModelForCausalLM

from tests.integration.conftest import add_char_tokenizer

EOS, VOCAB = 96, 97  # the char tokenizer's </s> and vocabulary
PROMPT = [ord(c) - 31 for c in "JSON please: "]
# Compact JSON (no free whitespace), so a random model's output ends well within the
# tokens allowed; bounded strings and numbers for the same reason.
OBJECT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
ARRAY = {
    "type": "array",
    "items": {"enum": ["red", "green", "blue"]},
    "minItems": 1,
    "maxItems": 3,
    "x-guidance": {"whitespace_flexible": False},
}
FORMATS = {
    "object": ResponseFormat("json_schema", json.dumps(OBJECT)),
    "array": ResponseFormat("json_schema", json.dumps(ARRAY)),
    "json_object": ResponseFormat("json_object"),
}
SCHEMAS = {"object": OBJECT, "array": ARRAY, "json_object": {"type": "object"}}
SAMPLING = {"greedy": SamplingParams(), "T0.9": SamplingParams(temperature=0.9, seed=3),
            "T1.2k20p0.9": SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=8)}  # fmt: skip
MAX_TOKENS = 48
# (mode, stages, token source, layers per step)
RUNS = [
    (Mode.AUTOREGRESSIVE, 1, None, 1),
    (Mode.PP, 2, None, 1),
    (Mode.SPECPIPE, 3, "oracle", 1),
    (Mode.SPECPIPE, 2, "unrelated", 2),
    (Mode.SPECPIPE, 3, "ngram", 3),
    (Mode.SPECPIPE, 2, "oracle", 3),
    (Mode.SPECINFER, 2, "unrelated", 1),
    (Mode.SPECINFER, 3, "oracle", 1),
]


@pytest.fixture(scope="module")
def target(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama test model with the char tokenizer."""
    d = tmp_path_factory.mktemp("llama_grammar")
    for f in llama_dir.iterdir():
        shutil.copy(f, d / f.name)
    return add_char_tokenizer(d)


def grammar_of(target: Path, name: str) -> Grammar:
    text = FORMATS[name].grammar_text()
    assert text is not None
    return Grammar(text, load_grammar_tokenizer(str(target), VOCAB, (EOS,)))


@functools.cache
def plain_constrained(target: Path, name: str, sampling: SamplingParams) -> list[int]:
    """Plain constrained decoding of the target: transformers' model in fp64 over the
    whole sequence at each step, the grammar library's own matcher masking the logits
    (every forbidden token at -inf), the token drawn by the sampling rule."""
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    g = grammar_of(target, name)
    matcher = llguidance.LLMatcher(g.tokenizer, g.text)
    seq, out = list(PROMPT), []
    with torch.no_grad():
        while len(out) < MAX_TOKENS:
            logits = hf(torch.tensor([seq])).logits[0, -1]
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[:VOCAB].astype(bool)
            allowed_logits = logits.masked_fill(~torch.from_numpy(allowed), -math.inf)
            token = int(draw_index(allowed_logits, sampling, len(out)))
            assert matcher.consume_token(token)
            out.append(token)
            seq.append(token)
            if token == EOS:
                break
    return out


def draft_of(source: str | None, request) -> str | Path | None:
    if source in (None, "ngram"):
        return None
    return ORACLE_DRAFT if source == "oracle" else request.getfixturevalue("unrelated_draft_dir")


def options(target: Path, name: str, sampling: SamplingParams, source, k: int) -> DecodeOptions:
    return DecodeOptions(
        max_new_tokens=MAX_TOKENS,
        sampling=sampling,
        width=4,
        prefill_chunk=5,
        layers_per_step=k,
        token_source="ngram" if source == "ngram" else "draft",
        grammar=grammar_of(target, name),
    )


@pytest.mark.parametrize("sampling", list(SAMPLING), ids=list(SAMPLING))
@pytest.mark.parametrize("name", list(FORMATS))
def test_every_mode_emits_plain_constrained_decoding(target, name, sampling, request) -> None:
    expect = plain_constrained(target, name, SAMPLING[sampling])
    # The bounded schemas complete (the grammar allows only EOS then, which ends the
    # output) and validate; any JSON object may run to max_tokens under a random model.
    complete = expect[-1] == EOS
    assert complete or name == "json_object"
    if complete:
        document = json.loads(bytes(t + 31 for t in expect[:-1]).decode())
        jsonschema.validate(document, SCHEMAS[name])
    for mode, stages, source, k in RUNS:
        dep = build_local(target, stages, draft_of(source, request), torch.float64)
        opts = options(target, name, SAMPLING[sampling], source, k)
        gen = LockstepGeneration(dep.pipeline, dep.draft, PROMPT, mode, opts)
        gen.run()
        assert gen.output == expect, f"{mode} S={stages} {source} K={k}"
        assert gen.stats.finish_reason == ("stop" if complete else "length")


def test_max_tokens_cuts_the_output_short_with_finish_reason_length(target) -> None:
    expect = plain_constrained(target, "object", SAMPLING["greedy"])
    dep = build_local(target, 2, ORACLE_DRAFT, torch.float64)
    opts = DecodeOptions(max_new_tokens=5, width=4, grammar=grammar_of(target, "object"))
    gen = LockstepGeneration(dep.pipeline, dep.draft, PROMPT, Mode.SPECPIPE, opts)
    assert gen.run() == expect[:5] and gen.stats.finish_reason == "length"


@pytest.mark.parametrize("replay_after", [0, 3, 11])
def test_a_replay_continues_under_the_grammar(target, replay_after) -> None:
    """The path is lost after some tokens: a fresh pipeline's last stage is opened with
    the grammar and the output so far (`VerifySpec.grammar_consumed`) and goes on exactly
    as plain constrained decoding."""
    sampling = SAMPLING["T0.9"]
    expect = plain_constrained(target, "object", sampling)
    dep = build_local(target, 3, ORACLE_DRAFT, torch.float64)
    opts = options(target, "object", sampling, "oracle", 2)
    engine = LockstepEngine(dep.pipeline, dep.draft)
    ctrl = new_controller(dep.pipeline, PROMPT, Mode.SPECPIPE, opts)
    run = engine.add_controller(ctrl)
    while len(ctrl.tokens) < replay_after:
        engine.step()
    engine.release(run)  # the old path is gone
    fresh = build_local(target, 3, ORACLE_DRAFT, torch.float64)
    again = LockstepEngine(fresh.pipeline, fresh.draft)
    spec = ctrl.verify_spec
    assert spec.grammar_consumed == tuple(ctrl.tokens)
    ctrl.cached_prefix = fresh.pipeline.open(
        ctrl.request_id, ctrl.capacity, ctrl.committed_before_root, verify=spec
    )
    again.runs[ctrl.request_id] = Run(ctrl, deque(ctrl.replay(uses_draft=True)))
    while again.runs:
        again.step()
    assert ctrl.tokens == expect and ctrl.stats.replays == 1


@pytest.mark.parametrize(
    ("mode", "k"), [(Mode.SPECPIPE, 1), (Mode.SPECPIPE, 3), (Mode.SPECINFER, 1)]
)
def test_no_tree_node_the_grammar_forbids_is_ever_grown(
    target, unrelated_draft_dir, mode, k
) -> None:
    """An unrelated draft proposes mostly tokens the grammar forbids; after every step,
    each node of the tree is a token the grammar allows after the output and the node's
    path (the tree still grows: nodes the grammar allows are kept)."""
    dep = build_local(target, 3, unrelated_draft_dir, torch.float64)
    g = grammar_of(target, "object")
    opts = DecodeOptions(max_new_tokens=MAX_TOKENS, width=8, layers_per_step=k, grammar=g)
    engine = LockstepEngine(dep.pipeline, dep.draft)
    ctrl = new_controller(dep.pipeline, PROMPT, mode, opts)
    engine.add_controller(ctrl)
    grown = 0
    while engine.runs:
        engine.step()
        if ctrl.done:  # the last tree stays as it was: nothing grows after the end
            break
        tree, state = ctrl.tree, g.state(ctrl.tokens)
        for node in range(1, len(tree)):
            path = tree.tokens[tree.path_to(node)[1:]].tolist()
            assert state.allows(path[:-1], path[-1]), f"node {path} after {ctrl.tokens}"
        grown = max(grown, len(tree) - 1)
    assert grown > 0 and ctrl.tokens == plain_constrained(target, "object", SamplingParams())


TAGGED = {
    "type": "object",
    "properties": {"kind": {"const": "point"}, "label": {"enum": ["north", "south"]},
                   "x": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["kind", "label", "x"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}  # fmt: skip


@pytest.mark.parametrize("sampling", ["greedy", "T0.9"])
def test_forced_tokens_are_lossless_and_sure_hits(target, sampling, request) -> None:
    """Where the grammar allows one token only, the controller puts it in the tree
    without the draft: every mode emits the same tokens with and without it (plain
    constrained decoding), and with it those tokens are hits whatever the draft
    proposed (an unrelated draft, the n-gram source)."""
    FORMATS["tagged"] = ResponseFormat("json_schema", json.dumps(TAGGED))
    try:
        expect = plain_constrained(target, "tagged", SAMPLING[sampling])
        for mode, stages, source, k in RUNS:
            got = {}
            for forced in (True, False):
                dep = build_local(target, stages, draft_of(source, request), torch.float64)
                opts = options(target, "tagged", SAMPLING[sampling], source, k)
                opts = dataclasses.replace(opts, forced_tokens=forced)
                gen = LockstepGeneration(dep.pipeline, dep.draft, PROMPT, mode, opts)
                assert gen.run() == expect, f"{mode} S={stages} {source} K={k} forced={forced}"
                got[forced] = gen.stats
            assert got[False].forced_hits == 0
            if mode in (Mode.SPECPIPE, Mode.SPECINFER):
                # '{"kind":"point","label":"' and more: many tokens are forced.
                assert got[True].forced_hits >= 10, (mode, source, k)
                assert got[True].hits >= got[True].forced_hits
                if source == "unrelated":
                    assert got[True].hits > got[False].hits
            else:  # no tree to put them in
                assert got[True].forced_hits == 0
    finally:
        del FORMATS["tagged"]
