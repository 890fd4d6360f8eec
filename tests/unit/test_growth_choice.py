"""When a layer grows, per deployment (common/perf/growth_choice.py): eager where the
draft's round trip fits in the step, verified where it does not or nothing is known."""

from __future__ import annotations

from specpipe.common.perf.cost_model import CostCurve, DeploymentCosts
from specpipe.common.perf.growth_choice import HOP_SECONDS, choose_growth, growth_for
from specpipe.common.spec.options import Growth

ROWS = [1, 2, 4, 8, 16, 32, 64]


def flat(seconds: float) -> CostCurve:
    return CostCurve(ROWS, [seconds] * len(ROWS))


def test_the_measured_deployments_get_the_growth_that_won_there() -> None:
    # benchmarks/README.md: 20 ms stages with a 10 ms draft: verified ahead at 8
    # clients; 100 ms stages with a 50 ms draft: eager ahead at 1 and 8 clients
    assert choose_growth(0.020, 0.010) == Growth.VERIFIED
    assert choose_growth(0.100, 0.050) == Growth.EAGER


def test_unknown_costs_keep_verified() -> None:
    assert choose_growth(None, 0.001) == Growth.VERIFIED
    assert choose_growth(0.1, None) == Growth.VERIFIED
    assert choose_growth(0.0, 0.0) == Growth.VERIFIED


def test_the_hops_count_and_the_boundary_is_inclusive() -> None:
    assert choose_growth(1.0, 0.75 - HOP_SECONDS) == Growth.EAGER
    assert choose_growth(1.0, 0.76 - HOP_SECONDS) == Growth.VERIFIED
    assert choose_growth(0.1, 0.0, hop_seconds=0.09) == Growth.VERIFIED


def test_from_cost_curves_the_draft_runs_k_forwards() -> None:
    costs = DeploymentCosts(128, [flat(0.1)] * 2, flat(0.03))
    assert growth_for(costs, 1, 8, True) == Growth.EAGER  # 30 + 10 ms in a 100 ms step
    assert growth_for(costs, 3, 8, True) == Growth.VERIFIED  # 90 + 10 ms: no room
    assert growth_for(costs, 3, 8, False) == Growth.EAGER  # n-grams: only the hops
    assert growth_for(None, 1, 8, True) == Growth.VERIFIED
    no_draft_curve = DeploymentCosts(128, [flat(0.1)], None)
    assert growth_for(no_draft_curve, 1, 8, True) == Growth.VERIFIED
