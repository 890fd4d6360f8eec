"""Structured output's parts (common/spec/grammar.py): response_format in OpenAI's shape,
schemas the grammar library refuses (a message naming the problem), the grammar's state
(its mask, and the tree paths it allows, which must agree), tree growth pruned by it,
and response_format on the router's and the stages' side (plan_request, VerifySpec)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from specpipe.common.runtime.errors import InvalidInput
from specpipe.common.spec.grammar import (
    Grammar,
    GrammarError,
    ResponseFormat,
    load_grammar_tokenizer,
)
from specpipe.common.spec.growth import allowed_by_grammar
from specpipe.common.spec.messages import Candidates
from specpipe.common.spec.options import DecodeOptions
from specpipe.common.spec.sampling import SamplingParams
from specpipe.common.spec.tree import TokenTree
from specpipe.common.spec.verify import VerifySpec
from specpipe.services.control import verify_spec_from_proto, verify_spec_to_proto
from specpipe.services.router.backends import ModelInfo
from specpipe.services.router.openai_compat import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
)
from specpipe.services.router.requests import InvalidRequest, plan_request
from specpipe.v1 import generation_pb2 as gen

from tests.integration.conftest import add_char_tokenizer

EOS, VOCAB = 96, 97  # the char tokenizer's </s> and vocabulary
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_char_tokenizer(tmp_path_factory.mktemp("chartok"))


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path):
    return load_grammar_tokenizer(str(tokenizer_dir), VOCAB, (EOS,))


def ids(text: str) -> list[int]:
    """The char tokenizer's ids of `text` (printable ASCII: id = code - 31)."""
    return [ord(c) - 31 for c in text]


def grammar(tok, fmt: ResponseFormat) -> Grammar:
    text = fmt.grammar_text()
    assert text is not None
    return Grammar(text, tok)


SCHEMA_FORMAT = ResponseFormat("json_schema", json.dumps(SCHEMA))


# -- response_format -----------------------------------------------------------------------
def test_openai_shapes() -> None:
    assert not ResponseFormat.from_openai(None).constrains
    assert not ResponseFormat.from_openai({"type": "text"}).constrains
    assert ResponseFormat.from_openai({"type": "json_object"}) == ResponseFormat("json_object")
    body = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    fmt = ResponseFormat.from_openai(body)
    assert fmt.type == "json_schema" and json.loads(fmt.schema) == SCHEMA
    assert ResponseFormat.from_openai(json.dumps(body)) == fmt  # a command line's JSON text


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"type": "json"}, "must be one of text, json_object, json_schema"),
        ({"type": "json_schema"}, "needs"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be a JSON object"),
        ("{not json", "not valid JSON"),
        ([1], "must be an object"),
    ],
)
def test_malformed_response_formats_say_why(value, match) -> None:
    with pytest.raises(GrammarError, match=match):
        ResponseFormat.from_openai(value)


@pytest.mark.parametrize(
    ("schema", "match"),
    [
        ({"type": "objec"}, "Invalid type: objec"),
        ({"$ref": "#/nope"}, "/nope"),
        ({"type": "string", "pattern": "("}, "regex parse error"),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "Unsatisfiable schema"),
        ({"type": "string", "format": "no-such-format"}, "Unknown format"),
    ],
)
def test_a_schema_the_library_cannot_use_is_refused_naming_the_problem(schema, match) -> None:
    with pytest.raises(GrammarError, match=match):
        ResponseFormat("json_schema", json.dumps(schema)).grammar_text()


def test_a_schema_too_long_is_refused() -> None:
    with pytest.raises(GrammarError, match="longer than"):
        ResponseFormat("json_schema", " " * (1 << 18 + 1))


# -- the grammar's state -------------------------------------------------------------------
@pytest.mark.parametrize(
    "fmt", [ResponseFormat("json_object"), SCHEMA_FORMAT], ids=["obj", "schema"]
)
def test_the_paths_it_allows_agree_with_its_masks(tok, fmt) -> None:
    """`allows(path, t)` (the tree's pruning, without consuming) equals the mask after
    consuming the path (the draw's), along random outputs of the grammar."""
    g = grammar(tok, fmt)
    rng = random.Random(0)
    for _ in range(6):
        state = g.state()
        for _ in range(30):
            mask = state.allowed(VOCAB)
            assert [state.allows([], t) for t in range(VOCAB)] == mask.tolist()
            ahead, path = state.copy(), []
            for _ in range(3):
                if ahead.done:
                    break
                path.append(rng.choice(np.flatnonzero(ahead.allowed(VOCAB)).tolist()))
                ahead.advance(path[-1:])
            if path and not ahead.done:
                after = ahead.allowed(VOCAB).tolist()
                assert [state.allows(path, t) for t in range(VOCAB)] == after
            token = rng.choice(np.flatnonzero(mask).tolist())
            state.advance([token])
            if token == EOS:
                break


@pytest.mark.parametrize(
    "fmt", [ResponseFormat("json_object"), SCHEMA_FORMAT], ids=["obj", "schema"]
)
def test_the_forced_token_is_the_only_one_its_mask_allows(tok, fmt) -> None:
    """`forced_after(path)` (the controller's forced tokens) is the one token the mask
    allows after the path, None where it allows more; the state stays as it was."""
    g = grammar(tok, fmt)
    rng = random.Random(1)
    for _ in range(4):
        state, out = g.state(), []
        for _ in range(40):
            for cut in range(max(0, len(out) - 4), len(out) + 1):
                base = g.state(out[:cut])
                after = np.flatnonzero(state.allowed(VOCAB)).tolist()
                forced = base.forced_after(out[cut:])
                assert forced == (after[0] if len(after) == 1 else None)
                assert base.allowed(VOCAB).tolist() == g.state(out[:cut]).allowed(VOCAB).tolist()
            token = rng.choice(np.flatnonzero(state.allowed(VOCAB)).tolist())
            state.advance([token])
            out.append(token)
            if token == EOS:
                break


def test_a_complete_output_allows_only_eos(tok) -> None:
    state = grammar(tok, SCHEMA_FORMAT).state(ids('{"name": "ab", "ok": true, "n": 7}'))
    assert state.done and np.flatnonzero(state.allowed(VOCAB)).tolist() == [EOS]
    assert state.allows([], EOS) and not state.allows([], ids(" ")[0])
    logits = torch.arange(VOCAB, dtype=torch.float64)
    constrained = state.constrain(logits)
    assert int(constrained.argmax()) == EOS and torch.isinf(constrained).sum() == VOCAB - 1


def test_a_token_the_grammar_forbids_is_refused(tok) -> None:
    state = grammar(tok, SCHEMA_FORMAT).state()
    with pytest.raises(GrammarError, match="not allowed"):
        state.advance(ids("x"))
    with pytest.raises(GrammarError, match="not allowed"):
        grammar(tok, SCHEMA_FORMAT).state(ids('{"x"'))


def test_ids_beyond_the_tokenizer_are_never_allowed(tokenizer_dir) -> None:
    tok = load_grammar_tokenizer(str(tokenizer_dir), VOCAB + 31, (EOS,))  # a padded LM head
    state = grammar(tok, ResponseFormat("json_object")).state()
    mask = state.allowed(VOCAB + 31)
    assert mask.size == VOCAB + 31 and not mask[VOCAB:].any() and mask[ids("{")[0]]


def test_the_grammars_eos_ends_the_request(tok) -> None:
    opts = DecodeOptions(8, stop_token_ids=(5,), grammar=grammar(tok, SCHEMA_FORMAT))
    assert opts.stop_token_ids == (5, EOS)


# -- tree growth ---------------------------------------------------------------------------
def test_growth_keeps_only_the_children_the_grammar_allows_after_their_path(tok) -> None:
    state = grammar(tok, SCHEMA_FORMAT).state(ids('{"name": "x", "ok":'))
    tree = TokenTree(ids(":")[0])
    layer = tree.append_layer([0, 0], ids("tf"), [0.5, 0.5], width=2)
    t, f = (int(tree.ids[i]) for i in layer)
    # after "t" only "r" (true), after "f" only "a" (false); a child of a node that is
    # not in the tree goes
    children = [(t, "r"), (t, "a"), (t, " "), (f, "r"), (f, "a"), (99, "r")]
    cand = Candidates(
        torch.tensor([p for p, _ in children]),
        torch.tensor([ids(c)[0] for _, c in children]),
        torch.full((len(children),), 0.1),
    )
    kept = allowed_by_grammar(tree, cand, state)
    got = list(zip(kept.parent_ids.tolist(), kept.tokens.tolist(), strict=True))
    assert got == [(t, ids("r")[0]), (f, ids("a")[0])]
    # children of the root: what may follow the output so far (a space or a value)
    root = Candidates(torch.tensor([0, 0, 0]), torch.tensor(ids(" t}")), torch.full((3,), 0.1))
    assert allowed_by_grammar(tree, root, state).tokens.tolist() == ids(" t")


# -- the router and the stages -------------------------------------------------------------
MODEL = ModelInfo("m", "h", num_layers=4, vocab_size=VOCAB, max_positions=256, eos_token_ids=(EOS,))


def plan(tok, **fields):
    r = gen.GenerateRequest(max_new_tokens=8, **fields)
    return plan_request(r, MODEL, [1, 2, 3], True, grammar_tokenizer=tok)


def test_the_router_compiles_response_format(tok) -> None:
    assert plan(tok).opts.grammar is None
    assert plan(tok, response_format=gen.ResponseFormat(type="text")).opts.grammar is None
    opts = plan(tok, response_format=gen.ResponseFormat(type="json_object")).opts
    assert opts.grammar is not None and EOS in opts.stop_token_ids
    fmt = gen.ResponseFormat(type="json_schema", schema=json.dumps(SCHEMA))
    assert plan(tok, response_format=fmt).opts.grammar.text == SCHEMA_FORMAT.grammar_text()


@pytest.mark.parametrize(
    ("fields", "code", "match"),
    [
        ({"response_format": gen.ResponseFormat(type="json_schema", schema='{"type": 7}')},
         grpc.StatusCode.INVALID_ARGUMENT, "response_format: the JSON schema cannot be used"),
        ({"response_format": gen.ResponseFormat(type="json_schema")},
         grpc.StatusCode.INVALID_ARGUMENT, "needs a schema"),
        ({"response_format": gen.ResponseFormat(type="yaml")},
         grpc.StatusCode.INVALID_ARGUMENT, "must be one of"),
        ({"response_format": gen.ResponseFormat(type="json_object"), "ignore_eos": True},
         grpc.StatusCode.INVALID_ARGUMENT, "ignore_eos cannot be combined"),
    ],
)  # fmt: skip
def test_the_router_refuses_what_it_cannot_constrain(tok, fields, code, match) -> None:
    with pytest.raises(InvalidRequest, match=match) as e:
        plan(tok, **fields)
    assert e.value.code == code


def test_a_router_without_a_tokenizer_refuses_response_format() -> None:
    with pytest.raises(InvalidRequest, match="tokenizer") as e:
        plan(None, response_format=gen.ResponseFormat(type="json_object"))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_the_http_body_takes_openais_response_format() -> None:
    body = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format=body)
    chat.check()
    req = chat.to_requests("hi", 16, "specpipe")[0]
    assert req.response_format.type == "json_schema"
    assert json.loads(req.response_format.schema) == SCHEMA
    bad = ChatCompletionRequest(messages=[], response_format={"type": "json_schema"})
    with pytest.raises(ApiError, match="needs") as e:
        bad.check()
    assert e.value.status == 400 and e.value.param == "response_format"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    ChatCompletionRequest(messages=[], tools=tools).check()  # tool_calls.py checks them
    with pytest.raises(ApiError, match="function calling is on /v1/chat") as e:
        CompletionRequest(prompt="x", tools=tools).check()
    assert e.value.status == 400 and e.value.param == "tools"


def test_the_grammar_travels_to_the_last_stage_with_the_output_so_far(tok) -> None:
    g = grammar(tok, SCHEMA_FORMAT)
    spec = VerifySpec(SamplingParams(), 3, None, None, g, tuple(ids('{"na')))
    back = verify_spec_from_proto(verify_spec_to_proto(spec), tok)
    assert back == spec
    state = back.grammar_state()
    assert state is not None and np.flatnonzero(state.allowed(VOCAB)).tolist() == ids("m")
    # a stage without the tokenizer, or an output the grammar refuses: refused at Open
    with pytest.raises(InvalidInput, match="tokenizer"):
        verify_spec_from_proto(verify_spec_to_proto(spec), None)
    wrong = VerifySpec(SamplingParams(), 3, None, None, g, tuple(ids("[")))
    with pytest.raises(InvalidInput, match="not allowed"):
        verify_spec_from_proto(verify_spec_to_proto(wrong), tok)


def test_a_model_directory_without_a_tokenizer_says_so(tmp_path) -> None:
    with pytest.raises(GrammarError, match="has none"):
        load_grammar_tokenizer(str(tmp_path), VOCAB, (EOS,))


def test_a_byte_level_bpe_tokenizer_is_read_from_its_json(tmp_path) -> None:
    """Real models' tokenizers (byte-level BPE: tokens that are parts of characters) are
    read by the library from tokenizer.json, not token by token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(['{"name": "Ada", "age": 36}', "héllo wörld"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    eos = tok.token_to_id("<eos>")
    lt = load_grammar_tokenizer(str(tmp_path), 320, (eos,))
    assert lt.is_canonical and lt.eos_tokens == [eos]
    state = Grammar(SCHEMA_FORMAT.grammar_text() or "", lt).state()
    doc = tok.encode('{"name": "Ada", "ok": true, "n": 36}').ids
    state.advance(doc)
    assert state.done and np.flatnonzero(state.allowed(320)).tolist() == [eos]
