"""The late-draft hold (`--late-draft-wait-ms`): when the last stage's verification of a
root arrives before the draft has answered for a layer that lockstep would have grown by
then (`Controller.draft_is_late_for`, the controller's judgement), the verification may
wait a while for that answer, so that the tree keeps the layer (lockstep's schedule: the
step waits for the draft) instead of the verification passing it by (a miss or a
regrowth, and no wait). Either way the tokens are the same.

How long (`StepWait`, the default; a fixed `--late-draft-wait-ms` overrides it): one
pipeline step as this router's requests measure it. Passing the answer by costs the layer
it would have grown, about a step (benchmarks/README.md, "The late draft off the
critical path"), so a wait shorter than a step gives lockstep's steps for less than it
loses; an answer later than that is better passed by. Measured, not priced from the
published cost curves: the step the requests see holds the hops and the router, and it
needs no `--measure-costs`. Only steps no hold of the request stretched count (a hold
delays the layers behind it: counted, the wait would feed on itself). Where the waits
run out more than a third of the time (a draft late by more than a step: waiting then
costs more than it saves), waiting pauses and is tried again after some 20 late answers.

Pure (the clock is an argument): the driver hands every verification here instead of
to the controller, calls `settle` after every other event, and wakes at `until`.
"""

from __future__ import annotations

from specpipe.common.spec.commands import Command
from specpipe.common.spec.controller import Controller
from specpipe.common.spec.messages import Verified

STEP_EMA = 0.2  # weight of the newest request's seconds per step in the running mean
# Weight of the newest hold's outcome (1: the wait ran out): small, since the requests
# of a step are held together and a hiccup of the machine runs all their waits out at
# once; a draft late by more than a step every time pauses waiting within 8 holds.
EXPIRED_EMA = 0.05
# A hold pays when its answer comes within the step (it saves the step less the wait)
# and costs the step when it runs out: with waits of half a step on average, it pays
# while fewer than a third run out.
PAUSE_ABOVE = 1 / 3
# While waiting pauses, each late answer passed by forgets this much of the run-outs:
# waiting is tried again after some 20 of them (one wasted step per 20 at worst).
PAUSED_DECAY = 0.005


class StepWait:
    """The router's late-draft wait, shared by its requests: one pipeline step, a running
    mean of the seconds between a request's verifications over the lockstep steps between
    them (a miss's refill counts its steps), paused while most holds run out."""

    def __init__(self) -> None:
        self.step_seconds: float | None = None  # None: no request verified twice yet
        self.expired = 0.0  # running share of holds whose wait ran out

    @property
    def seconds(self) -> float:
        """How long a verification may wait now (0: not at all)."""
        if self.step_seconds is None or self.expired > PAUSE_ABOVE:
            return 0.0
        return self.step_seconds

    def stepped(self, seconds: float, steps: int) -> None:
        """A request verified again `seconds` and `steps` (lockstep's) after its last."""
        if steps <= 0 or seconds < 0:
            return
        per = seconds / steps
        s = self.step_seconds
        self.step_seconds = per if s is None else (1 - STEP_EMA) * s + STEP_EMA * per

    def held(self, ran_out: bool) -> None:
        """A hold ended: the answer came (False) or the wait ran out (True)."""
        self.expired = (1 - EXPIRED_EMA) * self.expired + EXPIRED_EMA * float(ran_out)

    def passed_by(self) -> None:
        """A late answer was passed by without a wait (paused, or no step known yet)."""
        self.expired *= 1 - PAUSED_DECAY


class LateDraftHold:
    def __init__(self, controller: Controller, wait: float | StepWait | None) -> None:
        """`wait`: seconds (0: never hold), or the router's `StepWait` (None: one of the
        request's own)."""
        self.controller = controller
        if wait is None:
            wait = StepWait()
        self.policy = wait if isinstance(wait, StepWait) else None
        self.fixed = 0.0 if isinstance(wait, StepWait) else float(wait)
        self._held: list[Verified] = []  # in arrival order
        self._until = 0.0
        self._last: tuple[float, int] | None = None  # last verification: when, steps then
        # verifications since this request's last hold: a step counts once the layers a
        # hold delayed (one per stage) were verified
        self._unheld = 0

    @property
    def wait(self) -> float:
        """How long a verification that comes now may be held, in seconds."""
        return self.policy.seconds if self.policy is not None else self.fixed

    @property
    def until(self) -> float | None:
        """When held verifications go to the controller at the latest (None: none held)."""
        return self._until if self._held else None

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def verified(self, v: Verified, now: float) -> list[Command]:
        """A verification: to the controller now, or held while the draft is late (those
        that come while others are held queue behind them)."""
        if self._held:
            self._held.append(v)
            return []
        if self.controller.draft_is_late_for(v):
            wait = self.wait
            if wait > 0:
                self._held, self._until = [v], now + wait
                self._unheld = 0
                return []
            if self.policy is not None:
                self.policy.passed_by()
        return self._to_controller([v], now)

    def settle(self, now: float, expired: bool = False) -> list[Command]:
        """After any event: the held verifications go to the controller once the draft is
        no longer late for the first (it answered, or was dropped) or the wait is over."""
        if not self._held:
            return []
        ran_out = expired or now >= self._until
        if ran_out or not self.controller.draft_is_late_for(self._held[0]):
            if self.policy is not None:
                self.policy.held(ran_out)
            held, self._held = self._held, []
            return self._to_controller(held, now)
        return []

    def drop(self) -> None:
        """The path was abandoned: what it verified is of no use to the next one."""
        self._held = []
        self._last, self._unheld = None, 0

    def _to_controller(self, verifications: list[Verified], now: float) -> list[Command]:
        cmds = [cmd for v in verifications for cmd in self.controller.on_verified(v)]
        if self.policy is not None:
            steps = self.controller.stats.decode_steps
            last, self._last = self._last, (now, steps)
            self._unheld += len(verifications)
            if (
                last is not None
                and steps > last[1]
                and self._unheld > self.controller.num_stages + 1
            ):
                self.policy.stepped(now - last[0], steps - last[1])
        return cmds
