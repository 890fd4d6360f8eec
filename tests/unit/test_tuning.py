"""The router's `auto` settings (common/perf/tuning.py): every candidate is measured on
live requests first, then the least expected time per token wins, priced with the cost
curves; measurements fade and stale settings are re-measured."""

from __future__ import annotations

import pytest
from specpipe.common.perf.cost_model import CostCurve, DeploymentCosts
from specpipe.common.perf.tuning import AUTO_WIDTHS, NO_DRAFT, Setting, Tuner, TuningSpace
from specpipe.common.spec.options import TokenSource

ROWS = [1, 2, 4, 8, 16, 32, 64]
DRAFT, NGRAM = TokenSource.DRAFT, TokenSource.NGRAM


def curve(per_row: float, base: float = 0.01) -> CostCurve:
    return CostCurve(ROWS, [base + per_row * n for n in ROWS])


def costs(stage_per_row: float, draft: CostCurve | None = None) -> DeploymentCosts:
    return DeploymentCosts(128, [curve(stage_per_row)] * 3, draft)


def layers_space(**kw) -> TuningSpace:
    return TuningSpace(width=4, layers_per_step=None, token_source=DRAFT, has_draft=True, **kw)


def calibrate(tuner: Tuner, space: TuningSpace, tokens_per_step: dict[int, float]) -> None:
    """Serve requests until no setting is short of calibration tokens."""
    for _ in range(50):
        d = tuner.decide(space, 64)
        if not d.exploring:
            tuner.finish(d.setting, 64)  # a request served with the choice: not measured
            return
        k = d.setting.layers_per_step
        tuner.finish(d.setting, 64, 64, round(64 / tokens_per_step[k]), 60)
    raise AssertionError("calibration never ended")


def test_every_candidate_is_measured_before_one_is_chosen() -> None:
    tuner = Tuner(costs(0.0), calibration_tokens=64, price="model")
    space = layers_space()
    # Three requests in flight at once get three different settings.
    firsts = [tuner.decide(space, 64) for _ in range(3)]
    assert all(d.exploring for d in firsts)
    assert sorted(d.setting.layers_per_step for d in firsts) == [1, 2, 3]
    assert "measuring" in firsts[0].reason


def test_flat_costs_choose_more_layers_and_costly_rows_fewer() -> None:
    measured = {1: 0.9, 2: 1.5, 3: 1.8}  # tokens per step per K
    flat = Tuner(costs(0.0), calibration_tokens=64, price="model")
    calibrate(flat, layers_space(), measured)
    d = flat.decide(layers_space(), 64)
    assert not d.exploring and d.setting.layers_per_step == 3
    assert "K=3" in d.reason.split(";")[0] and "next best W=4 K=2" in d.reason

    # A CPU-like stage: every row costs as much as the base; three layers of rows cost
    # more than they gain.
    steep = Tuner(costs(0.05), calibration_tokens=64, price="model")
    calibrate(steep, layers_space(), measured)
    assert steep.decide(layers_space(), 64).setting.layers_per_step == 1


def test_without_cost_curves_the_most_tokens_per_step_wins_and_says_so() -> None:
    tuner = Tuner(None, calibration_tokens=64, price="model")
    calibrate(tuner, layers_space(), {1: 0.9, 2: 1.5, 3: 1.2})
    d = tuner.decide(layers_space(), 64)
    assert d.setting.layers_per_step == 2
    assert "--measure-costs" in d.reason and "steps/token" in d.reason


def test_the_ngram_source_costs_no_draft_forward() -> None:
    space = TuningSpace(width=4, layers_per_step=1, token_source=None, has_draft=True)
    assert {s.token_source for s in space.settings()} == {*TokenSource, NO_DRAFT}
    expensive_draft = CostCurve(ROWS, [0.2] * len(ROWS))
    tuner = Tuner(costs(0.0, expensive_draft), calibration_tokens=64, price="model")
    rates = {TokenSource.DRAFT: 0.9, TokenSource.HYBRID: 0.95, TokenSource.NGRAM: 0.5}
    rates[NO_DRAFT] = 1 / 3  # pp at S = 3
    for _ in range(20):
        d = tuner.decide(space, 64)
        if not d.exploring:
            break
        tuner.finish(d.setting, 64, 64, round(64 / rates[d.setting.token_source]), 0)
    assert d.setting.token_source == TokenSource.NGRAM  # 0.01/0.5 s beats 0.2/0.95 s
    assert tuner.step_seconds(d.setting) == pytest.approx(0.01 + 0.0)


def test_stale_settings_are_re_measured_and_old_measurements_fade() -> None:
    tuner = Tuner(costs(0.0), calibration_tokens=64, explore_every=5, window_tokens=256)
    calibrate(tuner, layers_space(), {1: 0.9, 2: 1.5, 3: 1.8})
    kinds = []
    for _ in range(10):
        d = tuner.decide(layers_space(), 64)
        kinds.append(d.exploring)
        tuner.finish(d.setting, 64, 64, 40, 50)
    assert kinds.count(True) == 2  # the choice, and every 5th decision a re-measure
    reasons = [tuner.decide(layers_space(), 64).reason for _ in range(5)]
    assert sum("re-measuring" in r for r in reasons) == 1
    for m in tuner.measured.values():
        assert m.tokens <= 256  # faded, never past the window


def test_failed_or_narrowed_requests_measure_nothing_but_free_their_share() -> None:
    tuner = Tuner(None, calibration_tokens=64)
    d = tuner.decide(layers_space(), 64)
    assert tuner.pending == {d.setting: 64}
    tuner.finish(d.setting, 64)  # failed
    assert tuner.pending == {} and tuner.measured == {}
    # the same setting is the one to measure again
    assert tuner.decide(layers_space(), 64).setting == d.setting


def test_fixed_settings_are_not_candidates() -> None:
    space = TuningSpace(width=None, layers_per_step=2, token_source=NGRAM, has_draft=False)
    assert space.settings() == [Setting(w, 2, NGRAM) for w in (2, 4, 8, 16)]
    assert not TuningSpace(4, 1, DRAFT, True).is_auto


def test_bad_tuner_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        Tuner(None, calibration_tokens=0)
    with pytest.raises(ValueError):
        Tuner(None, price="guess")


def test_the_wall_price_goes_by_the_measured_time_between_tokens() -> None:
    """Where the model and the wall clock disagree (the draft's K forwards overlap the
    step in the services), the default price follows the wall clock."""
    tuner = Tuner(costs(0.0, CostCurve(ROWS, [0.06] * len(ROWS))), calibration_tokens=64)
    wall_per_token = {1: 0.16, 2: 0.125, 3: 0.097}  # seconds, as bench_tuning measured
    for _ in range(20):
        d = tuner.decide(layers_space(), 64)
        if not d.exploring:
            break
        k = d.setting.layers_per_step
        tuner.finish(d.setting, 64, 64, round(64 / (0.9, 1.2, 1.7)[k - 1]), 64,
                     63 * wall_per_token[k])  # fmt: skip
    assert d.setting.layers_per_step == 3 and "ms/token measured" in d.reason
    assert tuner.cost_per_token(d.setting) == pytest.approx(0.097)
    # the model would have kept K = 1: K draft forwards of 60 ms one after another make
    # a K x 60 ms step, which more tokens per step do not pay for
    model = {k: tuner.modelled_per_token(Setting(4, k, DRAFT)) for k in (1, 2, 3)}
    assert min(model, key=model.get) == 1


ONE_STAGE = TuningSpace(None, None, None, has_draft=True, widths=(4,), stages=1)


def serve_wall(tuner: Tuner, space: TuningSpace, wall_per_token, requests: int = 60):
    """Serve `requests` requests of 64 tokens, each measuring `wall_per_token(setting)`
    seconds between tokens; the settings the last 10 got."""
    got = []
    for _ in range(requests):
        d = tuner.decide(space, 64)
        s = d.setting
        tokens_per_step = s.layers_per_step * 0.6 if s.uses_tree else 1.0
        steps = round(64 / tokens_per_step)
        tuner.finish(s, 64, 64, steps, 32, 63 * wall_per_token(s))
        got.append(d)
    return got[-10:]


def test_at_one_stage_the_candidates_are_no_draft_and_several_layers_per_step() -> None:
    settings = ONE_STAGE.settings()
    assert settings[0] == Setting.no_draft() and not settings[0].uses_tree
    assert {s.layers_per_step for s in settings[1:]} == {2, 3, 4}
    assert {s.token_source for s in settings[1:]} == set(TokenSource)
    assert {s.layers_per_step for s in TuningSpace(4, None, DRAFT, True, stages=3).settings()} == {
        1,
        2,
        3,
    }


def test_a_draft_that_never_pays_loses_to_no_draft() -> None:
    """The draft's forwards make every step slower than the tokens they add: plain
    decoding (no draft) has the least measured time per token."""

    def wall(s: Setting) -> float:
        if not s.uses_tree:
            return 0.100
        draft = 0.08 * s.layers_per_step if s.uses_draft_model else 0.0
        return (0.1 + draft) / (0.6 * s.layers_per_step) + (0.3 if not s.uses_draft_model else 0)

    last = serve_wall(Tuner(None, calibration_tokens=64), ONE_STAGE, wall)
    chosen = [d.setting for d in last if not d.exploring]
    assert chosen and all(s == Setting.no_draft() for s in chosen)
    assert last[-1].reason.startswith("no draft (pp)") or last[-1].exploring


def test_a_draft_that_pays_wins_over_no_draft() -> None:
    def wall(s: Setting) -> float:
        if not s.uses_tree:
            return 0.100
        draft = 0.01 * s.layers_per_step if s.uses_draft_model else 0.5
        return (0.1 + draft) / (0.6 * s.layers_per_step)

    last = serve_wall(Tuner(None, calibration_tokens=64), ONE_STAGE, wall)
    chosen = [d.setting for d in last if not d.exploring]
    assert chosen and all(s.uses_draft_model and s.layers_per_step == 4 for s in chosen)


def test_candidates_far_behind_the_best_are_not_calibrated_further() -> None:
    """One request measures a candidate; one at over 1.5x the best's cost is not given a
    second calibration request (exploring costs less)."""
    space = TuningSpace(4, None, DRAFT, True, stages=3)
    tuner = Tuner(None, calibration_tokens=128, explore_every=1000)
    wall = {1: 0.1, 2: 0.3, 3: 0.09}
    seen: dict[int, int] = {}
    for _ in range(8):
        d = tuner.decide(space, 64)
        k = d.setting.layers_per_step
        seen[k] = seen.get(k, 0) + 1
        tuner.finish(d.setting, 64, 64, 64, 32, 63 * wall[k])
    assert seen[2] == 1 and seen[1] == 2 and seen[3] >= 2


def test_re_measures_visit_a_candidate_far_behind_only_now_and_then() -> None:
    space = TuningSpace(4, None, DRAFT, True, stages=3)
    tuner = Tuner(None, calibration_tokens=64, explore_every=2)
    wall = {1: 0.1, 2: 0.3, 3: 0.09}
    refreshes = []
    for _ in range(64):
        d = tuner.decide(space, 64)
        k = d.setting.layers_per_step
        if "re-measuring" in d.reason:
            refreshes.append(k)
        tuner.finish(d.setting, 64, 64, 64, 32, 63 * wall[k])
    far = refreshes.count(2)
    assert len(refreshes) >= 28 and 1 <= far <= len(refreshes) // 4 + 1


FULL_ONE_STAGE = TuningSpace(None, None, None, has_draft=True, stages=1)  # 37 candidates


def _calibration(tuner: Tuner, space: TuningSpace, wall_per_token) -> list[Setting]:
    """One request at a time until calibration ends: the settings it measured."""
    tried = []
    for _ in range(len(space.settings()) + 1):
        d = tuner.decide(space, 64)
        if not d.exploring:
            return tried
        s = d.setting
        tried.append(s)
        tuner.finish(s, 64, 64, 32, 32, 63 * wall_per_token(s))
    raise AssertionError("calibration never ended")


def _valley(w0: int, k0: int, source: TokenSource):
    """A time per token lowest at (w0, k0, source), rising away from it."""

    def wall(s: Setting) -> float:
        if not s.uses_tree:
            return 0.100
        far = abs(AUTO_WIDTHS.index(s.width) - AUTO_WIDTHS.index(w0)) + abs(s.layers_per_step - k0)
        return 0.04 + 0.01 * far + (0.0 if s.token_source == source else 0.05)

    return wall


@pytest.mark.parametrize("best", [(2, 4, DRAFT), (16, 2, DRAFT), (8, 3, TokenSource.HYBRID)])
def test_calibration_searches_from_the_middle_and_finds_the_best(best) -> None:
    """Of the 37 candidates at S = 1 calibration measures far fewer, and still ends on
    the best where time per token falls towards it."""
    assert len(FULL_ONE_STAGE.settings()) == 37
    tuner = Tuner(None, calibration_tokens=64)
    tried = _calibration(tuner, FULL_ONE_STAGE, _valley(*best))
    assert len(tried) <= 24 and Setting.no_draft() in tried
    d = tuner.decide(FULL_ONE_STAGE, 64)
    assert d.setting == Setting(*best) and not d.exploring


def test_a_search_never_chooses_worse_than_no_draft() -> None:
    """Every tree is slower than no draft: the choice is no draft, after few requests."""
    tuner = Tuner(None, calibration_tokens=64)
    tried = _calibration(tuner, FULL_ONE_STAGE, lambda s: 0.2 if s.uses_tree else 0.1)
    assert len(tried) <= 5
    assert tuner.decide(FULL_ONE_STAGE, 64).setting == Setting.no_draft()


def test_the_cost_curves_rule_out_settings_that_cannot_win() -> None:
    """A setting whose step costs more than the best's price even at K tokens a step is
    not calibrated."""
    stage = CostCurve(ROWS, [0.01 * n for n in ROWS])  # 10 ms a row
    tuner = Tuner(DeploymentCosts(128, [stage], None), calibration_tokens=64)
    space = TuningSpace(None, 2, DRAFT, has_draft=True, stages=1)
    tried = _calibration(tuner, space, lambda s: 0.1 if not s.uses_tree else 0.012 * s.width)
    # W = 4 (the middle) measures 48 ms a token; W = 8's step costs 160 ms / 2 = 80 ms
    assert Setting(4, 2, DRAFT) in tried and Setting(2, 2, DRAFT) in tried
    assert Setting(8, 2, DRAFT) not in tried and Setting(16, 2, DRAFT) not in tried
