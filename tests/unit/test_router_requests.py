"""A client request's tree options become the request's DecodeOptions (the router's
`plan_request`): layers per step, token source and ranking."""

from __future__ import annotations

import grpc
import pytest
from specpipe.services.router.backends import ModelInfo
from specpipe.services.router.requests import InvalidRequest, plan_request
from specpipe.v1 import generation_pb2 as gen

MODEL = ModelInfo("m", "h", num_layers=4, vocab_size=100, max_positions=256, eos_token_ids=())


def plan(has_draft: bool = True, **fields):
    r = gen.GenerateRequest(max_new_tokens=8, **fields)
    return plan_request(r, MODEL, [1, 2, 3], has_draft)


def test_defaults_and_given_tree_options() -> None:
    opts = plan().opts
    assert (opts.layers_per_step, opts.token_source, opts.ranking) == (1, "draft", "target")
    opts = plan(layers_per_step=3, token_source="hybrid", ranking="beam").opts
    assert (opts.layers_per_step, opts.token_source, opts.ranking) == (3, "hybrid", "beam")


def test_the_ngram_source_needs_no_draft() -> None:
    assert plan(False, token_source="ngram").opts.token_source == "ngram"
    with pytest.raises(InvalidRequest) as e:
        plan(False, token_source="hybrid")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(
    "fields",
    [
        {"layers_per_step": 0},
        {"layers_per_step": 99},
        {"token_source": "x"},
        {"ranking": "best"},
    ],
)
def test_bad_tree_options_are_invalid_arguments(fields) -> None:
    with pytest.raises(InvalidRequest) as e:
        plan(**fields)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
