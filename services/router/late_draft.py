"""The late-draft hold (`--late-draft-wait-ms`): when the last stage's verification of a
root arrives before the draft has answered for a layer that lockstep would have grown by
then (`Controller.draft_is_late_for`, the controller's judgement), the verification may
wait up to `wait` seconds for that answer, so that the tree keeps the layer (lockstep's
schedule: the step waits for the draft) instead of the verification passing it by (a
miss or a regrowth, and no wait). Either way the tokens are the same; which is faster
depends on how late drafts are.

Pure (the clock is an argument): the driver hands every verification here instead of
to the controller, calls `settle` after every other event, and wakes at `until`.
"""

from __future__ import annotations

from specpipe.common.spec.commands import Command
from specpipe.common.spec.controller import Controller
from specpipe.common.spec.messages import Verified


class LateDraftHold:
    def __init__(self, controller: Controller, wait: float) -> None:
        self.controller, self.wait = controller, wait
        self._held: list[Verified] = []  # in arrival order
        self._until = 0.0

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
        if self.wait > 0 and self.controller.draft_is_late_for(v):
            self._held, self._until = [v], now + self.wait
            return []
        return self.controller.on_verified(v)

    def settle(self, now: float, expired: bool = False) -> list[Command]:
        """After any event: the held verifications go to the controller once the draft is
        no longer late for the first (it answered, or was dropped) or the wait is over."""
        if not self._held:
            return []
        if expired or now >= self._until or not self.controller.draft_is_late_for(self._held[0]):
            held, self._held = self._held, []
            return [cmd for v in held for cmd in self.controller.on_verified(v)]
        return []

    def drop(self) -> None:
        """The path was abandoned: what it verified is of no use to the next one."""
        self._held = []
