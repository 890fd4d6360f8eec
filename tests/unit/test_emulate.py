"""Emulated devices: cost files (flat, measured, several context lengths), the costs a
projection takes from them, and the pacer that makes each forward take its modelled time."""

from __future__ import annotations

import json
import time

import pytest
import torch
from specpipe.common.perf.cost_model import DeploymentCosts, projected_tbt
from specpipe.common.perf.emulate import (
    EmulatedCosts,
    Pacer,
    batch_shape,
    costs_from_results,
    paced,
    paced_call,
)
from specpipe.common.spec.messages import Activation

from specpipe.cli import main


def measured(context: int, scale: float = 1.0, stages: int = 2, draft: bool = True) -> dict:
    """A cost file's measured form: stage k costs (k + 1) * scale * rows ms."""

    def curve(k: int) -> dict:
        return {"rows": [1, 4, 16], "seconds": [(k + 1) * scale * n * 1e-3 for n in (1, 4, 16)]}

    return {
        "context": context,
        "stages": [curve(k) for k in range(stages)],
        "draft": curve(9) if draft else None,
    }


class FakeClock:
    """A clock that moves only when the code under test sleeps or `advance` says."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_flat_costs_are_one_price_per_forward() -> None:
    costs = EmulatedCosts.from_dict({"flat": {"stage": 0.02, "draft": 0.005}})
    stage, draft = costs.stage(3), costs.draft()
    assert stage(1) == stage(64) == stage(1000, context=4096) == pytest.approx(0.02)
    assert draft is not None and draft(7) == pytest.approx(0.005)
    assert stage(0) == 0.0  # no rows, no forward
    both = EmulatedCosts.from_dict({"flat": 0.03})
    assert both.stage()(5) == both.draft()(5) == pytest.approx(0.03)
    free_draft = EmulatedCosts.from_dict({"flat": {"stage": 0.03}})
    assert free_draft.draft() is None and not free_draft.has_draft


def test_measured_file_gives_each_stage_its_curve(tmp_path) -> None:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(measured(128)))
    costs = EmulatedCosts.load(path)
    assert costs.num_stages == 2
    assert costs.stage(0)(4) == pytest.approx(4e-3) and costs.stage(1)(4) == pytest.approx(8e-3)
    assert costs.stage(1)(2) == pytest.approx(4e-3)  # interpolated
    assert costs.draft()(1) == pytest.approx(10e-3)
    with pytest.raises(ValueError, match="say which one"):
        costs.stage(None)
    with pytest.raises(ValueError, match="say which one"):
        costs.stage(2)
    costs.check_stages(2)
    with pytest.raises(ValueError, match="has 2 stage curves; the deployment has 3"):
        costs.check_stages(3)
    # round trip: what to_dict writes loads again
    again = EmulatedCosts.from_dict(costs.to_dict())
    assert again.stage(1)(16) == costs.stage(1)(16)


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"flat": {"draft": 0.1}},
        {"flat": -1},
        {"context": 8, "stages": []},
        {"context": 8, "stages": [{"rows": [4, 1], "seconds": [1, 2]}]},
        {"context": 8, "stages": [{"rows": [1, 2], "seconds": [1]}]},
        {"contexts": [measured(8), measured(8)]},
        {"contexts": [measured(8), measured(16, stages=3)]},
    ],
)
def test_bad_cost_files_are_refused(tmp_path, bad) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="cost file"):
        EmulatedCosts.load(path)


def test_context_levels_interpolate_linearly_in_context() -> None:
    costs = EmulatedCosts.from_dict({"contexts": [measured(512, 3.0), measured(128, 1.0)]})
    stage = costs.stage(0)
    assert stage(4, 128) == pytest.approx(4e-3) and stage(4, 512) == pytest.approx(12e-3)
    assert stage(4, 320) == pytest.approx(8e-3)  # halfway
    assert stage(4, 896) == pytest.approx(20e-3)  # beyond: along the nearest two
    assert stage(4, 0) == pytest.approx(4e-3 - 8e-3 * 128 / 384)  # below: likewise
    steep = EmulatedCosts.from_dict({"contexts": [measured(128, 1.0), measured(512, 5.0)]})
    assert steep.stage(0)(4, 0) == 0.0  # never negative
    at = costs.at(320)
    assert isinstance(at, DeploymentCosts) and at.context == 320
    assert at.stages[1](4) == pytest.approx(16e-3) and at.draft(1) == pytest.approx(20e-3)


def test_projection_costs_from_a_file_match_its_pacing() -> None:
    """`at` hands a projection the very costs the services pace to: pp with S flat
    stages costs S forwards per token."""
    costs = EmulatedCosts.flat(0.05, 0.01).at(64, stages=3)
    assert [c(9) for c in costs.stages] == pytest.approx([0.05] * 3)
    trace = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]] * 3  # one token per 3 steps
    assert projected_tbt(trace, [3, 6, 9], costs, "pp") == pytest.approx(3 * 0.05)


def test_costs_from_bench_results(tmp_path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"by_stages": {"2": {"costs": measured(158)}}}))
    costs = costs_from_results(path, 2)
    assert costs.levels[0].context == 158 and costs.stage(1)(1) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="no costs for S=4"):
        costs_from_results(path, 4)


def test_pacer_makes_a_forward_take_its_modelled_time() -> None:
    clock = FakeClock()
    pacer = Pacer(EmulatedCosts.from_dict(measured(0)).stage(1), clock=clock, sleep=clock.sleep)
    for rows, real in [(1, 0.0005), (4, 0.003), (16, 0.010)]:
        start = clock()
        with pacer.forward(rows):
            clock.advance(real)
        assert clock() - start == pytest.approx(2e-3 * rows)  # max(real, modelled)
    assert clock.slept == pytest.approx([0.0015, 0.005, 0.022])
    assert pacer.summary()["forwards"] == 3 and pacer.overruns == 0


def test_a_launched_forward_is_waited_for_at_hand_off_and_host_work_overlaps_it() -> None:
    """An emulated device whose launches are asynchronous: the launch returns after the
    real forward; host work done before the hand-off counts against the rest of the
    modelled time, and the hand-off waits only for what is left (none once past)."""
    clock = FakeClock()
    pacer = Pacer(EmulatedCosts.flat(0.02).stage(), clock=clock, sleep=clock.sleep)
    with pacer.launch(4) as done:
        clock.advance(0.005)  # the real forward
    assert clock() == pytest.approx(0.005) and clock.slept == []
    clock.advance(0.004)  # the next round prepared meanwhile
    done.wait()
    assert clock() == pytest.approx(0.02) and clock.slept == [pytest.approx(0.011)]
    assert done.seconds == pytest.approx(0.02)
    with pacer.launch(4) as late:
        clock.advance(0.001)
    clock.advance(0.05)  # the host took longer than the device
    late.wait()
    assert len(clock.slept) == 1 and pacer.forwards == 2


def test_a_forward_slower_than_its_model_is_not_slowed_and_is_counted() -> None:
    clock = FakeClock()
    pacer = Pacer(EmulatedCosts.flat(0.01).stage(), clock=clock, sleep=clock.sleep)
    with pacer.forward(8):
        clock.advance(0.05)
    assert clock.slept == [] and clock() == pytest.approx(0.05)
    assert pacer.overruns == 1
    with paced(pacer, []):  # no rows: no forward to pace or count
        clock.advance(0.05)
    assert clock.slept == [] and pacer.overruns == 1 and pacer.forwards == 1


def test_batch_shape_weights_each_requests_context_by_its_rows() -> None:
    a = Activation("a", torch.tensor([10, 11, 11]))  # context 12, 3 rows
    b = Activation("b", torch.tensor([99]))  # context 100, 1 row
    assert batch_shape([a, b]) == (4, round((3 * 12 + 100) / 4))
    assert batch_shape([]) == (0, 0)


def test_pacing_in_real_time_takes_at_least_the_modelled_time() -> None:
    """A flat 0.2 s model: N paced calls take >= N x 0.2 s of wall clock (no upper bound:
    a loaded machine may only make them slower)."""
    pacer = Pacer(EmulatedCosts.flat(0.2).stage())
    calls = []
    fn = paced_call(pacer, lambda x: calls.append(x) or x, rows=4, context=16)
    start = time.perf_counter()
    assert [fn(i) for i in range(3)] == [0, 1, 2]
    assert time.perf_counter() - start >= 3 * 0.2
    assert calls == [0, 1, 2] and pacer.summary()["modelled_seconds"] == pytest.approx(0.6)
    assert paced_call(None, fn, 4, 16) is fn and paced_call(pacer, fn, 0, 16) is fn


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["stage", "--insecure", "--layers", "0:2"], "has 2 stage curves"),
        (["draft", "--insecure"], "No such file"),
        (["up", "--stages", "3", "--draft", "oracle"], "the deployment has 3 stages"),
    ],
)
def test_bad_emulate_costs_is_a_usage_error(argv, message, llama_dir, tmp_path, capsys) -> None:
    path = tmp_path / "costs.json"
    if argv[0] != "draft":
        path.write_text(json.dumps(measured(16)))
    flag = "--target" if argv[0] == "up" else "--model"
    code = main([*argv, flag, str(llama_dir), "--emulate-costs", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
