"""Timers of device work wait for the device at both ends while costs are measured, and
never while serving (common/perf/clock.py)."""

from __future__ import annotations

import pytest
import torch
from specpipe.common.perf import clock
from specpipe.common.perf.clock import device_timer, measuring_costs


def test_cuda_timer_synchronizes_before_and_after_while_measuring_costs(monkeypatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda device=None: events.append(f"sync {device}")
    )
    with measuring_costs(), device_timer("cuda:1") as elapsed:
        events.append("work")
    assert events == ["sync cuda:1", "work", "sync cuda:1"]
    assert elapsed.seconds >= 0.0


class FakeEvent:
    """A CUDA event of a fake device: recorded at a host time, done once `done` says."""

    done = False
    log: list[str] = []  # noqa: RUF012 (reset per test)

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = None

    def record(self, stream=None) -> None:
        self.at = len(FakeEvent.log)
        FakeEvent.log.append(f"record on {stream}")

    def query(self) -> bool:
        return FakeEvent.done

    def elapsed_time(self, end: FakeEvent) -> float:
        return 250.0  # milliseconds


def test_serving_timer_never_waits_for_the_device(monkeypatch) -> None:
    """While serving: two events bracket the block; the host's time until the device
    has passed the second, then the events' time. Nothing synchronizes."""

    def fail(*args) -> None:
        raise AssertionError("synchronized the device while serving")

    FakeEvent.done, FakeEvent.log = False, []
    monkeypatch.setattr(torch.cuda, "synchronize", fail)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    with device_timer("cuda:1", clock=iter([10.0, 10.002]).__next__) as elapsed:
        FakeEvent.log.append("work")
    assert FakeEvent.log == ["record on stream of cuda:1", "work", "record on stream of cuda:1"]
    assert elapsed.seconds == pytest.approx(0.002)  # the device is not there yet
    FakeEvent.done = True
    assert elapsed.seconds == pytest.approx(0.25)
    _, seconds = clock.timed_call("cuda:0", lambda: None)
    assert seconds == pytest.approx(0.25)


def test_cpu_timer_never_touches_cuda(monkeypatch) -> None:
    def fail(device=None) -> None:
        raise AssertionError("synchronized a CUDA device for CPU work")

    monkeypatch.setattr(torch.cuda, "synchronize", fail)
    with device_timer(torch.device("cpu")) as elapsed:
        sum(range(1000))
    assert elapsed.seconds > 0.0
    clock.synchronize("meta")  # other devices: nothing to wait for


def test_stage_cost_measurement_times_the_device(monkeypatch, llama_dir) -> None:
    """--measure-costs and the auto settings time forwards with the device timer."""
    from specpipe.common.model.loading import load_stage
    from specpipe.common.model.partition import LayerRange
    from specpipe.common.perf import cost_model
    from specpipe.common.runtime.stage import StageRuntime

    devices = []

    def timer(device):
        devices.append(torch.device(device))
        return device_timer(device)

    monkeypatch.setattr(cost_model, "device_timer", timer)
    rt = StageRuntime(load_stage(llama_dir, LayerRange(0, 2, 5), torch.float64, "cpu"))
    curve = cost_model.measure_runtime(rt, rows=(1, 4), context=8, repeats=1)
    assert devices and all(d.type == "cpu" for d in devices)
    assert len(curve.seconds) == 2


def test_timed_call_reads_the_clock_after_the_device_finished(monkeypatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    with measuring_costs():
        result, seconds = clock.timed_call("cuda:0", lambda x: events.append(f"work {x}") or x, 7)
    assert (result, events) == (7, ["sync", "work 7", "sync"]) and seconds >= 0.0
    assert not clock.is_measuring_costs()


def test_the_pacer_paces_to_device_time_not_launch_time(monkeypatch) -> None:
    """--emulate-costs: a forward whose kernels are launched in 1 ms and run 4 ms more
    on the device took 5 ms; the pacer sleeps the rest of its model's 10 ms, not 9."""
    from specpipe.common.perf.emulate import EmulatedCosts, Pacer, paced
    from specpipe.common.spec.messages import Activation

    from .test_emulate import FakeClock

    fake = FakeClock()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: fake.advance(0.004))
    pacer = Pacer(EmulatedCosts.flat(0.010).stage(), clock=fake, sleep=fake.sleep)
    acts = [Activation("r", torch.arange(8))]
    with paced(pacer, acts, torch.device("cuda", 0)):
        fake.advance(0.001)  # the launches
    assert pacer.real_seconds == pytest.approx(0.005)
    assert fake.slept == [pytest.approx(0.005)]
