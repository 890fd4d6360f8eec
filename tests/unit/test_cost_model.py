"""Projection of time between tokens from step traces, and width selection."""

from __future__ import annotations

import pytest
from specpipe.common.perf.cost_model import (
    CostCurve,
    DeploymentCosts,
    measure_runtime,
    projected_tbt,
    specinfer_draft_seconds,
    step_seconds_of_trace,
)
from specpipe.common.perf.width import choose_width
from specpipe.common.runtime.loader import ORACLE_DRAFT, build_local
from specpipe.common.runtime.lockstep import LockstepGeneration
from specpipe.common.spec.options import DecodeOptions, Mode
from specpipe.common.spec.sampling import SamplingParams

ROWS = [1, 2, 4, 8, 16, 32]


def curve(fn) -> CostCurve:
    return CostCurve(ROWS, [fn(n) for n in ROWS])


def test_curve_interpolates_extrapolates_and_zero_rows_are_free() -> None:
    c = CostCurve([1, 4], [1.0, 4.0])
    assert c(0) == 0.0 and c(1) == 1.0 and c(2) == pytest.approx(2.0)
    assert c(8) == pytest.approx(8.0)  # beyond the last point: along the last segment
    assert CostCurve([1, 4], [2.0, 2.0])(64) == 2.0 and CostCurve([1], [3.0])(9) == 3.0


def test_pp_projection_is_the_sum_of_stage_costs_per_token(llama_dir) -> None:
    stages = 4
    costs = DeploymentCosts(
        context=16, stages=[curve(lambda n, k=k: (k + 1) * n) for k in range(stages)]
    )
    dep = build_local(llama_dir, stages)
    gen = LockstepGeneration(dep.pipeline, None, [7], Mode.PP, DecodeOptions(max_new_tokens=6))
    gen.run()
    total = sum(step_seconds_of_trace(gen.stats.trace[gen.stats.prefill_steps :], costs, "pp"))
    assert total / 6 == pytest.approx(1 + 2 + 3 + 4)


def test_specpipe_step_costs_its_slowest_stage_or_the_draft() -> None:
    costs = DeploymentCosts(
        context=16,
        stages=[curve(lambda n: n), curve(lambda n: 2 * n)],
        draft=curve(lambda n: 10 * n),
    )
    trace = [[3, 1, 2], [0, 1, 0]]
    assert sum(step_seconds_of_trace(trace, costs, "specpipe")) == pytest.approx(20 + 2)
    assert sum(step_seconds_of_trace(trace, costs, "specinfer")) == pytest.approx(3 + 2)
    assert specinfer_draft_seconds([[1, 4], [1]], costs) == pytest.approx([10 + 40, 10])


def test_a_steps_draft_forwards_run_one_after_another() -> None:
    """K layers a step are K draft forwards (each grows from the one before), not one
    forward of their rows together."""
    costs = DeploymentCosts(context=16, stages=[curve(lambda n: 1.0)], draft=curve(lambda n: 2.0))
    trace = [[8, 8], [8, 8]]
    assert sum(step_seconds_of_trace(trace, costs, "specpipe")) == pytest.approx(2 + 2)
    forwards = [[4, 4, 4, 4], [8]]
    assert sum(step_seconds_of_trace(trace, costs, "specpipe", forwards)) == pytest.approx(8 + 2)
    assert projected_tbt(trace, [1, 2], costs, "specpipe", (), forwards) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="draft forwards"):
        step_seconds_of_trace(trace, costs, "specpipe", [[8]])


def test_tbt_counts_only_time_between_first_and_last_token() -> None:
    costs = DeploymentCosts(context=8, stages=[curve(lambda n: 1.0)] * 2)
    trace = [[1, 0, 0], [1, 1, 0], [0, 1, 0], [1, 1, 0]]
    # tokens emitted at steps 2 and 4: two steps of 1 s between them
    assert projected_tbt(trace, [2, 4], costs, "pp") == pytest.approx(2.0)
    assert projected_tbt(trace, [2, 3, 4], costs, "pp") == pytest.approx(1.0)
    assert projected_tbt(trace, [4], costs, "pp") is None
    # specinfer: passes of 2 steps; the draft of the second pass falls between emissions
    assert projected_tbt(trace, [2, 4], costs, "specinfer", [5.0, 7.0]) == pytest.approx(2.0 + 7.0)


def test_flat_costs_are_the_one_row_cost() -> None:
    costs = DeploymentCosts(context=8, stages=[curve(lambda n: n)], draft=curve(lambda n: n))
    flat = costs.flat()
    assert flat.draft(16) == 1.0 and flat.stages[0](32) == 1.0
    assert costs.without_draft().step_seconds([4], [32], draft_parallel=True) == 4.0


def test_measured_curve_covers_requested_rows_and_leaves_no_state(llama_dir) -> None:
    dep = build_local(llama_dir, 2)
    c = measure_runtime(dep.pipeline.stages[1], [1, 4], context=8, repeats=1)
    assert c.rows == [1, 4] and all(s > 0 for s in c.seconds)
    assert dep.pipeline.stages[1].cache_bytes_used == 0


def test_batched_curve_spreads_rows_over_requests_and_leaves_no_state(llama_dir) -> None:
    dep = build_local(llama_dir, 2)
    for stage in dep.pipeline.stages:
        c = measure_runtime(stage, [1, 5], context=8, repeats=1, requests=3)
        assert c.rows == [1, 5] and all(s > 0 for s in c.seconds)
        assert stage.cache_bytes_used == 0 and stage.info().active_requests == 0


@pytest.mark.parametrize(("cost", "expect"), [("flat", "best_hit"), ("steep", 1)])
def test_width_auto_trades_hit_rate_against_cost(llama_dir, cost, expect) -> None:
    dep = build_local(llama_dir, 3, ORACLE_DRAFT)
    widths = [1, 4, 16]
    fn = (lambda n: 1.0) if cost == "flat" else (lambda n: float(n**2))
    synthetic = DeploymentCosts(context=32, stages=[curve(fn)] * 3, draft=curve(lambda n: 0.0))
    sampling = SamplingParams(temperature=1.5, seed=1)  # oracle top-1 is then often wrong
    choice = choose_width(dep, [[1, 2, 3], [9, 8]], sampling, 4, widths, 12, costs=synthetic)
    hits = {o.width: o.hit_rate for o in choice.options}
    assert hits[16] > hits[1]
    if expect == "best_hit":
        assert hits[choice.width] == max(hits.values())
    else:
        assert choice.width == 1
    assert f"W={choice.width:>3}" in choice.explain()
