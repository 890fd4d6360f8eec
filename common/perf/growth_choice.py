"""When a layer grows, chosen per deployment from the costs its stages and its draft
publish (docs/architecture.md, "3. The pipeline step", "When a layer grows").

`eager` growth takes the verification's round trip off the step but puts the draft's
whole round trip (its forward, the router, two hops) on every step; `verified` growth
does the opposite. Eager thus pays where the draft's round trip fits in the step with
room to spare. Measured with emulated devices at S = 4 (benchmarks/README.md): at 20 ms
stages with a 10 ms draft the two were even at one client and verified ahead at eight;
at 100 ms stages with a 50 ms draft eager was 10-15 % faster at one client and 15 % at
eight. The rule prices the draft's round trip as its K forwards of W rows plus the
services' hops (`HOP_SECONDS`, the step overhead measured on this machine's loopback)
and grows eagerly when that is within `EAGER_SHARE` of a stage step.
"""

from __future__ import annotations

from ..spec.options import Growth
from .cost_model import DeploymentCosts
from .layers_per_step import step_seconds

# The draft's round trip beyond its forwards: the router's work and two hops (router to
# draft and back); 10-20 ms step overhead at one client on this shared 2-core machine.
HOP_SECONDS = 0.010
# The draft's round trip may take this share of a stage step for eager growth to pay.
EAGER_SHARE = 0.75


def choose_growth(
    stage_step_seconds: float | None,
    draft_round_trip_seconds: float | None,
    hop_seconds: float = HOP_SECONDS,
) -> Growth:
    """`eager` where the draft's round trip (its forwards, `draft_round_trip_seconds`,
    plus `hop_seconds`) fits in `EAGER_SHARE` of a stage step, else `verified`; verified
    (the safe default) where either cost is unknown."""
    if stage_step_seconds is None or draft_round_trip_seconds is None or stage_step_seconds <= 0:
        return Growth.VERIFIED
    if draft_round_trip_seconds + hop_seconds <= EAGER_SHARE * stage_step_seconds:
        return Growth.EAGER
    return Growth.VERIFIED


def growth_for(
    costs: DeploymentCosts | None, layers_per_step: int, width: int, uses_draft_model: bool
) -> Growth:
    """The growth of a request shaped (K, W) on a deployment with `costs` (None: no cost
    curves published; a draft without one counts as unknown): the n-gram source's round
    trip is the hops alone."""
    if costs is None or (costs.draft is None and uses_draft_model):
        return Growth.VERIFIED
    stage = step_seconds(costs, layers_per_step, width, uses_draft=False)
    draft = costs.draft_seconds([width] * layers_per_step) if uses_draft_model else 0.0
    return choose_growth(stage, draft)
