"""The router's side of the tuning (services/router/tuning.py): the no-draft candidate
becomes a `pp` request, the others a specpipe tree, and a request that leaves its growth
unset gets the deployment's (eager where the published draft cost fits the step). Every
request is tracked while it runs: a tuned one that ran beside another setting (tuned or
fixed) is not measured."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from specpipe.common.perf.tuning import Setting, TuningSpace
from specpipe.common.spec.options import DecodeOptions, Growth, Mode
from specpipe.common.spec.sampling import SamplingParams
from specpipe.common.spec.stats import DecodeStats
from specpipe.services.router.backends import ModelInfo
from specpipe.services.router.tuning import RouterTuning
from specpipe.v1 import dataplane_pb2

ROWS = [1, 2, 4, 8, 16, 32, 64, 128]
MODEL = ModelInfo("m", "v1", 4, 100, 256, (), ranges=[(0, 4)])


def replica(seconds: float, layers=(0, 4)) -> SimpleNamespace:
    """A described, healthy replica publishing a flat cost curve."""
    curve = dataplane_pb2.CostCurve(rows=ROWS, seconds=[seconds] * len(ROWS), context=128)
    desc = SimpleNamespace(cost_curve=curve)
    return SimpleNamespace(desc=desc, version="v1", healthy=True, layers=layers)


def backends(stage_s: float, draft_s: float | None) -> SimpleNamespace:
    drafts = [replica(draft_s)] if draft_s is not None else []
    return SimpleNamespace(versions={"v1": MODEL}, stages=[replica(stage_s)], drafts=drafts)


def space(**kw) -> TuningSpace:
    fields = dict(width=None, layers_per_step=None, token_source=None, growth=None)
    return TuningSpace(**{**fields, **kw}, has_draft=True, widths=(4,), stages=1)


OPTS = DecodeOptions(max_new_tokens=16)


def start(tuning: RouterTuning, *args):
    """`tuning.resolve(*args)` for a request admitted at once (it starts running)."""
    mode, opts, tuned = tuning.resolve(*args)
    tuning.started(tuned)
    return mode, opts, tuned


def finished(tuned) -> DecodeStats:
    """A tuned request's stats: 16 tokens in 8 steps with the width it was given."""
    width = tuned.decision.setting.width
    return DecodeStats("specpipe", 1, width, new_tokens=16, decode_steps=8, hits=8)


def test_the_no_draft_candidate_runs_as_pp_and_the_others_as_trees() -> None:
    tuning = RouterTuning(calibration_tokens=16)
    mode, opts, tuned = start(tuning, Mode.SPECPIPE, OPTS, space(), backends(0.1, 0.01), "v1")
    assert tuned.decision.setting == Setting.no_draft() and mode == Mode.PP
    tuning.finish(tuned, finished(tuned), tbt_ms=10.0)  # measured: the next setting
    mode, opts, tuned = start(tuning, Mode.SPECPIPE, OPTS, space(), backends(0.1, 0.01), "v1")
    s = tuned.decision.setting
    assert mode == Mode.SPECPIPE and s.uses_tree and s.layers_per_step >= 2
    assert (opts.width, opts.layers_per_step, opts.token_source) == (
        s.width,
        s.layers_per_step,
        s.token_source,
    )


def test_unset_growth_follows_the_published_costs() -> None:
    tuning = RouterTuning()
    fixed = dict(width=4, layers_per_step=2, token_source="draft")
    for stage_s, draft_s, want in (
        (0.100, 0.020, Growth.EAGER),  # 2 x 20 + 10 ms fit in 75 ms
        (0.020, 0.010, Growth.VERIFIED),  # 2 x 10 + 10 ms do not fit in 15 ms
        (0.100, None, Growth.VERIFIED),  # no draft curve: unknown
    ):
        mode, opts, tuned = start(
            tuning, Mode.SPECPIPE, OPTS, space(**fixed), backends(stage_s, draft_s), "v1"
        )
        assert tuned.decision is None and mode == Mode.SPECPIPE and opts.growth == want
        tuning.finish(tuned, None)
    # a request's growth wins
    asked = space(**fixed, growth=Growth.VERIFIED)
    _, opts, _ = start(tuning, Mode.SPECPIPE, OPTS, asked, backends(0.1, 0.02), "v1")
    assert opts.growth == Growth.VERIFIED


def test_a_tuned_request_beside_a_fixed_one_is_not_measured() -> None:
    tuning = RouterTuning(calibration_tokens=16)
    auto = space()
    b = backends(0.1, 0.01)
    mode, _, tuned = start(tuning, Mode.SPECPIPE, OPTS, auto, b, "v1")
    assert mode == Mode.PP  # calibration measures no draft first
    # a pp request with its own mode runs as the tuner's no-draft setting: not mixed
    _, _, pp = start(tuning, Mode.PP, OPTS, None, b, "v1")
    tuning.finish(pp, None)
    tuning.finish(tuned, finished(tuned), tbt_ms=10.0)
    (tuner,) = tuning.tuners.values()
    assert tuner.measured[tuned.decision.setting].requests == 1 and tuner.mixed == 0
    # the next phase's request starts beside one with fixed settings: mixed
    fixed = space(width=4, layers_per_step=2, token_source="draft")
    _, _, other = start(tuning, Mode.SPECPIPE, OPTS, fixed, b, "v1")
    _, _, tuned = start(tuning, Mode.SPECPIPE, OPTS, auto, b, "v1")
    assert tuned.decision.setting != Setting(4, 2, "draft")
    tuning.finish(tuned, finished(tuned), tbt_ms=10.0)
    tuning.finish(other, None)
    assert tuner.mixed == 1
    arms = {(a.width, a.layers_per_step, a.token_source): a for a in tuning.describe()[0].arms}
    s = tuned.decision.setting
    assert arms[(s.width, s.layers_per_step, str(s.token_source))].mixed_requests == 1
    assert not tuning.versions["v1"].overlaps.live  # every request ended


def test_greedy_and_sampling_requests_share_the_phase_of_their_model_version() -> None:
    """Tokens do not depend on the setting in any regime: a sampling request decided
    while a greedy one of the phase runs gets its setting, and both are measured clean,
    each by its regime's tuner."""
    tuning = RouterTuning(calibration_tokens=16)
    auto, b = space(), backends(0.1, 0.01)
    sampling = replace(OPTS, sampling=SamplingParams(temperature=0.8))
    _, _, first = start(tuning, Mode.SPECPIPE, OPTS, auto, b, "v1")
    tuning.finish(first, finished(first), tbt_ms=10.0)  # greedy has measured no draft
    _, _, greedy = start(tuning, Mode.SPECPIPE, OPTS, auto, b, "v1")
    s = greedy.decision.setting
    assert s.uses_tree  # the greedy tuner's next phase, in flight
    mode, _, other = start(tuning, Mode.SPECPIPE, sampling, auto, b, "v1")
    assert other.key == ("v1", "sampling") and other.decision.setting == s
    assert mode == Mode.SPECPIPE and other.decision.exploring
    tuning.finish(other, finished(other), tbt_ms=10.0)
    tuning.finish(greedy, finished(greedy), tbt_ms=10.0)
    for key in (("v1", "greedy"), ("v1", "sampling")):
        tuner = tuning.tuners[key]
        assert tuner.measured[s].requests == 1 and tuner.mixed == 0


def test_a_request_waiting_in_admission_mixes_no_running_one() -> None:
    """A request with fixed settings decided while a tuned one runs, but queued behind
    it, runs no forward beside it: the tuned one is measured clean. Once it starts, the
    next tuned request beside it is mixed."""
    tuning = RouterTuning(calibration_tokens=16)
    auto, b = space(), backends(0.1, 0.01)
    _, _, tuned = start(tuning, Mode.SPECPIPE, OPTS, auto, b, "v1")
    fixed = space(width=4, layers_per_step=2, token_source="draft")
    _, _, queued = tuning.resolve(Mode.SPECPIPE, OPTS, fixed, b, "v1")  # not admitted yet
    tuning.finish(tuned, finished(tuned), tbt_ms=10.0)
    (tuner,) = tuning.tuners.values()
    assert tuner.mixed == 0 and tuner.measured[tuned.decision.setting].requests == 1
    tuning.started(queued)  # admitted now: it runs
    _, _, beside = start(tuning, Mode.SPECPIPE, OPTS, auto, b, "v1")
    tuning.finish(beside, finished(beside), tbt_ms=10.0)
    tuning.finish(queued, None)
    assert tuner.mixed == 1 and not tuning.versions["v1"].overlaps.live
