"""A client request's tree options become the request's DecodeOptions (the router's
`plan_request`): layers per step, token source and ranking, the router's defaults for
what it leaves unset, and which settings are left to the router's tuning (`auto`)."""

from __future__ import annotations

import grpc
import pytest
from specpipe.services.router.backends import ModelInfo
from specpipe.services.router.requests import InvalidRequest, RequestDefaults, plan_request
from specpipe.v1 import generation_pb2 as gen

MODEL = ModelInfo("m", "h", num_layers=4, vocab_size=100, max_positions=256, eos_token_ids=())


def plan(has_draft: bool = True, defaults: RequestDefaults | None = None, **fields):
    r = gen.GenerateRequest(max_new_tokens=8, **fields)
    return plan_request(r, MODEL, [1, 2, 3], has_draft, defaults=defaults)


def test_defaults_and_given_tree_options() -> None:
    opts = plan().opts
    assert (opts.layers_per_step, opts.token_source, opts.ranking) == (1, "draft", "target")
    opts = plan(layers_per_step=3, token_source="hybrid", ranking="beam").opts
    assert (opts.layers_per_step, opts.token_source, opts.ranking) == (3, "hybrid", "beam")
    assert opts.growth == "verified" and plan(growth="eager").opts.growth == "eager"


def test_the_ngram_source_needs_no_draft() -> None:
    assert plan(False, token_source="ngram").opts.token_source == "ngram"
    for fields in ({"token_source": "hybrid"}, {"token_source": "auto", "mode": "specinfer"}):
        with pytest.raises(InvalidRequest) as e:
            plan(False, **fields)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(
    "fields",
    [
        {"layers_per_step": -1},
        {"layers_per_step": 99},
        {"width": -2},
        {"token_source": "x"},
        {"ranking": "best"},
        {"growth": "later"},
    ],
)
def test_bad_tree_options_are_invalid_arguments(fields) -> None:
    with pytest.raises(InvalidRequest) as e:
        plan(**fields)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_zero_or_auto_leaves_a_setting_to_the_router() -> None:
    fixed = plan(width=8, layers_per_step=1, token_source="draft", growth="verified")
    assert fixed.space is None and plan(mode="pp").space is None  # nothing to choose
    space = plan(width=0, layers_per_step=2, token_source="draft").space
    assert (space.width, space.layers_per_step, space.token_source) == (None, 2, "draft")
    space = plan(False, token_source="auto", layers_per_step=0).space
    assert (space.layers_per_step, space.token_source, space.has_draft) == (None, None, False)
    # without a draft the only sources the tuning may pick are the n-grams and none
    assert {s.token_source for s in space.settings()} == {"ngram", "none"}
    assert {s.layers_per_step for s in space.settings()} == {1, 2, 3}


def test_the_routers_defaults_fill_what_a_request_leaves_unset() -> None:
    d = RequestDefaults(width=4, layers_per_step="auto", token_source="hybrid")
    p = plan(defaults=d)
    assert (p.opts.width, p.opts.token_source) == (4, "hybrid")
    assert p.space is not None and p.space.layers_per_step is None
    p = plan(defaults=d, width=2, layers_per_step=3, token_source="draft")  # the request's win
    assert (p.opts.width, p.opts.layers_per_step, p.opts.token_source) == (2, 3, "draft")
    assert not p.space.is_auto and p.space.growth is None  # growth: the deployment's


def test_with_a_draft_the_router_tunes_what_nothing_sets() -> None:
    """Defaults that never lose: a request that sets no tree on a deployment with a draft
    is the tuner's, no draft among the candidates; without a draft it stays as it was."""
    one = ModelInfo("m", "h", 4, 100, 256, (), ranges=[(0, 4)])
    p = plan_request(gen.GenerateRequest(max_new_tokens=8), one, [1, 2, 3], True)
    space = p.space
    assert (space.width, space.layers_per_step, space.token_source, space.growth) == ((None,) * 4)
    settings = space.settings()
    assert settings[0].label() == "no draft (pp)" and settings[0].width == 0
    assert {s.layers_per_step for s in settings[1:]} == {2, 3, 4}  # S = 1: K >= 2
    with pytest.raises(InvalidRequest):  # no draft: specpipe needs one, as before
        plan(False)
    given = plan(token_source="draft").space
    assert given.token_source == "draft" and "none" not in {
        s.token_source for s in given.settings()
    }


@pytest.mark.parametrize(
    "bad", [{"width": 0}, {"layers_per_step": "two"}, {"token_source": "model"}]
)
def test_bad_router_defaults_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        RequestDefaults(**bad)


def test_the_logits_rules_reach_the_requests_options() -> None:
    sampling = gen.SamplingOptions(repetition_penalty=1.5, frequency_penalty=-0.5,
                                   presence_penalty=0.25, logit_bias={7: 200.0, 3: -1.0})  # fmt: skip
    opts = plan(sampling=sampling, min_tokens=4, stop_token_ids=[9]).opts
    sp = opts.sampling
    assert (sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty) == (1.5, -0.5, 0.25)
    assert sp.logit_bias == {7: 100.0, 3: -1.0} and opts.min_tokens == 4
    assert plan().opts.sampling.repetition_penalty == 1.0  # unset: none


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"sampling": gen.SamplingOptions(repetition_penalty=0.0)}, "repetition_penalty"),
        ({"sampling": gen.SamplingOptions(frequency_penalty=2.5)}, "frequency_penalty"),
        ({"sampling": gen.SamplingOptions(presence_penalty=-9)}, "presence_penalty"),
        ({"sampling": gen.SamplingOptions(logit_bias={100: 1.0})}, "logit_bias"),
        ({"sampling": gen.SamplingOptions(logit_bias={-3: 1.0})}, "logit_bias"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_bad_logits_rules_are_invalid_arguments_naming_the_field(fields, name) -> None:
    with pytest.raises(InvalidRequest) as e:
        plan(**fields)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and name in e.value.message
