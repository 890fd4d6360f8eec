"""The stage's step alignment policy, on a fake clock: a round waits for requests expected
shortly, at most its window; never for a lone request, when all are ready, or for a
request whose cadence says it is not due (a pp request gone to the next stage)."""

from __future__ import annotations

import pytest
from specpipe.common.runtime.alignment import AUTO_CAP, StepAligner


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def aligner(wait: float | None = 0.010) -> tuple[StepAligner, Clock]:
    clock = Clock()
    return StepAligner(wait, clock=clock), clock


def steady(a: StepAligner, clock: Clock, rids, period: float, steps: int = 3) -> None:
    """Every request of `rids` arrives once per `period` (together), `steps` times."""
    for _ in range(steps):
        for rid in rids:
            a.arrived(rid)
        clock.t += period


def test_waits_for_a_request_of_the_same_step_up_to_the_window() -> None:
    a, clock = aligner(0.010)
    steady(a, clock, ["a", "b"], 0.100)
    clock.t -= 0.002  # a's activation of this step comes 2 ms early
    a.arrived("a")
    assert a.expected({"a"}, {"a", "b"}) == {"b"}
    assert a.hold({"a"}, {"a", "b"}) == pytest.approx(0.010)
    clock.t += 0.004
    assert a.hold({"a"}, {"a", "b"}) == pytest.approx(0.006)  # the same round's deadline
    clock.t += 0.006
    assert a.hold({"a"}, {"a", "b"}) == 0.0  # b did not come: the round starts


def test_starts_at_once_when_the_expected_request_is_there() -> None:
    a, clock = aligner()
    steady(a, clock, ["a", "b"], 0.100)
    assert a.hold({"a"}, {"a", "b"}) > 0
    a.arrived("b")
    assert a.hold({"a", "b"}, {"a", "b"}) == 0.0


def test_never_waits_for_a_lone_request_or_when_all_are_ready() -> None:
    a, clock = aligner()
    steady(a, clock, ["a", "b", "c"], 0.100)
    assert a.hold({"a"}, {"a"}) == 0.0
    assert a.hold({"a", "b", "c"}, {"a", "b", "c"}) == 0.0
    assert a.hold(set(), {"a", "b"}) == 0.0  # nothing to compute: nothing to hold


def test_zero_window_disables() -> None:
    a, clock = aligner(0.0)
    steady(a, clock, ["a", "b"], 0.100)
    assert a.hold({"a"}, {"a", "b"}, blocked={"b"}) == 0.0


def test_a_request_that_never_comes_costs_at_most_the_window_per_round() -> None:
    a, clock = aligner(0.010)
    steady(a, clock, ["a", "b"], 0.100)
    waited = 0.0
    for _ in range(5):  # b stopped; a keeps coming every 100 ms
        a.arrived("a")
        t0 = clock.t
        while (w := a.hold({"a"}, {"a", "b"})) > 0:
            clock.t += w
        a.started()
        waited += clock.t - t0
        assert clock.t - t0 <= 0.010 + 1e-9
        clock.t = t0 + 0.100
    # More than one period overdue, b is not expected any more: no wait at all.
    assert waited <= 0.020 + 1e-9


def test_does_not_wait_for_a_request_not_due() -> None:
    """pp, S = 3: request b comes every 300 ms; a round 100 ms after b's last one must
    not wait for it (it is at the next stage), one 300 ms after does."""
    a, clock = aligner(0.010)
    for _ in range(3):
        a.arrived("b")
        clock.t += 0.300
    clock.t -= 0.200
    a.arrived("a")
    assert a.hold({"a"}, {"a", "b"}) == 0.0
    clock.t += 0.2 - 0.005
    assert a.expected({"a"}, {"a", "b"}) == {"b"}


def test_new_requests_are_not_waited_for_but_blocked_ones_are() -> None:
    """Without a cadence yet a request is not expected, unless it has work pending that
    waits for something in flight (an earlier activation, a prune)."""
    a, _ = aligner(0.010)
    a.arrived("a")
    a.arrived("b")
    assert a.hold({"a"}, {"a", "b"}) == 0.0
    assert a.hold({"a"}, {"a", "b"}, blocked={"b"}) == pytest.approx(0.010)


def test_bursts_do_not_make_a_cadence() -> None:
    """Prefill chunks arrive together: they say nothing about the request's step."""
    a, clock = aligner(0.010)
    for _ in range(4):
        a.arrived("b")
        clock.t += 0.001
    assert a.expected({"a"}, {"a", "b"}) == set()


def test_automatic_window_follows_the_forwards_with_a_cap() -> None:
    a, _ = aligner(None)
    assert a.window == 0.0  # no forward yet
    a.computed(0.010)
    assert a.window == pytest.approx(0.005)
    for _ in range(20):
        a.computed(1.0)
    assert a.window == AUTO_CAP


def test_an_explicit_window_is_bounded() -> None:
    with pytest.raises(ValueError):
        StepAligner(5.0)
    with pytest.raises(ValueError):
        StepAligner(-0.001)


def test_an_irregular_request_is_not_waited_for() -> None:
    """Activations 60 and 140 ms apart: due 'now' on average, but the spread (40 ms) is
    wider than the window, so the guess is not worth a wait."""
    a, clock = aligner(0.010)
    for gap in (0.060, 0.140, 0.060, 0.140):
        a.arrived("b")
        clock.t += gap
    a.arrived("a")
    assert a.hold({"a"}, {"a", "b"}) == 0.0


def test_the_draft_expects_the_requests_of_its_last_batch() -> None:
    a, clock = aligner(0.010)
    a.expect_recent = True
    a.arrived("a")
    a.arrived("b")
    assert a.hold({"a"}, {"a", "b"}) == 0.0  # no batch yet
    a.started({"a", "b"})
    clock.t += 0.060
    a.arrived("a")
    assert a.hold({"a"}, {"a", "b"}) == pytest.approx(0.010)
    a.started({"a"})  # b did not come: the next batch does not wait for it
    clock.t += 0.060
    a.arrived("a")
    assert a.hold({"a"}, {"a", "b"}) == 0.0


def test_a_request_just_opened_is_expected_for_one_window() -> None:
    """Its prompt follows the Open at once: requests that start together prefill in one
    forward. Past a window after the Open it is not waited for any more."""
    a, clock = aligner(0.010)
    a.arrived("a")
    a.opened("b")
    assert a.expected({"a"}, {"a", "b"}) == {"b"}
    clock.t += 0.011
    assert a.expected({"a"}, {"a", "b"}) == set()
    a.arrived("b")  # its first activation: no cadence yet
    assert a.expected({"a"}, {"a", "b"}) == set()
    a.opened("c", first=False)  # a later stage: its prompt comes after the first computes it
    assert a.expected({"a"}, {"a", "c"}) == set()


def _running_and_newcomer(joins: bool) -> tuple[StepAligner, Clock]:
    """Request a runs every 120 ms (forwards of 100 ms: window 20 ms, join window 200
    ms); 30 ms after a's last round, request n opens and its prompt arrives."""
    a, clock = aligner(None)
    a.computed(0.100)
    a.opened("a", joins=joins)
    for _ in range(3):
        a.arrived("a")
        a.started({"a"})
        clock.t += 0.120
    clock.t -= 0.120 - 0.030
    a.opened("n", joins=joins)
    a.arrived("n")
    return a, clock


def test_younger_requests_wait_longer_to_join_the_older_ones() -> None:
    """A request joining while others run (closed loop: a client's next request) would
    otherwise start a forward out of their phase and stay there (two forwards per step
    for both, in specpipe): when only younger requests are ready, the round waits for
    older ones due within the join window; the older never wait that long for them."""
    a, clock = _running_and_newcomer(joins=True)
    assert a.window == AUTO_CAP and a.join_window == pytest.approx(0.200)
    assert a.hold({"n"}, {"a", "n"}) == pytest.approx(0.200)  # a is due in 90 ms
    clock.t += 0.090
    a.arrived("a")
    assert a.hold({"a", "n"}, {"a", "n"}) == 0.0  # a came: both in one forward
    a.started({"a", "n"})
    for _ in range(8):  # in phase now; then n is late
        clock.t += 0.120
        a.arrived("a")
        a.arrived("n")
        a.started({"a", "n"})
    clock.t += 0.120
    a.arrived("a")
    assert 0 < a.hold({"a"}, {"a", "n"}) <= AUTO_CAP  # a waits only the short window


def test_an_older_request_that_does_not_come_is_not_waited_for_again() -> None:
    a, clock = _running_and_newcomer(joins=True)
    assert a.hold({"n"}, {"a", "n"}) > 0
    clock.t += 0.200
    assert a.hold({"n"}, {"a", "n"}) == 0.0  # a did not come within the join window
    a.started({"n"})
    clock.t += 0.120
    a.arrived("n")
    assert a.hold({"n"}, {"a", "n"}) == 0.0  # nor is it waited for to join again
    a.arrived("a")  # until it has come


def test_pp_requests_do_not_wait_to_join() -> None:
    """pp: one activation per request in the whole pipeline; a phase of its own costs a
    pp request nothing, and a long wait would."""
    a, _ = _running_and_newcomer(joins=False)
    assert a.hold({"n"}, {"a", "n"}) == 0.0
