"""A resumed request (`Controller.resume`): the output tokens a client already holds go
in before `start`, and the rest of the output is exactly the uninterrupted request's, in
every mode, greedy and sampled; the accounting counts the re-prefill as the prefill."""

from __future__ import annotations

import pytest
from specpipe.common.runtime.lockstep import LockstepEngine
from specpipe.common.spec.commands import DraftOpen, Feed, Finish
from specpipe.common.spec.controller import make_controller
from specpipe.common.spec.options import DecodeOptions, Mode, check_resume_ids
from specpipe.common.spec.sampling import SamplingParams

from .test_controller import PROMPT, RuleDraft, RulePipeline, SoftRulePipeline, plain_decoding


def decode(pipeline, mode, opts, resume=(), stages=3) -> tuple[list[int], object]:
    """The output of one request on the lockstep engine, resumed after `resume`."""
    pipe = pipeline(stages)
    ctrl = make_controller(mode, "r", PROMPT, opts, pipe.num_stages)
    ctrl.resume(resume)
    engine = LockstepEngine(pipe, RuleDraft())
    run = engine.add_controller(ctrl)
    while engine.runs:
        engine.step()
    return run.tokens, ctrl.stats


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("at", [1, 5, 13])
def test_a_resume_continues_the_greedy_output_exactly(mode, at) -> None:
    opts = DecodeOptions(20, width=3, prefill_chunk=4)
    full, _ = decode(RulePipeline, mode, opts)
    assert full == plain_decoding(PROMPT, 20)
    out, stats = decode(RulePipeline, mode, opts, full[:at])
    assert out == full
    assert stats.resumed_tokens == at and stats.new_tokens == 20 - at and stats.replays == 0


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("seed", [1, 7])
def test_a_resume_continues_seeded_sampling_exactly(mode, seed) -> None:
    opts = DecodeOptions(16, SamplingParams(temperature=1.0, seed=seed), width=3)
    full, _ = decode(SoftRulePipeline, mode, opts)
    other, _ = decode(SoftRulePipeline, mode, DecodeOptions(16, SamplingParams(1.0, seed=seed + 1)))
    assert other != full  # the draws really depend on the seed
    for at in (1, 6, 15):
        assert decode(SoftRulePipeline, mode, opts, full[:at])[0] == full


def test_the_resume_prefills_prompt_and_resumed_tokens_then_roots_at_the_last() -> None:
    c = make_controller(Mode.SPECPIPE, "r", [5, 6, 7], DecodeOptions(8, prefill_chunk=2), 2)
    c.resume([9, 4])
    cmds = c.start()
    (draft_open,) = [x for x in cmds if isinstance(x, DraftOpen)]
    assert draft_open.prompt == [5, 6, 7, 9, 4]
    feeds = [x for x in cmds if isinstance(x, Feed)]
    assert [f.act.tokens.tolist() for f in feeds] == [[5, 6], [7, 9], [4]]
    assert [f.act.committed for f in feeds] == [True, True, False]
    assert feeds[-1].act.positions.tolist() == [4]
    assert [f.step for f in feeds] == [-2, -1, 0]  # the prefill, as a fresh request's
    assert c.stats.prefill_steps == 2 and c.stats.replays == 0
    assert c.committed_before_root == [5, 6, 7, 9]
    assert c.verify_spec.output_start == 3  # draws stay at output positions


def test_a_resume_of_a_finished_output_finishes_at_once() -> None:
    c = make_controller(Mode.PP, "r", [5, 6], DecodeOptions(3, stop_token_ids=(2,)), 2)
    c.resume([9, 2])
    assert c.start() == [Finish("stop")] and c.done and c.tokens == [9, 2]
    c = make_controller(Mode.PP, "r", [5, 6], DecodeOptions(2), 2)
    c.resume([9, 8])
    assert c.start() == [Finish("length")]


def test_resume_comes_before_start() -> None:
    c = make_controller(Mode.PP, "r", [5, 6], DecodeOptions(3), 2)
    c.start()
    with pytest.raises(RuntimeError, match="before start"):
        c.resume([1])


@pytest.mark.parametrize(
    "ids, match",
    [([1, 99], "outside the vocabulary"), ([1] * 5, "more than max_new_tokens"),
     ([1, 7, 2], "stop token")],
)  # fmt: skip
def test_resume_ids_a_request_cannot_have_are_refused(ids, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_resume_ids(ids, 50, 4, (7,))
    check_resume_ids([1, 2, 7], 50, 4, (7,))  # a stop token may end them
