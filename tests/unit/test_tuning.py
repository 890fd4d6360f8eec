"""The router's `auto` settings (common/perf/tuning.py): every candidate is measured on
live requests first, then the least expected time per token wins, priced with the cost
curves; measurements fade and stale settings are re-measured. With requests in flight
together, settings are measured one at a time (phases) and a request that ran beside
another setting is not measured."""

from __future__ import annotations

import pytest
from specpipe.common.perf.cost_model import CostCurve, DeploymentCosts
from specpipe.common.perf.overlaps import Overlaps
from specpipe.common.perf.tuning import (
    AUTO_WIDTHS,
    CALIBRATING,
    CALIBRATION_PHASES,
    NO_DRAFT,
    RE_MEASURING,
    Setting,
    Shared,
    Tuner,
    TuningSpace,
)
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


@pytest.mark.parametrize("price", ["wall", "model"])
def test_requests_in_flight_together_get_the_setting_being_measured(price) -> None:
    """They share every forward: each would measure the mix, not its own setting."""
    tuner = Tuner(costs(0.0), calibration_tokens=64, price=price)
    space = layers_space()
    firsts = [tuner.decide(space, 64) for _ in range(3)]
    assert all(d.exploring and "measuring" in d.reason for d in firsts)
    assert len({d.setting for d in firsts}) == 1
    # one finishes clean with the calibration tokens: the next phase, another setting
    tuner.finish(firsts[0].setting, 64, 64, 64, 32, 6.3)
    d = tuner.decide(space, 64)
    assert d.exploring and d.setting != firsts[0].setting


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
    reasons = []
    for _ in range(5):
        d = tuner.decide(layers_space(), 64)
        reasons.append(d.reason)
        tuner.finish(d.setting, 64, 64, 40, 50)
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


def test_a_request_beside_another_setting_is_mixed() -> None:
    overlaps = Overlaps()
    a = Setting(4, 2, DRAFT)
    first, second = overlaps.begin(a), overlaps.begin(a)
    assert overlaps.end(first)  # the same setting beside it: clean
    third = overlaps.begin(Setting.no_draft())  # mixes the one still running
    fourth = overlaps.begin(a)
    assert not overlaps.end(second) and not overlaps.end(third)
    assert not overlaps.end(fourth)  # started beside the no-draft one
    assert overlaps.end(overlaps.begin(Setting.no_draft()))  # alone again: clean
    assert not overlaps.end(fourth) and not overlaps.live  # ended twice: nothing


def test_a_queued_request_is_live_only_once_it_starts() -> None:
    """Decided but waiting in admission, a request runs no forward: it mixes none of
    those running, nor is it clean if it never ran."""
    overlaps = Overlaps()
    a, b = Setting(4, 2, DRAFT), Setting.no_draft()
    running, queued = overlaps.begin(a), overlaps.queue(b)
    assert overlaps.live == {a: 1} and overlaps.end(running)  # clean: b waited
    never = overlaps.queue(a)
    overlaps.start(queued)
    assert not overlaps.end(never) and overlaps.live == {b: 1}  # it never ran
    overlaps.start(queued)  # twice: counted once
    assert overlaps.end(queued) and not overlaps.live and not overlaps.tickets


def test_a_mixed_request_is_not_measured_and_does_not_end_its_phase() -> None:
    tuner = Tuner(None, calibration_tokens=64)
    space = layers_space(stages=3)
    d = tuner.decide(space, 64)
    tuner.decide(space, 64)  # in flight beside it
    tuner.finish(d.setting, 64, 64, 64, 32, 6.3, clean=False)
    assert tuner.cost_per_token(d.setting) is None and tuner.mixed == 1
    assert tuner.measured[d.setting].mixed == 1
    assert tuner.decide(space, 64).setting == d.setting  # still measuring it
    # the model price goes by tokens per step, which the batch does not change
    model = Tuner(None, calibration_tokens=64, price="model")
    d = model.decide(space, 64)
    model.finish(d.setting, 64, 64, 32, 32, 6.3, clean=False)
    assert model.cost_per_token(d.setting) == pytest.approx(0.5) and model.mixed == 0


def test_at_one_client_decisions_are_what_they_were_without_phases() -> None:
    """Nothing runs beside a request at one client: every one is measured, and the
    settings come in the order main's tuner gave them (requests of half the calibration
    tokens alternate between settings; re-measures are single requests)."""
    space = TuningSpace(4, None, DRAFT, True, stages=3)
    wall = {1: 0.1, 2: 0.3, 3: 0.09}
    for calibration, explore, want in (
        (128, 1000, [2, 1, 3, 1, 3, 3, 3]),  # (K=2 is 3x the best: not calibrated further)
        (64, 2, [2, 1, 3, 1, 3, 1, 3, 2, 3, 1, 3, 1]),  # re-measures every 2nd decision
    ):
        tuner = Tuner(None, calibration_tokens=calibration, explore_every=explore)
        got = []
        for _ in range(len(want)):
            d = tuner.decide(space, 64)
            got.append(d.setting.layers_per_step)
            tuner.finish(d.setting, 64, 64, 64, 32, 63 * wall[d.setting.layers_per_step])
        assert got == want and tuner.mixed == 0
        assert sum(m.requests for m in tuner.measured.values()) == len(want)


FULL_ONE_STAGE = TuningSpace(None, None, None, has_draft=True, stages=1)  # 37 candidates


def tokens_per_step(s: Setting) -> float:
    """The draft's trees hit; the n-gram source's (random text) hardly."""
    return 0.6 * s.layers_per_step if s.uses_draft_model else 0.9 if s.uses_tree else 1.0


def serve_together(
    tuner: Tuner | list[Tuner],
    space: TuningSpace,
    clients: int,
    requests: int,
    draft_forward: float,
    bystander: Setting | None = None,
    bystander_until: int | None = None,
) -> list:
    """`clients` closed-loop clients of 64-token requests sharing every step: a step
    costs 0.1 s plus the deepest live tree's draft forwards (`draft_forward` each), and
    each request gains its own tokens per step. `Overlaps` says which finished requests
    are clean; `bystander`: a request with fixed settings running all along (or until
    `bystander_until` requests finished). Several tuners (one model version's regimes,
    sharing one `Shared`): client c asks tuner c mod their number. The decisions, in
    order."""
    tuners = tuner if isinstance(tuner, list) else [tuner]
    overlaps = tuners[0].shared.overlaps  # as the router's: the tuners see what is live
    if bystander is not None:
        bystander_ticket = overlaps.begin(bystander)
    finished = 0
    live: list[list] = []  # setting, ticket, tokens, seconds, steps, its tuner
    decisions = []

    def start(client: int) -> None:
        t = tuners[client % len(tuners)]
        d = t.decide(space, 64)
        decisions.append(d)
        live.append([d.setting, overlaps.begin(d.setting), 0.0, 0.0, 0, t, client])

    for client in range(clients):
        start(client)
    while live:
        running = [r[0] for r in live] + [s for s in [bystander] if s is not None]
        depth = max((s.layers_per_step for s in running if s.uses_draft_model), default=0)
        step = 0.1 + draft_forward * depth
        for r in list(live):
            r[2], r[3], r[4] = r[2] + tokens_per_step(r[0]), r[3] + step, r[4] + 1
            if r[2] >= 64:
                live.remove(r)
                clean = overlaps.end(r[1])
                finished += 1
                if finished == bystander_until:
                    overlaps.end(bystander_ticket)
                    bystander = None
                r[5].finish(r[0], 64, 64, r[4], 32, r[3] * 63 / 64, clean=clean)
                if len(decisions) < requests:
                    start(r[6])
    return decisions


@pytest.mark.parametrize("clients", [1, 4, 16])
def test_a_draft_that_does_not_pay_loses_at_several_clients(clients) -> None:
    """Beside a draft's trees a no-draft request waits for their forwards (the mix makes
    it look 2-4x slower than alone): measured in phases, no draft still wins."""
    tuner = Tuner(None, calibration_tokens=64)
    decisions = serve_together(tuner, ONE_STAGE, clients, 400, draft_forward=0.08)
    chosen = [d.setting for d in decisions[-100:] if not d.exploring]
    assert chosen and all(s == Setting.no_draft() for s in chosen)
    assert tuner.cost_per_token(Setting.no_draft()) == pytest.approx(0.1, rel=0.1)
    for s, m in tuner.measured.items():  # every measurement is of the setting alone
        if m.requests and s.uses_draft_model:
            alone = (0.1 + 0.08 * s.layers_per_step) / tokens_per_step(s)
            assert m.wall_per_token == pytest.approx(alone, rel=0.25)
    assert (tuner.mixed > 0) == (clients > 1)
    assert_phases_advance(decisions)


def assert_phases_advance(decisions) -> None:
    """Calibration's decisions come in one run per setting: each phase measured its
    setting to the end, then the next began."""
    calibrating = [d.setting for d in decisions if d.phase == CALIBRATING]
    runs = [s for i, s in enumerate(calibrating) if i == 0 or calibrating[i - 1] != s]
    assert len(runs) >= 3 and len(runs) == len(set(runs))


@pytest.mark.parametrize("clients", [1, 4])
def test_a_draft_that_pays_wins_at_several_clients(clients) -> None:
    tuner = Tuner(None, calibration_tokens=64)
    decisions = serve_together(tuner, ONE_STAGE, clients, 300, draft_forward=0.005)
    chosen = [d.setting for d in decisions[-100:] if not d.exploring]
    assert chosen and all(s.uses_draft_model and s.layers_per_step == 4 for s in chosen)
    assert_phases_advance(decisions)


def test_at_several_clients_re_measures_visit_only_measured_settings() -> None:
    """A phase slows every request beside it: settings the search never tried are left
    to moments with nothing in flight (at one client, every re-measure may visit them)."""
    for clients, want_new in ((4, False), (1, True)):
        tuner = Tuner(None, calibration_tokens=64)
        decisions = serve_together(tuner, FULL_ONE_STAGE, clients, 600, draft_forward=0.08)
        calibrated = {d.setting for d in decisions if d.phase == CALIBRATING}
        re_measured = {d.setting for d in decisions if d.phase == RE_MEASURING}
        assert re_measured and (not re_measured <= calibrated) == want_new


def test_phases_end_where_clean_requests_never_come() -> None:
    """A request with fixed settings runs beside every tuned one: each phase ends at its
    bound, calibration gives up after CALIBRATION_PHASES of them per candidate, and with
    nothing measured clean the choice is no draft."""
    tuner = Tuner(None, calibration_tokens=64)
    fixed = Setting(8, 1, DRAFT)
    decisions = serve_together(tuner, ONE_STAGE, 4, 400, 0.01, bystander=fixed)
    assert len({d.setting for d in decisions if d.exploring}) >= 3  # phases moved on
    assert all(tuner.bounded.get(s, 0) <= CALIBRATION_PHASES for s in ONE_STAGE.settings())
    chosen = [d for d in decisions[-100:] if not d.exploring]
    assert len(chosen) >= 80 and all(d.setting == Setting.no_draft() for d in chosen)
    assert "nothing measured clean" in chosen[-1].reason and tuner.mixed > 0


def test_calibration_resumes_once_a_disturbance_has_gone() -> None:
    """A request with fixed settings runs beside the first 200: every phase is cut
    short; once it has gone, clean requests come again and calibration resumes, so the
    draft that pays wins (not no draft, chosen while nothing was measured clean)."""
    tuner = Tuner(None, calibration_tokens=64)
    fixed = Setting(4, 1, TokenSource.NGRAM)
    decisions = serve_together(tuner, ONE_STAGE, 4, 1500, 0.005, fixed, bystander_until=200)
    chosen = [d.setting for d in decisions[-300:] if not d.exploring]
    assert chosen and all(s.uses_draft_model and s.layers_per_step == 4 for s in chosen)


def test_the_regimes_of_one_model_version_share_its_phases() -> None:
    """Greedy and sampling requests at once (2 clients each): every tuned request of the
    model version gets the setting one phase measures, whatever its regime, and each
    regime's tuner measures it (phases of their own would mix each other's requests,
    and both would end on no draft, measured clean or not at all)."""
    shared = Shared()
    tuners = [Tuner(None, calibration_tokens=64, shared=shared) for _ in range(2)]
    decisions = serve_together(tuners, ONE_STAGE, 4, 600, draft_forward=0.005)
    chosen = [d.setting for d in decisions[-200:] if not d.exploring]
    assert chosen and all(s.uses_draft_model and s.layers_per_step == 4 for s in chosen)
    for tuner in tuners:
        now = tuner.outlook()
        assert now is not None and not now.exploring and now.setting in chosen
        assert sum(1 for m in tuner.measured.values() if m.requests) >= 4
    assert not shared.overlaps.live and shared.pending == 0


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


def test_regimes_with_equally_good_bests_choose_one_setting() -> None:
    """Greedy's best is K=2, sampling's K=3, each within 10% of the other's in both
    regimes: once calibrated, requests of both in flight together get one setting
    (different ones would mix every request of both in their steady state)."""
    shared = Shared()
    space = TuningSpace(4, None, DRAFT, True, stages=3)
    walls = ({1: 0.100, 2: 0.050, 3: 0.052}, {1: 0.100, 2: 0.053, 3: 0.050})
    tuners = [Tuner(None, calibration_tokens=64, explore_every=1000, shared=shared) for _ in walls]
    for tuner, wall in zip(tuners, walls, strict=True):
        _calibration(tuner, space, lambda s, wall=wall: wall[s.layers_per_step])
        assert tuner.outlook() is not None and not tuner.outlook().exploring
    live = [tuner.decide(space, 64) for tuner in tuners for _ in range(3)]
    assert not any(d.exploring for d in live)
    assert len({d.setting for d in live}) == 1, [d.setting.label() for d in live]
    assert "the model version's choice" in live[-1].reason
    # a regime whose best is clearly better keeps it
    far = Tuner(None, calibration_tokens=64, explore_every=1000, shared=shared)
    _calibration(far, space, lambda s: {1: 0.100, 2: 0.080, 3: 0.050}[s.layers_per_step])
    assert far.decide(space, 64).setting.layers_per_step == 3


def test_a_lone_regime_follows_its_best_not_its_last_choice() -> None:
    """The tie-break is another regime's choice: a tuner's own last one does not hold
    it back from a better measured setting."""
    tuner = Tuner(None, calibration_tokens=64, explore_every=1000)
    space = TuningSpace(4, None, DRAFT, True, stages=3)
    _calibration(tuner, space, lambda s: {1: 0.100, 2: 0.050, 3: 0.052}[s.layers_per_step])
    assert tuner.decide(space, 64).setting.layers_per_step == 2
    tuner.finish(Setting(4, 2, DRAFT), 64)
    tuner.finish(Setting(4, 3, DRAFT), 64, 64, 32, 32, 63 * 0.040)  # K=3 now 8% better
    d = tuner.decide(space, 64)
    assert d.setting.layers_per_step == 3 and "choice" not in d.reason
