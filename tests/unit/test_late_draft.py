"""The late-draft wait derived from the step (`StepWait`): learnt from the requests'
verifications, shared by them, paused while its waits run out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from specpipe.common.spec.messages import Verified
from specpipe.services.router.late_draft import PAUSE_ABOVE, LateDraftHold, StepWait


class _Controller:
    """A controller that counts one lockstep step per verification (`steps` each)."""

    def __init__(self, steps: int = 1) -> None:
        self.num_stages = 1
        self.late = False
        self.steps = steps
        self.verified: list[int] = []
        self.stats = SimpleNamespace(decode_steps=0)

    def draft_is_late_for(self, v: Verified) -> bool:
        return self.late

    def on_verified(self, v: Verified) -> list:
        self.verified.append(v.position)
        self.stats.decode_steps += self.steps
        return [v.position]


def _v(position: int) -> Verified:
    return Verified("r", (0,), (1,), position)


def _hold(policy: StepWait, steps: int = 1) -> tuple[_Controller, LateDraftHold]:
    ctrl = _Controller(steps)
    return ctrl, LateDraftHold(ctrl, policy)  # type: ignore[arg-type]


def test_no_wait_before_a_step_is_measured() -> None:
    ctrl, hold = _hold(StepWait())
    ctrl.late = True
    assert hold.verified(_v(5), now=0.0) == [5] and hold.until is None


def test_the_wait_is_one_step_of_the_requests() -> None:
    policy = StepWait()
    ctrl, hold = _hold(policy)
    for i, now in enumerate((10.0, 10.1, 10.2)):  # the first S + 1 fill the pipeline
        hold.verified(_v(i), now=now)
    assert policy.seconds == pytest.approx(0.1)
    ctrl.late = True
    assert hold.verified(_v(7), now=10.3) == [] and hold.until == pytest.approx(10.4)
    ctrl.late = False  # the answer came
    assert hold.settle(now=10.35) == [7]
    assert policy.expired == 0.0


def test_steps_between_verifications_divide_the_time() -> None:
    """A miss's refill spans several lockstep steps: its time counts per step."""
    policy = StepWait()
    _, hold = _hold(policy, steps=4)
    for i, now in enumerate((1.0, 1.4, 1.8)):
        hold.verified(_v(i), now=now)
    assert policy.seconds == pytest.approx(0.1)


def test_one_wait_for_all_requests() -> None:
    """A request's first verification is held for the step the others measured."""
    policy = StepWait()
    _, first = _hold(policy)
    for i, now in enumerate((0.0, 0.05, 0.1)):
        first.verified(_v(i), now=now)
    ctrl, second = _hold(policy)
    ctrl.late = True
    assert second.verified(_v(9), now=1.0) == [] and second.until == pytest.approx(1.05)


def test_waiting_pauses_while_the_waits_run_out_and_resumes() -> None:
    policy = StepWait()
    ctrl, hold = _hold(policy)
    for i, now in enumerate((0.0, 0.1, 0.2)):
        hold.verified(_v(i), now=now)
    ctrl.late = True
    now, position = 0.3, 3
    while policy.expired <= PAUSE_ABOVE:
        assert hold.verified(_v(position), now=now) == []
        assert hold.settle(now=now + 0.05) == []  # still late
        assert hold.settle(now=now + 0.2, expired=True) == [position]  # ran out
        now, position = now + 0.3, position + 1
    assert policy.seconds == 0.0

    def passed_by_until_resumed() -> int:
        nonlocal position
        passed = 0
        while policy.seconds == 0.0:
            position += 1
            assert hold.verified(_v(position), now=now) == [position]  # paused: passed by
            passed += 1
        return passed

    assert 1 <= passed_by_until_resumed() <= 40
    assert hold.verified(_v(position + 1), now=now + 1) == []  # tried again: it runs out
    assert len(hold.settle(now=now + 2, expired=True)) == 1
    assert 10 <= passed_by_until_resumed() <= 40  # one wasted wait per 10-40 late answers


def test_steps_a_hold_stretched_do_not_count() -> None:
    """A hold delays the layers behind it (one per stage): until they are verified, the
    request's steps are not the deployment's, and the wait must not feed on itself."""
    policy = StepWait()
    ctrl, hold = _hold(policy)
    ctrl.num_stages = 2
    for i, now in enumerate((0.0, 0.1, 0.2, 0.3, 0.4)):
        hold.verified(_v(i), now=now)
    assert policy.seconds == pytest.approx(0.1)
    ctrl.late = True
    hold.verified(_v(5), now=0.5)
    ctrl.late = False
    assert hold.settle(now=0.55) == [5]
    for i, now in ((6, 0.7), (7, 0.85)):  # stretched by the hold: not counted
        hold.verified(_v(i), now=now)
    assert policy.seconds == pytest.approx(0.1)
    hold.verified(_v(8), now=0.95)  # the hold's layers are through: counted again
    assert policy.seconds == pytest.approx(0.1)
    hold.verified(_v(9), now=1.15)
    assert policy.seconds == pytest.approx(0.8 * 0.1 + 0.2 * 0.2)


def test_a_fixed_wait_is_not_learnt() -> None:
    ctrl = _Controller()
    hold = LateDraftHold(ctrl, 0.5)  # type: ignore[arg-type]
    hold.verified(_v(0), now=0.0)
    hold.verified(_v(1), now=0.1)
    assert hold.wait == 0.5 and hold.policy is None
